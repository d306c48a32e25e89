"""The openai client drives GRPO training: `rltk run grpo rollout.workflow=agentic` end to end on the tiny model."""

from __future__ import annotations

import json

import pytest

from rltk.commands.cli import main
from tests.serve.helpers import ensure_serve_builtins

TINY_RUN = ["sft.steps=2", "sft.warmup_steps=0", "sft.stop_at_accuracy=null", "trainer.total_steps=2",
            "trainer.warmup_steps=0", "data.train_size=40", "data.eval_size=8", "trainer.prompts_per_step=4",
            "rollout.n=2", "checkpoint.resume=never", "checkpoint.every=0", "logging.logger=[jsonl]",
            "logging.plot=false"]


@pytest.mark.slow  # 2 warm-up + 2 GRPO steps of agents talking to the in-process endpoint (~15-40 s)
def test_a_two_turn_openai_client_agent_drives_grpo_and_its_stitched_logprobs_match_the_trainer(tmp_path):
    import threading

    ensure_serve_builtins()
    before = set(threading.enumerate())  # endpoints other tests left open are not this run's
    run_dir = tmp_path / "run"
    assert main(["run", "grpo", f"output_dir={run_dir}", *TINY_RUN, "rollout.workflow=agentic",
                 "rollout.workflow_args.agent=arithmetic_chat", "rollout.workflow_args.agent_args.checks=1",
                 "algorithm.rollout_correction.log_metrics=true"]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if "agentic/episodes" in r]
    assert [r["step"] for r in rl] == [3, 4]
    for r in rl:
        assert r["agentic/episodes"] == 8 and r["agentic/agent_errors"] == 0  # 4 prompts x n=2
        assert r["agentic/requests_per_episode"] == 2  # the question and one re-check
        assert r["agentic/engine_calls"] < 16  # 16 requests, batched
        # the trainer's recompute of the stitched trajectories gives the log-probs the endpoint recorded:
        # the ids trained on are exactly the ids the engine saw and produced, turn 2 included
        assert r["mismatch/ratio_min"] > 1 - 1e-4 and r["mismatch/ratio_max"] < 1 + 1e-4
        assert r["rollout/policy_tokens"] > 0 and "pg_loss" in r
    assert any("eval/accuracy" in r for r in rows)
    # the run closed its endpoint: no server or batcher thread outlives it
    assert not [t.name for t in set(threading.enumerate()) - before if t.name.startswith("rltk-serve")]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final"]["eval/num_responses"] == 8 and summary["final"]["eval/agent_errors"] == 0


@pytest.mark.slow  # two runs of the test above's size (~30-80 s)
def test_an_agentic_run_repeats_itself_with_the_same_seed(tmp_path):
    # 8 agent threads send each turn's requests in whatever order they are scheduled; the endpoint's
    # batcher samples a round's rows in session order, so the same seed gives the same run
    ensure_serve_builtins()
    logs = []
    for name in ("first", "second"):
        run_dir = tmp_path / name
        assert main(["run", "grpo", f"output_dir={run_dir}", *TINY_RUN, "rollout.workflow=agentic",
                     "rollout.workflow_args.agent=arithmetic_chat", "rollout.workflow_args.agent_args.checks=1",
                     "rollout.temperature=1.0"]) == 0
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        logs.append([{k: v for k, v in row.items() if not k.startswith(("time/", "tokens_per_s"))
                      and "engine_calls" not in k} for row in rows])
    assert logs[0] == logs[1]
    assert any("pg_loss" in row for row in logs[0])
