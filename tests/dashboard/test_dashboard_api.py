"""The dashboard's API against a real server: the generated form, validation as `rltk validate` does it,
saving a YAML that the CLI accepts, the run viewer's data, and what it refuses."""

from __future__ import annotations

import pytest
import yaml

from rltk.commands.cli import main
from rltk.dashboard.builder import error_key, leaf_values
from rltk.dashboard.schema import form_description
from tests.dashboard.conftest import write_run


def fields(section):
    out = {f["key"]: f for f in section["fields"]}
    for sub in section["sections"]:
        out.update(fields(sub))
    return out


def test_the_form_is_generated_from_the_schema_and_the_registry():
    form = form_description()
    by_key = fields(form["schema"])
    # a key with its type, default and the comment beside it in rltk/config/schema.py
    steps = by_key["trainer.total_steps"]
    assert (steps["type"], steps["default"], steps["widget"]) == ("int", 200, "int")
    assert steps["doc"] == "optimizer steps of the RL stage"
    assert by_key["model.tiny.hidden_size"]["default"] == 64  # nested dataclasses become subsections
    assert by_key["model.dtype"]["choices"] == ["float32", "bfloat16", "float16"]
    assert by_key["logging.traces"]["doc"].startswith("Rollout traces")  # the comment block above a key
    assert by_key["algorithm.advantage_fn"]["component"] == "advantage_fn"
    assert by_key["reward.reward_fn"]["multiple"] is True
    # every registered component with its own arguments, read from its signature (batch fields left out)
    grpo = next(c for c in form["components"]["advantage_fn"] if c["name"] == "grpo")
    assert {a["name"]: a["default"] for a in grpo["args"]} == {"norm_by_std": True, "eps": 1e-6}
    # a plugin's component, installed with pip, is there with its arguments and no UI code
    overlong = next(c for c in form["components"]["reward_fn"] if c["name"] == "overlong_penalty")
    assert overlong["plugin"].startswith("rltk-plugin-example")
    assert {a["name"]: a["default"] for a in overlong["args"]} == {"max_length": 512, "buffer_length": 128,
                                                                   "unit": "chars"}
    # presets, with what each sets
    assert form["presets"]["dapo"]["sets"]["algorithm.policy_loss_args"] == {"clip_eps_low": 0.2, "clip_eps_high": 0.28}
    assert form["presets"]["dapo"]["sets"]["algorithm.dynamic_sampling"] is True
    assert set(form["beginner"]) >= {"model.path", "data.task", "algorithm.name", "trainer.total_steps",
                                     "rollout.engine"}


def test_the_form_describes_sections_and_components_in_prose():
    form = form_description()

    def sections(section):
        yield section
        for sub in section["sections"]:
            yield from sections(sub)

    docs = {s["key"]: s["doc"] for s in sections(form["schema"])}
    assert not [k for k, d in docs.items() if "Config(" in d or "``" in d]  # no dataclass reprs, no RST
    assert docs["trainer"].startswith("The RL stage's optimisation")  # the class's docstring
    assert docs["sft"] == "The supervised warm-up stage (type: sft in stages)."
    by_key = fields(form["schema"])
    assert by_key["stages"]["default"] == [{"name": "rl", "type": "rl", "overrides": {}}]  # data, not a repr
    assert by_key["stages"]["doc"].startswith("the stages the run trains, in order")
    assert by_key["data.task"]["choices"] == form["tasks"] and "arithmetic" in form["tasks"]
    for kind, components in form["components"].items():
        for c in components:
            assert "``" not in c["summary"] and ":func:" not in c["summary"], (kind, c["name"], c["summary"])
    hf = next(c for c in form["components"]["rollout_engine"] if c["name"] == "hf")
    assert hf["summary"] and hf["summary"][-1] in ".:)", hf["summary"]  # a whole sentence, not a cut line


def test_summaries_drop_markup_and_stop_at_a_sentence():
    from rltk.dashboard.schema import plain_text, summary_of

    assert plain_text("uses ``hf`` and :func:`rltk.x.y`, `z`") == "uses hf and rltk.x.y, z"
    doc = "Group-relative advantage (GRPO); ``norm_by_std=False`` is Dr. GRPO.\n\nMore."
    assert summary_of(doc) == "Group-relative advantage (GRPO); norm_by_std=False is Dr. GRPO."
    long = "First sentence runs over two lines\nof the docstring. " + "Second one. " * 20
    assert summary_of(long) == "First sentence runs over two lines of the docstring."


def test_error_key_finds_the_field_an_error_names():
    known = {"trainer.lr", "algorithm.advantage_fn", "algorithm.advantage_fn_args"}
    assert error_key("bad value -1.0 for 'trainer.lr': must be > 0", known) == "trainer.lr"
    assert error_key("unknown advantage_fn 'rlooo' at 'algorithm.advantage_fn'. Did you mean: 'rloo'?",
                     known) == "algorithm.advantage_fn"
    assert error_key("'algorithm.advantage_fn_args.foo': advantage_fn 'grpo' has no argument 'foo'",
                     known) == "algorithm.advantage_fn_args"
    assert error_key("something else", known) is None
    assert leaf_values({"a": {"b": 1, "c": {}}, "d": [1, 2]}) == {"a.b": 1, "a.c": {}, "d": [1, 2]}


def test_build_validates_like_rltk_validate_and_save_writes_a_yaml_the_cli_accepts(dashboard):
    client, _, save_dir = dashboard
    status, result = client.post("/api/build", {"recipe": "grpo", "overrides": ["trainer.lr=-1"]})
    assert status == 200 and result["ok"] is False
    assert result["error"] == {"key": "trainer.lr", "message": "bad value -1.0 for 'trainer.lr': must be > 0"}
    assert result["values"]["trainer.lr"] == -1.0  # the form still shows what was typed

    overrides = ["algorithm.name=dapo", "algorithm.advantage_fn=rloo", "trainer.total_steps=20",
                 "reward.reward_fn=[exact_match,overlong_penalty]",
                 "reward.reward_fn_args.overlong_penalty.max_length=8"]
    status, result = client.post("/api/build", {"recipe": "grpo", "overrides": overrides})
    assert result["ok"] is True, result["error"]
    assert result["message"].startswith(
        "ok: <this file> for recipe grpo (2 stages: warmup (sft), grpo (rl, algorithm dapo))")
    assert result["command"] == "rltk run grpo " + " ".join(f"'{o}'" if "[" in o else o for o in overrides)
    values = result["values"]
    assert values["algorithm.advantage_fn"] == "rloo" and values["trainer.total_steps"] == 20
    assert values["reward.reward_fn_args.overlong_penalty.max_length"] == 8

    status, saved = client.post("/api/save", {"recipe": "grpo", "overrides": overrides, "name": "built.yaml"})
    assert saved["ok"] is True and saved["path"] == str(save_dir / "built.yaml")
    assert saved["run_command"] == f"rltk run grpo --config {save_dir / 'built.yaml'}"
    written = yaml.safe_load((save_dir / "built.yaml").read_text())
    assert written["algorithm"]["name"] == "dapo" and written["algorithm"]["advantage_fn"] == "rloo"
    assert written["data"]["task"] == "arithmetic"  # the recipe's own config, with the overrides merged in
    assert main(["validate", "--config", str(save_dir / "built.yaml"), "grpo"]) == 0


def test_only_shipped_recipes_are_built(dashboard):
    client, _, _ = dashboard
    status, result = client.post("/api/build", {"recipe": "/etc/passwd.py", "overrides": []})
    assert result["ok"] is False and "shipped recipes (" in result["error"]["message"] and not result["yaml"]


def test_the_cli_refuses_a_bad_port_and_a_busy_one(capsys):
    import socket

    assert main(["dashboard", "--port", "70000"]) == 2
    assert "--port 70000: must be in 0..65535" in capsys.readouterr().err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert main(["dashboard", "--port", str(busy.getsockname()[1])]) == 2
    assert "cannot listen on 127.0.0.1:" in capsys.readouterr().err


def test_the_cli_given_a_run_folder_lists_the_runs_beside_it(tmp_path, monkeypatch, capsys):
    import rltk.dashboard.server as server

    write_run(tmp_path / "runs" / "demo")
    served = {}
    monkeypatch.setattr(server, "serve", lambda host, port, runs_root, save_dir, ready=None: served.update(
        host=host, runs=runs_root))
    assert main(["dashboard", "--runs", str(tmp_path / "runs" / "demo")]) == 0
    assert served == {"host": "127.0.0.1", "runs": str((tmp_path / "runs").resolve())}
    assert "is a run folder" in capsys.readouterr().err


def test_save_refuses_paths_and_other_files(dashboard):
    client, _, save_dir = dashboard
    for name in ("../escape.yaml", "sub/x.yaml", "x.txt", ""):
        status, body = client.post("/api/save", {"recipe": "grpo", "overrides": [], "name": name})
        assert status == 400 and "file name" in body["error"]
    (save_dir / "mine.yaml").write_text("name: mine\n")
    status, body = client.post("/api/save", {"recipe": "grpo", "overrides": [], "name": "mine.yaml"})
    assert body["ok"] is False and "not written by the dashboard" in body["error"]["message"]
    assert (save_dir / "mine.yaml").read_text() == "name: mine\n"
    assert not (save_dir.parent / "escape.yaml").exists()


def test_requests_from_elsewhere_are_refused(dashboard):
    client, _, _ = dashboard
    status, _ = client.get("/api/form", headers={"Host": "attacker.example:80"})  # DNS rebinding
    assert status == 421
    status, body = client.request("POST", "/api/build", {"recipe": "grpo", "overrides": []},
                                  headers={"X-Rltk-Token": "wrong"})
    assert status == 403 and "X-Rltk-Token" in body["error"]
    status, page = client.get("/")
    assert status == 200 and client.server.token.encode() in page


def test_the_run_viewer_reads_a_run_folder_as_data(dashboard):
    client, runs_root, _ = dashboard
    write_run(runs_root / "demo")
    (runs_root / "empty").mkdir()  # no metrics, no traces: not a run
    status, listing = client.get("/api/runs")
    assert [r["name"] for r in listing["runs"]] == ["demo"] and listing["runs"][0]["finished"] is True
    status, run = client.get("/api/runs/demo")
    assert status == 200
    assert [p["title"] for p in run["panels"]] == ["warm-up (SFT) loss", "train reward", "held-out accuracy"]
    held_out = run["panels"][2]["curves"]
    assert [(c["label"], c["steps"], c["values"]) for c in held_out] == [("greedy", [2, 4], [0.25, 0.5]),
                                                                         ("sampled", [2, 4], [0.125, 0.375])]
    assert run["trace_steps"] == {"3": 2, "4": 2}
    assert run["table_keys"] == ["reward", "eval/accuracy", "eval/sampled_accuracy", "kl", "sft/sft_loss"]
    status, traces = client.get("/api/runs/demo/traces?step=4")
    assert [(t["response"], t["score"]) for t in traces["traces"]] == [("42", 1.0), ("41", 0.0)]
    for bad in ("/api/runs/..", "/api/runs/%2e%2e", "/api/runs/nope", "/api/runs/demo%2F..%2F..", "/api/runs/empty/x"):
        status, _ = client.get(bad)
        assert status == 404, bad
    status, _ = client.get("/api/runs/demo/traces?step=x")
    assert status == 400


@pytest.mark.slow
def test_a_yaml_built_in_the_dashboard_runs_with_rltk_run(dashboard, tmp_path):
    client, _, save_dir = dashboard
    run_dir = tmp_path / "run"
    overrides = [f"output_dir={run_dir}", "logging.logger=[jsonl]", "data.train_size=40", "data.eval_size=8",
                 "sft.steps=2", "sft.stop_at_accuracy=null", "sft.warmup_steps=0", "trainer.total_steps=2",
                 "trainer.warmup_steps=0", "trainer.prompts_per_step=4", "rollout.n=2", "checkpoint.every=0",
                 "algorithm.name=rloo"]
    status, saved = client.post("/api/save", {"recipe": "grpo", "overrides": overrides, "name": "tiny.yaml"})
    assert saved["ok"] is True, saved["error"]
    assert main(["run", "grpo", "--config", saved["path"]]) == 0  # unchanged, as the page says to run it
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [yaml.safe_load(line)["step"] for line in lines if '"reward"' in line] == [3, 4]
    assert "name: rloo" in (run_dir / "config.yaml").read_text()
