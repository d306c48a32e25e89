"""The documentation site cannot drift from the code.

* ``mkdocs build --strict`` passes: a broken link, a missing anchor or an unresolved API reference fails it.
* The generated component catalogue lists every name the registry holds, of every kind (builtins and the
  installed example plugins), each under its own anchor.
* Every ``rltk validate`` line in the README's and the tutorials' shell blocks exits 0 when run as written (from the
  repository root, where the tutorials' relative paths point), and so does every ``rltk run`` line's config
  (validated, not trained: the same recipe and overrides), except lines that name what the reader brings: a
  model or data file of theirs, a run folder an earlier line makes, a plugin they wrote.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytest.importorskip("mkdocs", reason="the docs extra (pip install -e '.[docs]') builds the site")


def _anchor(kind: str, name: str) -> str:
    # as docs/hooks/generated_pages.py writes it
    return re.sub(r"[^a-z0-9]+", "-", f"{kind}-{name}".lower()).strip("-")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    if shutil.which("mkdocs") is None and not (Path(sys.executable).parent / "mkdocs").exists():
        pytest.skip("mkdocs is not installed")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(REPO)}
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-4000:]
    return out


def test_the_catalogue_lists_every_registered_component_of_every_kind(site):
    from rltk.registry import KINDS, list_components

    page = (site / "reference" / "components" / "index.html").read_text()
    entries = list_components()
    assert {e.kind for e in entries} >= {"advantage_fn", "policy_loss", "reward_fn", "algorithm"}
    assert any(e.plugin.startswith("rltk-plugin-example") for e in entries), "the example plugin is not installed"
    missing = [f"{e.kind} {e.name}" for e in entries if f'id="{_anchor(e.kind, e.name)}"' not in page]
    assert not missing, f"registered but not in the catalogue: {missing}"
    for kind in KINDS:
        assert f'id="kind-{kind}"' in page, kind
    # a component's own arguments and defaults, read from its signature: grpo's eps=1e-06, norm_by_std=True
    grpo = page[page.index('id="advantage-fn-grpo"'):page.index('id="advantage-fn-grpo-passk"')]
    assert "norm_by_std" in grpo and "1e-06" in grpo and "filled in by rltk" in grpo


def test_the_batch_field_page_lists_every_field(site):
    from rltk.batch_types import FIELD_SHAPES

    page = (site / "reference" / "batch-fields" / "index.html").read_text()
    assert all(f"<code>{name}</code>" in page for name in FIELD_SHAPES)


#: What a reader brings to a ``rltk run`` line (their model, data, an earlier line's run folder, a plugin):
#: such lines are not validated here.
READERS_OWN = re.compile(r"/models/|\.jsonl|\.parquet|runs/|--config|\.\.\.|my_adv|my-env|servers=|url=")


def _validate_lines() -> list[tuple[str, list[str]]]:
    found = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        for block in re.findall(r"```bash\n(.*?)```", doc.read_text(), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.strip()
                if line.startswith("rltk validate "):
                    found.append((f"{doc.relative_to(REPO)}: {line}", shlex.split(line, comments=True)[2:]))
                elif line.startswith("rltk run ") and not READERS_OWN.search(line.split("#")[0]):
                    found.append((f"{doc.relative_to(REPO)}: {line}", shlex.split(line, comments=True)[2:]))
    return found


def test_every_validate_line_and_every_run_lines_config_in_the_docs_passes():
    lines = _validate_lines()
    assert len(lines) >= 20, lines
    # One process for all of them: validate's cost is mostly importing rltk and its dependencies.
    script = (
        "import contextlib, io, json, sys\n"
        "from rltk.commands.cli import main\n"
        "codes = []\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err):\n"
        "        try:\n"
        "            code = main(['validate', *argv])\n"
        "        except SystemExit as exc:\n"
        "            code = exc.code\n"
        "    codes.append([code or 0, err.getvalue()[-1500:]])\n"
        "print(json.dumps(codes))\n"
    )
    run = subprocess.run([sys.executable, "-c", script, json.dumps([argv for _, argv in lines])], cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    codes = json.loads(run.stdout.strip().splitlines()[-1])
    failed = [f"{where} -> exit {code}: {err}" for (where, _), (code, err) in zip(lines, codes) if code != 0]
    assert not failed, "\n".join(failed)
