"""The estimators that need more than the rollout's scores run end to end: gdpo on two reward functions,
optimal_token_baseline on the old policy's sum_v pi(v)^2.

Tiny runs as in test_presets.py (a two-step warm-up, three RL steps), with the recording of what
the recipe hands compute_advantages; the checks are on the fields those estimators read.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from rltk.commands.cli import main
from tests.recipes.test_presets import TINY, calls, parity_reward  # noqa: F401  (fixtures)

BASE = [o for o in TINY if not o.startswith("reward.")]


def run(tmp_path, recipe: str, *overrides: str) -> list[dict]:
    run_dir = tmp_path / recipe
    assert main(["run", recipe, f"output_dir={run_dir}", *BASE, *overrides]) == 0
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for m in lines:
        bad = {k: v for k, v in m.items() if not math.isfinite(v)}
        assert not bad, f"non-finite metrics at step {m['step']}: {bad}"
    rl_lines = [m for m in lines if m["step"] > 2 and "reward" in m]
    assert len(rl_lines) == 3, f"an RL step was skipped: {lines}"
    return rl_lines


@pytest.mark.slow  # a two-step warm-up and three RL steps of the tiny model
@pytest.mark.parametrize("recipe", ["grpo", "ppo"])
def test_gdpo_normalises_each_of_two_rewards(recipe, tmp_path, parity_reward, calls):  # noqa: F811
    # correctness (exact_match), a format reward (digits only) and the parity reward, whose
    # groups differ on the random tiny model; column k is reward k of reward.reward_fn
    rl_lines = run(tmp_path, recipe, "algorithm.advantage_fn=gdpo",
                   "reward.reward_fn=[exact_match,format_tags,length_parity]",
                   r"reward.reward_fn_args.format_tags.pattern=\d+", "reward.weights.format_tags=0.5")
    assert len(calls["advantages"]) == 3
    for adv, m in zip(calls["advantages"], rl_lines):
        b = adv["batch"]
        components = b["reward_components"]
        assert components.shape == (b["scores"].shape[0], 3) and components.dtype == torch.float32
        assert set(components.unique().tolist()) <= {0.0, 1.0}
        # the composer's weighted sum of the columns is each response's score
        torch.testing.assert_close(components @ torch.tensor([1.0, 0.5, 1.0]), b["scores"])
        # the workflow logs each reward's mean: the columns' means
        for k, name in enumerate(["exact_match", "format_tags", "length_parity"]):
            assert components[:, k].mean().item() == pytest.approx(m[f"reward/{name}"], abs=1e-6), name
        assert torch.isfinite(adv["advantages"]).all()
    assert any(adv["advantages"].abs().max() > 0 for adv in calls["advantages"])


@pytest.mark.slow  # a two-step warm-up and three RL steps of the tiny model
@pytest.mark.parametrize("recipe", ["grpo", "ppo"])
def test_optimal_token_baseline_gets_sum_pi_squared(recipe, tmp_path, parity_reward, calls):  # noqa: F811
    run(tmp_path, recipe, "algorithm.advantage_fn=optimal_token_baseline", "reward.reward_fn=[length_parity]")
    assert len(calls["advantages"]) == 3
    for adv in calls["advantages"]:
        b = adv["batch"]
        sq, mask = b["sum_pi_squared"], b["response_mask"].bool()
        assert sq.shape == mask.shape
        # a probability of drawing the same token twice: in [1/V, 1] on real tokens, 0 on padding
        assert (sq[mask] > 0).all() and (sq[mask] <= 1 + 1e-6).all()
        assert (sq[~b["attention_mask"][:, -sq.shape[1]:].bool()] == 0).all()
        # the sampled token's probability is at most the largest, so 1 - 2 p + sum p^2 >= (1 - p)^2 >= 0
        assert torch.isfinite(adv["advantages"]).all()
    assert any(adv["advantages"].abs().max() > 0 for adv in calls["advantages"])
