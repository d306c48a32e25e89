"""The loss components a config chooses, and Dr. GRPO's constant: the generation budget, not the batch width."""

from __future__ import annotations

import torch

import rltk
from rltk.config import load_config
from rltk.training.step.loss_components import LossComponents, loss_agg_args


def test_dr_grpo_divides_by_rollout_max_new_tokens():
    loss = LossComponents.from_config(load_config([], ["algorithm.name=dr_grpo", "rollout.max_new_tokens=4"]))
    assert loss.loss_agg is rltk.get_component("loss_agg", "seq-mean-token-sum-norm")
    assert loss.loss_agg_args == {"norm_constant": 4.0}
    # a batch whose longest response has 2 tokens, of a budget of 4: token sums 3 and 3 over 2 responses
    losses = torch.tensor([[1.0, 2.0], [3.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    assert loss.loss_agg(losses, mask, **loss.loss_agg_args).item() == 6 / (2 * 4)
    assert loss.loss_agg(losses, mask).item() == 6 / (2 * 2)  # the width, what the budget replaces


def test_an_explicit_constant_wins_and_other_aggregations_get_none():
    cfg = load_config([], ["algorithm.name=dr_grpo", "algorithm.loss_agg_args.norm_constant=3"])
    assert LossComponents.from_config(cfg).loss_agg_args == {"norm_constant": 3}
    assert LossComponents.from_config(load_config([], ["algorithm.name=grpo"])).loss_agg_args == {}
    assert loss_agg_args(rltk.get_component("loss_agg", "token-mean"), {}, 8) == {}
    assert loss_agg_args(rltk.get_component("loss_agg", "seq-mean-token-sum-norm"), {"norm_constant": None}, 8) == {
        "norm_constant": 8.0}
