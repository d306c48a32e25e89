"""The documentation site cannot drift from the code.

* ``mkdocs build --strict`` passes: a broken link, a missing anchor or an unresolved API reference fails it.
* The generated component catalogue lists every name the registry holds, of every kind (builtins and the
  installed example plugins), each under its own anchor.
* Every ``rltk validate`` line in the README's and the pages' shell blocks exits 0 when run as written (from the
  repository root, where the pages' relative paths point), and so does every ``rltk run`` line's config.
* Every ``rltk run``, ``rltk export`` and ``rltk new`` line of a page runs as written, in the page's order, in a
  folder of its own, with every stage cut to two steps on a few rows (``SHORT_RUN``, appended); a checkpoint a
  later line names at its full-length step is found at the shortened run's same stage end. Each run exits 0,
  ends with its held-out evaluation line, and writes what the pages say it writes (the files of ``runs/X/``,
  the metrics of ``LOGGED``); the getting-started page's printed run matches what rltk prints, line for line.
  Lines that name what a reader brings (their model, data or environment, a server, vLLM, several machines:
  ``READERS_OWN``) are neither validated nor run.
* Every page, anchor or section that code, configs, tests or the guides point a reader to exists (README's
  sections moved to the site: a pointer to one that is gone fails).
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

from tests.waits import scaled

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
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=scaled(300))
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


#: What a reader brings to a line of a shell block, so the tests neither validate nor run it: their model, data
#: or environment (`/models/...`, a `.jsonl`, `my-env`), a server, GPU or machines of theirs (`url=`, `servers=`,
#: a vLLM engine), an argument left for them to fill in (`...`, `<name>`, `$KEY`).
READERS_OWN = re.compile(r"/models/|\.jsonl|\.parquet|my_env|my-env|\.\.\.|<\w+>|\$|servers=|url=|rollout\.engine=vllm")
#: What an earlier line of the same page makes (a run folder, an exported model, the plugin `rltk new` writes):
#: such a line is run after that one (test_a_pages_commands_run_as_written), not validated alone.
MADE_EARLIER = re.compile(r"runs/|models/|my_adv")
PAGES = [*sorted((REPO / "docs").rglob("*.md")), REPO / "README.md"]


def _shell_lines(doc: Path) -> list[str]:
    """The ``rltk ...`` commands of a page's bash blocks, continuation lines joined, ``a && rltk b`` split."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", doc.read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for command in line.split("&&"):
                command = re.sub(r"\s+", " ", command.strip())
                if command.startswith("rltk "):
                    found.append(command)
    return found


def _validate_lines() -> list[tuple[str, list[str]]]:
    found = []
    for doc in PAGES:
        for line in _shell_lines(doc):
            argv = shlex.split(line, comments=True)[1:]
            code = line.split("#")[0]
            if argv[0] == "validate" or (argv[0] == "run" and not READERS_OWN.search(code)
                                         and not MADE_EARLIER.search(code)):
                found.append((f"{doc.relative_to(REPO)}: {line}", argv[1:]))
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
                         env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=scaled(300))
    assert run.returncode == 0, run.stderr[-4000:]
    codes = json.loads(run.stdout.strip().splitlines()[-1])
    failed = [f"{where} -> exit {code}: {err}" for (where, _), (code, err) in zip(lines, codes) if code != 0]
    assert not failed, "\n".join(failed)


# -- The pages' commands, run as written ----------------------------------------------------------------------------

#: Appended to every `rltk run` line the tests run: each stage two steps on a few rows (a stage's own
#: `overrides` still win: docs/examples/chain.yaml's 100 DPO and 200 GRPO steps run as written), held-out
#: evaluation only at the end, a checkpoint only at each stage's end (where a later line looks for it).
SHORT_RUN = ["data.train_size=40", "data.eval_size=4", "sft.steps=2", "sft.warmup_steps=0", "sft.stop_at_accuracy=null",
             "trainer.total_steps=2", "trainer.warmup_steps=0", "trainer.prompts_per_step=2", "rollout.n=2",
             "reward_model.steps=2", "reward_model.warmup_steps=0", "trainer.eval_every=0", "checkpoint.every=1000"]
#: What a page says its runs log, checked both ways: the page names the metric, and one of its runs logs it.
LOGGED = {
    "docs/tutorials/async.md": ["staleness/mean", "staleness/max", "staleness/dropped", "staleness/waited_s",
                                "producers/alive", "producer/sample_s", "producer/gate_wait_s"],
    "docs/tutorials/distillation.md": ["distill/reverse_kl", "distill/teacher_logprob", "distill/student_logprob"],
    "docs/tutorials/dpo-and-opmd.md": ["rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                                       "logps/chosen", "logps/rejected"],
    "docs/tutorials/own-model-and-data.md": ["reward/exact_match"],
    "docs/tutorials/serving.md": ["rollout/tool_calls", "agentic/opening_mismatch"],
}


def _runnable(line: str) -> bool:
    argv = shlex.split(line, comments=True)
    return argv[1] in ("run", "export", "new") and not READERS_OWN.search(line.split("#")[0])


def _pages_commands() -> dict[str, list[str]]:
    """Each page's runnable commands, in order; a line an earlier page runs too (and that needs nothing an earlier
    line of its own page made) runs on the first page only."""
    pages, seen = {}, set()
    for doc in PAGES:
        lines = [line.split(" #")[0] for line in _shell_lines(doc) if _runnable(line)]
        lines = [line for line in lines if MADE_EARLIER.search(line) or line not in seen]
        seen.update(lines)
        if lines:
            pages[str(doc.relative_to(REPO))] = lines
    return pages


def _claimed_files() -> dict[str, set[str]]:
    """What the pages say a run folder holds: "The run writes `runs/X/` ... `metrics.jsonl`, `checkpoints/` ..."."""
    claims: dict[str, set[str]] = {}
    for doc in PAGES:
        for folder, paragraph in re.findall(r"writes `(runs/[\w.-]+)/`(.*?)\n\n", doc.read_text(), flags=re.S):
            names = re.findall(r"`([\w-]+(?:\.(?:jsonl|json|png|yaml)|/))`", paragraph)
            claims.setdefault(folder, set()).update(names)
    return claims


def _config(argv: list[str]):
    """The resolved config of ``rltk run RECIPE [--config FILE ...] key=value ...``, as ``cmd_run`` builds it."""
    from rltk.config.loader import load_config
    from rltk.recipe_tools.validation import config_layers, resolve_recipe, shipped_recipe_spec

    recipe = resolve_recipe(argv[1])
    files = [Path(argv[i + 1]) for i, a in enumerate(argv) if a == "--config"]
    overrides = [a for i, a in enumerate(argv[2:], 2) if a != "--config" and argv[i - 1] != "--config"]
    defaults, chosen = config_layers(recipe, files)
    return load_config(chosen, overrides, recipe=shipped_recipe_spec(recipe), warn=False, defaults=defaults)


def _stage_ends(argv: list[str], cfg) -> list[int]:
    """The step of each stage's last checkpoint, counted as rltk/training/stages/run.py counts stages' steps (the
    reward-model recipe trains its model after them)."""
    from rltk.recipe_tools.validation import resolve_recipe
    from rltk.training.scaffold.setup import stage_config

    ends, step = [], 0
    for i, stage in enumerate(cfg.stages):
        settings = stage_config(cfg, i)
        step += settings.sft.steps if stage.type == "sft" else settings.trainer.total_steps
        ends.append(step)
    if resolve_recipe(argv[1]).stem == "reward_model":
        ends.append(step + cfg.reward_model.steps)
    return ends


def _short_checkpoints(argv: list[str], made: dict[str, tuple[list[int], list[int]]]) -> list[str]:
    """A checkpoint an earlier line wrote, named by the page at its full length (`step_001500`), is found in the
    shortened run at the same stage's end; the page's number must be a stage end of that line as written."""
    def shorten(match):
        folder, step = match.group(1), int(match.group(2))
        full, short = made[folder]
        assert step in full, f"{folder}/checkpoints/step_{step:06d}: the run as written ends its stages at {full}"
        return f"{folder}/checkpoints/step_{short[full.index(step)]:06d}"

    return [re.sub(r"(runs/[\w.-]+)/checkpoints/step_(\d+)", shorten, a) for a in argv]


def _new_plugin(argv: list[str], monkeypatch) -> str:
    """``rltk new plugin NAME ...`` as the page has it, then what its ``pip install -e`` does: the package on the path
    and its entry point's module registered (tests/test_new_plugin.py installs one for real)."""
    import importlib

    import rltk
    from rltk.commands.cli import main

    assert main(argv) == 0
    name = argv[2]
    monkeypatch.syspath_prepend(str(Path.cwd() / f"rltk-plugin-{name.replace('_', '-')}"))
    rltk.register_plugin(importlib.import_module(f"rltk_plugin_{name}"), name=f"rltk-plugin-{name}")
    return f"rltk-plugin-{name}"


@pytest.mark.slow  # about 25 runs of two steps a stage over all pages, a few seconds each
@pytest.mark.parametrize("page", sorted(_pages_commands()))
def test_a_pages_commands_run_as_written(page, tmp_path, monkeypatch, capsys):
    import rltk
    from rltk.commands.cli import main

    monkeypatch.chdir(tmp_path)  # the runs/ folders the pages name are made here
    for shipped in ("docs", "recipes"):  # what the pages' relative paths point at (docs/examples/chain.yaml ...)
        (tmp_path / shipped).symlink_to(REPO / shipped)
    claims, made, logged, plugins = _claimed_files(), {}, set(), []
    try:
        for line in _pages_commands()[page]:
            argv = shlex.split(line)[1:]
            if argv[0] == "new":
                plugins.append(_new_plugin(argv, monkeypatch))
                continue
            argv = _short_checkpoints(argv, made)
            if argv[0] == "run":
                full = _stage_ends(argv, _config(argv))
                argv += SHORT_RUN
                cfg = _config(argv)
            code = main(argv)
            out = capsys.readouterr()
            assert code == 0, f"{page}: `{line}` exited {code}:\n{out.err[-3000:]}"
            if argv[0] == "export":
                assert (Path(argv[2]) / "config.json").is_file() and list(Path(argv[2]).glob("*.safetensors")), line
                continue
            run_dir = Path(cfg.output_dir)
            made[cfg.output_dir] = (full, _stage_ends(argv, cfg))
            # the line a run ends with: its held-out evaluation, or where the reward model it trained is
            assert re.search(rf"^rltk: (final held-out eval/accuracy=\d|reward model saved to {run_dir}/reward_model )",
                             out.out, flags=re.M), (line, out.out[-2000:])
            rows = [json.loads(row) for row in (run_dir / "metrics.jsonl").read_text().splitlines()]
            logged.update(key for row in rows for key in row)
            missing = [name for name in claims.get(cfg.output_dir, ()) if not (run_dir / name).exists()]
            assert not missing, f"the docs say {cfg.output_dir}/ holds {missing}; `{line}` did not write them"
    finally:
        for name in plugins:
            rltk.unregister_plugin(name)
    text = (REPO / page).read_text()
    for metric in LOGGED.get(page, []):
        assert f"`{metric}`" in text, f"{page} no longer names {metric}: update LOGGED"
        assert metric in logged, f"{page} says its runs log {metric}; none did"


def _shape(line: str) -> str:
    """A printed line with its numbers (``4.645``, ``-0.001``, ``1.1k``, ``3m08s``, ``0.83s``, ``1e-05``) made alike."""
    return re.sub(r"-?\d+(?:m\d+)?(?:\.\d+)?(?:e-?\d+)?[ks]?", "N", line.strip())


@pytest.mark.slow  # the page's own shortened run: a 60-step warm-up and 3 GRPO steps on the default data
def test_the_run_getting_started_shows_prints_lines_of_that_shape(tmp_path, capsys):
    from rltk.commands.cli import main

    page = (REPO / "docs" / "getting-started.md").read_text()
    command, shown = re.search(r"```text\n\$ (rltk run [^\n]*)\n(.*?)```", page, flags=re.S).groups()
    # as the page has it, but in this test's folder
    argv = [f"output_dir={tmp_path}" if a.startswith("output_dir=") else a for a in shlex.split(command)[1:]]
    assert main(argv) == 0
    out = capsys.readouterr()
    printed = {_shape(line) for line in (out.out + out.err).splitlines()}
    drifted = [line for line in shown.splitlines() if _shape(line) not in printed]
    assert not drifted, "getting-started.md shows lines `" + command + "` no longer prints:\n" + "\n".join(drifted) \
        + "\nit printed:\n" + (out.out + out.err)[-3000:]


# -- Pointers into the docs from the code, the configs and the contributor guide ----------------------------------

#: Where readers are sent to a page or a section: a comment, docstring or message in these, or the guide.
POINTING = ["rltk", "benchmarks", "recipes", "plugins", "tests", "CONTRIBUTING.md", "README.md"]


def _generated_pages() -> set[str]:
    sys.path.insert(0, str(REPO / "docs" / "hooks"))
    try:
        import generated_pages
    finally:
        sys.path.pop(0)
    return {generated_pages.CATALOGUE, generated_pages.BATCH_FIELDS}


GENERATED = _generated_pages()


def _page_text(path: Path) -> str:
    text = path.read_text()
    included = re.search(r'^--8<-- "([^"]+)"', text, flags=re.M)  # docs/contributing.md shows CONTRIBUTING.md
    return (REPO / included.group(1)).read_text() if included else text


def _headings(path: Path) -> list[str]:
    """A page's headings as read (code spans unquoted, a leading "1. " dropped), outside code blocks."""
    text = re.sub(r"```.*?```", "", _page_text(path), flags=re.S)
    return [re.sub(r"^\d+\.\s+", "", h.replace("`", "").strip()) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)]


def _anchor_of(heading: str) -> str:
    # Python-Markdown's toc slugify, which MkDocs uses
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", heading).strip().lower())


def _broken_pointers(text: str) -> list[str]:
    """Each page, anchor or section ``text`` names that does not exist: ``docs/x.md``, ``docs/x.md#anchor``,
    ``docs/x.md, "Section"``, ``README "Section"``, ``CONTRIBUTING, "Section"``."""
    text = re.sub(r"\n\s*(?:#|//)?\s*", " ", text)  # a pointer may run over a comment's line break
    broken = []
    for page, anchor, section in re.findall(r'\b(docs/[\w/.-]*?\.md)(?:#([\w-]+))?(?:,\s+"([^"]+)")?', text):
        path = REPO / page
        if page.removeprefix("docs/") in GENERATED:
            continue  # written when the site is built
        if not path.is_file():
            broken.append(f"{page}: no such page")
        elif anchor and anchor not in {_anchor_of(h) for h in _headings(path)}:
            broken.append(f"{page}#{anchor}: no such heading")
        elif section and not any(h.startswith(section) for h in _headings(path)):
            broken.append(f'{page}, "{section}": no such heading')
    for doc, section in re.findall(r'\b(README|CONTRIBUTING)(?:\.md)?(?:\'s|,)?\s+"([^"]+)"', text):
        if not any(h.startswith(section) for h in _headings(REPO / f"{doc}.md")):
            where = {"README": "README.md, whose sections moved to docs/", "CONTRIBUTING": "CONTRIBUTING.md"}[doc]
            broken.append(f'{doc} "{section}": no such section in {where}')
    return broken


def test_the_pointers_checker_finds_a_moved_section_and_a_missing_page():
    assert _broken_pointers('see README, "Several machines"; docs/tutorials/async.md, "Several machines"') == [
        'README "Several machines": no such section in README.md, whose sections moved to docs/']
    assert _broken_pointers("docs/nowhere.md and docs/tutorials/async.md#nowhere") == [
        "docs/nowhere.md: no such page", "docs/tutorials/async.md#nowhere: no such heading"]


def test_every_page_and_section_the_code_and_the_guides_point_to_exists():
    broken = []
    for root in POINTING:
        files = [REPO / root] if (REPO / root).is_file() else sorted((REPO / root).rglob("*"))
        for path in files:
            if path.suffix in (".py", ".yaml", ".yml", ".sh", ".md", ".toml") and path != Path(__file__).resolve():
                broken += [f"{path.relative_to(REPO)}: {b}" for b in _broken_pointers(path.read_text())]
    assert not broken, "\n".join(broken)


@pytest.mark.slow  # a two-step run, then a server process (~15-30 s)
def test_the_served_run_answers_the_serving_pages_client(tmp_path, monkeypatch):
    import openai

    from rltk.commands.cli import main
    from tests.serve.test_cli_serve import start_serving, stop

    page = REPO / "docs" / "tutorials" / "serving.md"
    serve = next(line for line in _shell_lines(page) if line.startswith("rltk serve "))
    client_code = re.search(r"```python\n(.*?)```", page.read_text(), flags=re.S).group(1).strip().splitlines()
    monkeypatch.chdir(tmp_path)
    assert main(["run", "grpo", *SHORT_RUN]) == 0  # runs/grpo-tiny, the folder the page serves
    # the page's line with its key filled in, on a free port instead of 8000
    argv = shlex.split(serve.replace('"$KEY"', "docs-key"), comments=True)[2:]
    port = argv.index("--port")
    del argv[port:port + 2]
    proc, url = start_serving(tmp_path / argv[0], *argv[1:])
    try:
        scope = {"KEY": "docs-key"}
        exec("\n".join(client_code[:-1]).replace("http://127.0.0.1:8000/v1", url), scope)
        reply = eval(client_code[-1], scope)
        assert reply.model == "grpo-tiny" and isinstance(reply.choices[0].message.content, str)
        with pytest.raises(openai.AuthenticationError):  # --api-key: nothing answers without it
            openai.OpenAI(base_url=url, api_key="another", max_retries=0).models.list()
    finally:
        stop(proc)
