"""`rltk serve`: a model folder, a checkpoint or a run folder answered through the official openai client;
and rltk without the serve extra."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import openai
import pytest

from rltk.commands.cli import main

from tests.waits import scaled

REPO = Path(__file__).resolve().parents[2]


def start_serving(path, *extra, timeout_s: float = 120):
    """`rltk serve PATH --port 0` in a subprocess; returns the process and the base URL it printed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "rltk.commands.cli", "serve", str(path), "--port", "0",
                             "--log-level", "warning", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if "serving model" in line:
            return proc, line.split(" at ")[1].split()[0]
        if proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"rltk serve did not start: {proc.stderr.read()[-3000:]}")


def stop(proc):
    proc.terminate()
    try:
        proc.wait(timeout=scaled(30))
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


@pytest.mark.slow  # a 2-step warm-up that writes a checkpoint, then a server process (~15-30 s)
def test_rltk_serve_answers_the_openai_client_from_a_checkpoint_and_resolves_a_run_folder(tmp_path):
    run_dir = tmp_path / "run"
    assert main(["run", "grpo", f"output_dir={run_dir}", "sft.steps=2", "sft.warmup_steps=0",
                 "sft.stop_at_accuracy=null", "data.train_size=40", "data.eval_size=8", "checkpoint.every=2",
                 "checkpoint.resume=never", "logging.logger=[jsonl]", "logging.plot=false",
                 "stages=[{name: warmup, type: sft}]"]) == 0
    checkpoint = run_dir / "checkpoints" / "step_000002"
    proc, url = start_serving(checkpoint, "--max-tokens", "6")
    try:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["step_000002"]
        reply = client.chat.completions.create(model="step_000002", messages=[{"role": "user", "content": "12+3="}],
                                               temperature=0, logprobs=True)
        choice = reply.choices[0]
        assert choice.finish_reason in ("stop", "length") and reply.usage.completion_tokens >= 1
        assert all(t.logprob <= 0 for t in choice.logprobs.content)
        with pytest.raises(openai.BadRequestError, match="budget of 6"):
            client.completions.create(model="step_000002", prompt="1+1=", max_tokens=7)
    finally:
        stop(proc)
    # a run folder means its newest checkpoint, exported (weights and the run's tokenizer) to a temporary folder
    import contextlib

    from rltk.commands.serve import resolve_model_dir

    with contextlib.ExitStack() as stack:
        model_dir, found_run = resolve_model_dir(str(run_dir), stack)
        assert found_run == run_dir
        assert (model_dir / "model.safetensors").read_bytes() == (checkpoint / "model" / "model.safetensors").read_bytes()
        assert (model_dir / "tokenizer.json").is_file()
    assert not model_dir.exists()  # removed with the stack


def test_serve_refuses_a_path_that_is_no_model_checkpoint_or_run(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("hi")
    assert main(["serve", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "neither a model folder (no config.json)" in err and "notes.txt" in err
    assert main(["serve", str(tmp_path / "missing")]) == 2
    (tmp_path / "checkpoints").mkdir()
    assert main(["serve", str(tmp_path)]) == 2
    assert "has no complete checkpoint" in capsys.readouterr().err


def test_a_model_folder_is_served_as_it_is(tmp_path):
    import contextlib

    from rltk.models.tiny import build_char_tokenizer, build_tiny_model, save_pretrained_dir
    from rltk.commands.serve import resolve_model_dir

    tokenizer = build_char_tokenizer()
    folder = save_pretrained_dir(build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2,
                                                  num_kv_heads=1, intermediate_size=64), tokenizer, tmp_path / "m")
    with contextlib.ExitStack() as stack:
        assert resolve_model_dir(str(folder), stack) == (folder, None)


def test_rltk_imports_and_builds_the_agentic_workflow_without_the_serve_extra_and_says_what_to_install():
    """With fastapi, uvicorn and openai unimportable: `import rltk`, the CLI parser, the sessions module and
    the workflow's constructor work; starting the endpoint names `pip install 'rltk[serve]'`."""
    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("fastapi", "uvicorn", "openai", "starlette"):
                    raise ImportError(f"No module named {name!r} (blocked)")
        sys.meta_path.insert(0, Block())
        import rltk, rltk.commands.cli
        from rltk.serve.sessions import stitch
        from rltk.workflows.agentic import AgenticWorkflow
        from rltk.rollout.base import SamplingParams
        rltk.commands.cli.build_parser().parse_args(["serve", "--port", "0"])
        wf = AgenticWorkflow(engine=None, tokenizer=None, reward=lambda **k: 0.0, sampling=SamplingParams(),
                             agent="arithmetic_chat")
        try:
            wf.run([{"prompt": "1+1=", "ground_truth": "2"}])
        except ImportError as exc:
            print("ERROR:", exc)
        try:
            import rltk.serve.app
        except ImportError as exc:
            print("APP:", exc)
        sys.exit(rltk.commands.cli.main(["serve"]))
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    setup = "from tests.serve.helpers import ensure_serve_builtins; ensure_serve_builtins()\n"
    out = subprocess.run([sys.executable, "-c", setup + code], capture_output=True, text=True, env=env, timeout=scaled(300),
                         cwd=REPO)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "ERROR: the agentic workflow needs fastapi, uvicorn, openai" in out.stdout
    assert "install the serve extra: pip install 'rltk[serve]'" in out.stdout
    assert "APP: the OpenAI-compatible endpoint needs fastapi, uvicorn" in out.stdout
    assert "rltk: error: rltk serve needs fastapi, uvicorn" in out.stderr


def test_listening_beyond_loopback_without_a_key_is_warned_about_before_binding(capsys):
    # 203.0.113.1 (TEST-NET-3) is on no interface here: the warning comes first, then the bind fails in one line,
    # so nothing is ever exposed by this test
    assert main(["serve", "--host", "203.0.113.1", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "WARNING: listening on 203.0.113.1 without an API key" in err
    assert "cannot listen on 203.0.113.1:0 (--host/--port)" in err and "Traceback" not in err
    assert main(["serve", "--host", "203.0.113.1", "--port", "0", "--api-key", "k"]) == 2
    assert "WARNING" not in capsys.readouterr().err


def test_rltk_serve_records_nothing_by_default_and_says_when_the_context_lowers_max_tokens(capsys):
    from rltk.commands.cli import build_parser
    from rltk.commands.serve import build_server_app

    parser = build_parser()
    app, stack, _ = build_server_app(parser.parse_args(["serve"]))
    with stack:
        state = app.state.rltk
        assert state.store is None and state.api_keys == [] and app.openapi_url is None
        # the docs (tutorials/serving.md): --max-tokens 256 by default, at most the context (256 positions for the tiny model) minus one
        assert parser.parse_args(["serve"]).max_tokens == 256 and state.max_tokens_limit == 255
        assert "a request may ask for at most 255" in capsys.readouterr().err
        state.batcher.close()
    page = (REPO / "docs" / "tutorials" / "serving.md").read_text()  # the README's serving section moved there
    assert "`--max-tokens` (default 256)" in page and "255 for the tiny model's 256 positions" in page
    app, stack, _ = build_server_app(parser.parse_args(["serve", "--record-sessions", "--session-max-records", "7"]))
    with stack:
        assert app.state.rltk.store.max_records == 7
        app.state.rltk.batcher.close()
