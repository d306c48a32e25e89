"""A checkpoint's optimizer state loads into another grouping of the same parameters (rltk.strategies.regroup):
what resuming a tensor-parallel checkpoint (one AdamW group per device mesh) in one process (the decay/no-decay
pair), or the other way, needs. Checked against the optimizer that never left its grouping: the same next step."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from torch import nn

from rltk.checkpoint import saved_rank_of
from rltk.strategies.base import load_optimizer_state_by_name, optimizer_state_by_name
from rltk.strategies.layout import ParallelLayout
from rltk.strategies.regroup import regroup_saved_state


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2))


def _groups(model: nn.Module, split: bool, lr: float = 0.1) -> list[dict]:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    if not split:
        return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    # as split_groups_by_mesh leaves them: each group cut in two, same hyper-parameters
    return [{"params": decay[:1], "weight_decay": 0.1}, {"params": decay[1:], "weight_decay": 0.1},
            {"params": no_decay[:2], "weight_decay": 0.0}, {"params": no_decay[2:], "weight_decay": 0.0}]


def _decay(step: int, scale: float) -> float:
    return scale / (1 + step)


def _train(model: nn.Module, optimizer, scheduler, steps: int) -> None:
    for step in range(steps):
        optimizer.zero_grad()
        model(torch.full((2, 3), 1.0 + step)).square().sum().backward()
        optimizer.step()
        scheduler.step()


@pytest.mark.parametrize("saved_split, live_split", [(True, False), (False, True)])
def test_state_saved_in_one_grouping_steps_on_in_another_as_if_never_saved(saved_split, live_split):
    # a partial, as build_lr_scheduler's: LambdaLR saves its state once per group
    decay_schedule = functools.partial(_decay, scale=1.0)
    model = _model()
    optimizer = torch.optim.AdamW(_groups(model, saved_split), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, decay_schedule)
    _train(model, optimizer, scheduler, 3)
    saved, schedule = optimizer_state_by_name(optimizer, model), scheduler.state_dict()

    other = _model()
    other.load_state_dict(model.state_dict())
    other_optimizer = torch.optim.AdamW(_groups(other, live_split), lr=0.1)
    other_scheduler = torch.optim.lr_scheduler.LambdaLR(other_optimizer, decay_schedule)
    saved, schedule = regroup_saved_state(other_optimizer, other, saved, schedule, "ckpt")
    load_optimizer_state_by_name(other_optimizer, other, saved, "ckpt")
    other_scheduler.load_state_dict(schedule)
    assert len(other_optimizer.param_groups) == (4 if live_split else 2)
    assert [g["lr"] for g in other_optimizer.param_groups] == [0.1 / 4] * len(other_optimizer.param_groups)

    _train(model, optimizer, scheduler, 2)
    _train(other, other_optimizer, other_scheduler, 2)
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name
    assert scheduler.get_last_lr()[0] == other_scheduler.get_last_lr()[0] == pytest.approx(0.1 / 6)


def test_a_live_group_gathering_different_hyper_parameters_is_refused_naming_the_checkpoint():
    model = _model()
    optimizer = torch.optim.AdamW(_groups(model, split=False), lr=0.1)
    saved = optimizer_state_by_name(optimizer, model)
    live = torch.optim.AdamW([{"params": list(model.parameters())}], lr=0.1)
    with pytest.raises(ValueError, match=r"'ckpt'.*group 0 come from the checkpoint's groups \[0, 1\]"):
        regroup_saved_state(live, model, saved, {}, "ckpt")


def test_the_same_grouping_and_other_parameters_pass_through_untouched():
    model = _model()
    optimizer = torch.optim.AdamW(_groups(model, split=True), lr=0.1)
    saved = optimizer_state_by_name(optimizer, model)
    assert regroup_saved_state(optimizer, model, saved, {"base_lrs": [1]}, "c") == (saved, {"base_lrs": [1]})
    smaller = nn.Linear(3, 4)  # other names: load_optimizer_state_by_name names the mismatch
    assert regroup_saved_state(torch.optim.AdamW(smaller.parameters()), smaller, saved, {}, "c")[0] is saved


def _at(rank: int, world: int, tp: int = 1) -> tuple[ParallelLayout, int]:
    return ParallelLayout(world_size=world, tensor_parallel_size=tp), rank


@pytest.mark.parametrize("saved, live, expected", [
    # saved at TP=2 x DP=2 (ranks 0,1 data rank 0; 2,3 data rank 1), resumed at DP=2: data rank 1 is saved rank 2
    ({"world_size": 4, "tensor_parallel_size": 2}, _at(1, 2), 1 * 2),
    ({"world_size": 4, "tensor_parallel_size": 2}, _at(0, 2), 0),
    # saved at DP=2, resumed at TP=2 x DP=2: rank 3 is data rank 1
    ({"world_size": 2}, _at(3, 4, tp=2), 1),
    # the same layout, or another number of data ranks (no data rank to match): its own rank
    ({"world_size": 4, "tensor_parallel_size": 2}, _at(3, 4, tp=2), 3),
    ({"world_size": 2, "tensor_parallel_size": 2}, _at(1, 2), 1),
])
def test_a_rank_resumes_the_rng_of_the_saved_rank_with_its_data_rank(tmp_path, saved, live, expected):
    (tmp_path / "strategy.json").write_text(json.dumps(saved))
    assert saved_rank_of(*live, tmp_path) == expected


@pytest.mark.parametrize("layout, rank, saved, expected", [
    # saved by two data ranks of two tensor-parallel ranks each; resumed by two plain data ranks
    (ParallelLayout(world_size=2), 1, {"per_rank": ["d0", "d0", "d1", "d1"], "ranks_per_data_share": 2}, "d1"),
    # saved by two plain data ranks; resumed at TP=2 x DP=2: rank 3 holds data rank 1's rows
    (ParallelLayout(world_size=4, tensor_parallel_size=2), 3, {"per_rank": ["d0", "d1"], "ranks_per_data_share": 1},
     "d1"),
    # the same layout, and an older checkpoint without the share: each rank its own entry
    (ParallelLayout(world_size=4, tensor_parallel_size=2), 3,
     {"per_rank": ["a", "b", "c", "d"], "ranks_per_data_share": 2}, "d"),
    (ParallelLayout(world_size=2), 1, {"per_rank": ["a", "b"]}, "b"),
])
def test_a_rank_resumes_the_counters_of_the_saved_rank_with_its_data_rank(monkeypatch, layout, rank, saved, expected):
    from rltk.training.stages import stage_checkpoint

    monkeypatch.setattr(stage_checkpoint, "process_rank", lambda: rank)
    assert stage_checkpoint.rank_state(saved, layout) == expected
