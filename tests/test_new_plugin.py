"""``rltk new plugin``: the package it writes passes its own tests as written, installs, and rltk finds it."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig

import pytest

from rltk.commands.cli import main
from rltk.commands.new_plugin import TEMPLATES

from tests.waits import scaled


def run(args, **env):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=scaled(300),
                          env={**os.environ, **env})


@pytest.mark.parametrize("kind", sorted(TEMPLATES))
def test_each_kind_writes_a_package_whose_own_tests_pass(tmp_path, kind):
    assert main(["new", "plugin", f"my_{kind}", "--kind", kind, "--dir", str(tmp_path)]) == 0
    folder = tmp_path / f"rltk-plugin-my-{kind.replace('_', '-')}"
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()) == sorted(
        ["README.md", "pyproject.toml", f"rltk_plugin_my_{kind}/__init__.py", f"tests/test_my_{kind}.py"])
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=folder,
                         capture_output=True, text=True, timeout=scaled(300))
    assert out.returncode == 0 and "2 passed" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]


def test_installed_it_is_listed_and_configured_by_name_with_its_argument_check(tmp_path):
    assert main(["new", "plugin", "demo_adv", "--kind", "advantage_fn", "--dir", str(tmp_path)]) == 0
    folder, prefix = tmp_path / "rltk-plugin-demo-adv", tmp_path / "prefix"
    # an editable install into a prefix of its own, so this environment is left as it was
    out = run(["-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--prefix", str(prefix), "-e",
               str(folder)])
    assert out.returncode == 0, out.stderr[-2000:]
    site = sysconfig.get_path("purelib", vars={"base": str(prefix), "platbase": str(prefix)})
    env = {"PYTHONPATH": os.pathsep.join([site, str(folder)])}  # its dist-info (entry point) and its code
    listed = run(["-m", "rltk.commands.cli", "list", "advantage_fn"], **env)
    assert listed.returncode == 0 and "demo_adv" in listed.stdout and "rltk-plugin-demo-adv" in listed.stdout, \
        listed.stdout[-2000:] + listed.stderr[-2000:]
    ok = run(["-m", "rltk.commands.cli", "validate", "grpo", "algorithm.advantage_fn=demo_adv"], **env)
    assert ok.returncode == 0, ok.stderr[-2000:]
    bad = run(["-m", "rltk.commands.cli", "validate", "grpo", "algorithm.advantage_fn=demo_adv",
               "algorithm.advantage_fn_args.scale=0"], **env)
    assert bad.returncode == 2 and "'scale' = 0: must be a number > 0" in bad.stderr, bad.stderr[-2000:]


def test_a_bad_kind_name_or_folder_is_exit_2_and_writes_nothing(tmp_path, capsys):
    assert main(["new", "plugin", "x", "--kind", "workflow", "--dir", str(tmp_path)]) == 2
    assert "--kind 'workflow': `rltk new plugin` writes one of advantage_fn, reward_fn, policy_loss" in \
        capsys.readouterr().err
    assert main(["new", "plugin", "My-Adv", "--dir", str(tmp_path)]) == 2
    assert "must be a lowercase Python name" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    assert main(["new", "plugin", "twice", "--dir", str(tmp_path)]) == 0
    capsys.readouterr()
    assert main(["new", "plugin", "twice", "--dir", str(tmp_path)]) == 2
    assert "exists already" in capsys.readouterr().err
