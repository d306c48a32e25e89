"""``rltk_on_step_end`` fires as its spec says: once per training step of every stage, with that step's row,
never for a stage's opening evaluation (which logs a row at the step before the stage's first)."""

from __future__ import annotations

import json
import types

import rltk
from rltk.commands.cli import main

SFT_STEPS, RL_STEPS = 3, 3


def test_the_hook_ends_each_step_once_with_its_row_and_never_an_opening_evaluation(tmp_path):
    seen: list[tuple[int, dict]] = []

    @rltk.hookimpl
    def rltk_on_step_end(step, metrics):
        seen.append((step, dict(metrics)))
        metrics["plugin/step_seen"] = float(step)  # the spec lets a plugin add to the row before it is logged

    plugin = types.ModuleType("step_watcher")
    plugin.rltk_on_step_end = rltk_on_step_end
    rltk.register_plugin(plugin, name="step_watcher")
    run_dir = tmp_path / "run"
    try:
        assert main(["run", "grpo", f"output_dir={run_dir}", f"sft.steps={SFT_STEPS}", "sft.stop_at_accuracy=null",
                     f"trainer.total_steps={RL_STEPS}", "trainer.eval_every=2", "data.eval_size=4",
                     "trainer.prompts_per_step=2", "rollout.n=2", "logging.plot=false", "checkpoint.every=0"]) == 0
    finally:
        rltk.unregister_plugin("step_watcher")

    # one call per step, in order, global numbering across the SFT warm-up and the RL stage
    assert [step for step, _ in seen] == list(range(1, SFT_STEPS + RL_STEPS + 1))
    assert all("sft/sft_loss" in metrics for _, metrics in seen[:SFT_STEPS])
    assert all("sft/sft_loss" not in metrics and "pg_loss" in metrics for _, metrics in seen[SFT_STEPS:])
    # evaluation steps (eval_every=2 and the last) carry their evaluation in the step's own row
    evaluated = [step - SFT_STEPS for step, metrics in seen if "eval/accuracy" in metrics]
    assert evaluated == [2, 3]

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    opening = [row for row in rows if row["step"] == SFT_STEPS and "eval/accuracy" in row]
    assert len(opening) == 1 and "plugin/step_seen" not in opening[0]  # the RL stage's opening evaluation
    steps = [row for row in rows if row is not opening[0]]
    assert [row["step"] for row in steps] == list(range(1, SFT_STEPS + RL_STEPS + 1))
    assert all(row["plugin/step_seen"] == row["step"] for row in steps)  # what the hook added was logged
