"""mix_expert from config alone: buffer.expert.path feeds demonstrations that join their prompt's group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from rltk.commands.cli import main
from rltk.data.synthetic import make_task

TINY = ["sft.steps=2", "sft.warmup_steps=0", "sft.stop_at_accuracy=null", "trainer.total_steps=2",
        "trainer.warmup_steps=0", "trainer.eval_every=0", "data.train_size=48", "data.eval_size=4",
        "trainer.prompts_per_step=4", "rollout.n=4", "checkpoint.resume=never", "checkpoint.every=0",
        "logging.logger=[jsonl]", "logging.plot=false"]


@pytest.mark.slow  # a two-step warm-up and two GRPO steps of the tiny model (~3 s)
def test_expert_responses_from_a_file_join_the_groups_of_their_prompts(tmp_path, batches):
    grpo_yaml = OmegaConf.load(Path(__file__).resolve().parents[2] / "recipes" / "configs" / "grpo.yaml")
    task_args = OmegaConf.to_container(grpo_yaml.data.task_args)
    # a demonstration (the correct sum) for every training prompt of the run
    rows = make_task("arithmetic", "train", 48, 0, **task_args)
    expert = tmp_path / "expert.jsonl"
    expert.write_text("".join(json.dumps({"prompt": r["prompt"], "response": r["ground_truth"],
                                          "answer": r["ground_truth"]}) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    assert main(["run", "grpo", f"output_dir={run_dir}", *TINY, "buffer.sample_strategy=mix_expert",
                 "buffer.sample_strategy_args.expert_fraction=0.2", f"buffer.expert.path={expert}"]) == 0

    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl_lines = [m for m in lines if "reward" in m]
    assert len(rl_lines) == 2 and len(batches) == 2
    for m, batch in zip(rl_lines, batches):
        # 16 policy responses; a 0.2 share of the batch is round(0.2 * 16 / 0.8) = 4 demonstrations,
        # one per prompt of the step, each put in that prompt's group
        assert m["buffer/policy"] == 16 and m["buffer/expert"] == 4 and m["buffer/expert_joined"] == 4
        assert batch["scores"].shape == (20,)
        expert_rows = torch.arange(16, 20)  # mix_expert appends them after the policy's
        sizes = {int(g): int((batch["group_ids"] == g).sum()) for g in batch["group_ids"].unique()}
        assert sorted(sizes.values()) == [5, 5, 5, 5] and all(g >= 0 for g in sizes)
        # the correct sums score 1 with exact_match; the policy after two warm-up steps scores less,
        # so GRPO rates every demonstration above its group's mean
        assert batch["scores"][expert_rows].tolist() == [1.0] * 4
        for row in expert_rows:
            group = batch["group_ids"] == batch["group_ids"][row]
            if batch["scores"][group].min() < 1.0:
                assert batch["advantages"][row][batch["response_mask"][row] > 0].min() > 0

    # the demonstrations' traces say what they were: their prompt, response, score and source
    by_prompt = {r["prompt"]: r["ground_truth"] for r in rows}
    traces = [json.loads(line) for line in (run_dir / "traces.jsonl").read_text().splitlines()]
    expert_traces = [t for t in traces if t["source"] == "expert"]
    assert expert_traces and {t["source"] for t in traces} == {"policy", "expert"}
    for t in expert_traces:
        assert t["response"] == by_prompt[t["prompt"]] and t["score"] == 1.0 and t["staleness"] is None
