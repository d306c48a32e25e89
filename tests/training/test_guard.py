"""The divergence guard on hand-made metric streams: when it stops, what it says, what it never stops."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from rltk.checkpoint import CheckpointManager
from rltk.training.scaffold.guard import DivergenceGuard, GuardSettings, TrainingDiverged, first_nonfinite_parameter

V = 100  # vocabulary: log(V) = 4.6052 nats is the uniform distribution's entropy
LOG_V = math.log(V)


def guard(tmp_path=None, stage_type="rl", first_step=0, **keys) -> DivergenceGuard:
    cfg = OmegaConf.create({"guard": {**GuardSettings().__dict__, **keys},
                            "trainer": {"lr": 1000.0}, "sft": {"lr": 1.0e-3}})
    ckpt = CheckpointManager(tmp_path / "checkpoints", keep_last=None) if tmp_path is not None else None
    return DivergenceGuard(cfg, stage_name="grpo", stage_type=stage_type, first_step=first_step, vocab_size=V,
                           checkpoints=ckpt)


def healthy(entropy=0.5) -> dict:
    return {"entropy": entropy, "pg_loss": 0.01, "skipped": 0.0, "grad_norm": 1.0}


def test_entropy_at_uniform_stops_after_patience_steps_naming_the_step_and_the_last_good_checkpoint(tmp_path):
    g = guard(tmp_path, first_step=100, entropy_patience=3)
    for step in range(1, 5):  # healthy stage steps 1..4 (global 101..104), checkpoints after 102 and 104
        g.observe(healthy(), step)
    g.checkpoints.save(102, None, {})
    g.checkpoints.save(104, None, {})
    # Step 105's entropy is uniform: the weights step 104 left are the first bad ones, so only
    # checkpoints older than 104 are good.
    g.observe(healthy(LOG_V), 5)
    g.observe(healthy(LOG_V * 0.9999), 6)
    with pytest.raises(TrainingDiverged) as info:
        g.observe(healthy(LOG_V), 7)
    err = info.value
    assert (err.symptom, err.step, err.checkpoint) == ("entropy_uniform", 107, g.checkpoints.path_for(102))
    message = str(err)
    for part in ("training diverged at step 107", "step 7 of stage 'grpo'", "collapsed to uniform",
                 "4.605 nats", "100.00%", "log(V=100)", "3 steps in a row (since step 105)",
                 "trainer.lr=1000.0", f"Last good checkpoint: {g.checkpoints.path_for(102)}",
                 "guard.entropy_patience", "guard.enabled=false"):
        assert part in message, (part, message)


def test_a_healthy_step_between_bad_ones_restarts_the_count():
    g = guard(entropy_patience=3)
    g.observe(healthy(), 1)
    for step, entropy in enumerate([LOG_V, LOG_V, 0.5, LOG_V, LOG_V], start=2):
        g.observe(healthy(entropy), step)  # 2 bad, 1 good, 2 bad: never 3 in a row
    with pytest.raises(TrainingDiverged, match=r"3 steps in a row \(since step 5\)"):
        g.observe(healthy(LOG_V), 7)


def test_a_random_init_at_uniform_is_not_a_collapse_until_the_entropy_has_left_it():
    g = guard(entropy_patience=2)
    for step in range(1, 6):  # a fresh model: uniform, never below the line; no step counts
        g.observe({"sft/entropy": LOG_V * 0.9995, "sft/sft_loss": LOG_V, "sft/skipped": 0.0}, step)
    g.observe({"sft/entropy": LOG_V * 0.99, "sft/sft_loss": 4.5, "sft/skipped": 0.0}, 6)  # it learnt something
    g.observe({"sft/entropy": LOG_V, "sft/sft_loss": LOG_V, "sft/skipped": 0.0}, 7)
    with pytest.raises(TrainingDiverged, match=r"sft/entropy.*since step 7.*collapsed to uniform"):
        g.observe({"sft/entropy": LOG_V, "sft/sft_loss": LOG_V, "sft/skipped": 0.0}, 8)


def test_entropy_near_zero_stops_as_a_collapse_onto_single_tokens(tmp_path):
    g = guard(tmp_path, entropy_patience=2)
    g.observe(healthy(), 1)
    g.observe(healthy(0.0), 2)
    with pytest.raises(TrainingDiverged) as info:
        g.observe(healthy(LOG_V * 0.5e-4), 3)
    assert info.value.symptom == "entropy_zero" and "collapsed onto single tokens" in str(info.value)
    assert "guard.entropy_min=0.0001" in str(info.value)
    assert "No good checkpoint: none was written" in str(info.value) and info.value.checkpoint is None


def test_steps_that_train_nothing_stop_the_run_after_max_skipped_steps():
    g = guard(max_skipped_steps=3)
    skipped = {"entropy": 0.5, "pg_loss": 0.02, "skipped": 1.0, "grad_norm": math.inf}
    g.observe(healthy(), 1)
    g.observe(skipped, 2)
    g.observe({**skipped, "skipped": 0.5}, 3)  # one of two optimizer steps applied: it trained
    g.observe(skipped, 4)
    g.observe({**skipped, "pg_loss": math.nan, "skipped": 0.0}, 5)  # a nan loss trains nothing either
    with pytest.raises(TrainingDiverged) as info:
        g.observe(skipped, 6)
    assert info.value.symptom == "nothing_trained" and info.value.step == 6
    assert "3 steps in a row trained nothing (since step 4)" in str(info.value)
    assert "skipped for a non-finite gradient norm (grad_norm=inf)" in str(info.value)


def test_a_nonfinite_loss_is_named():
    g = guard(max_skipped_steps=1)
    with pytest.raises(TrainingDiverged, match=r"sft/sft_loss=nan"):
        g.observe({"sft/sft_loss": math.nan, "sft/skipped": 1.0, "sft/grad_norm": math.nan}, 1)


def test_steps_without_an_update_neither_count_nor_reset():
    g = guard(max_skipped_steps=2)
    g.observe({"skipped": 1.0, "pg_loss": 0.0}, 1)
    g.observe({"skipped_empty_batch": 1.0}, 2)  # an empty batch: no update, no verdict
    g.observe({"eval/accuracy": 0.1}, 3)
    with pytest.raises(TrainingDiverged, match="2 steps in a row"):
        g.observe({"critic/skipped": 1.0, "critic/vf_loss": 0.3, "critic/grad_norm": math.inf}, 4)


def test_a_stage_that_ends_without_one_update_stops_however_short():
    g = guard(max_skipped_steps=10)
    g.observe({"sft/sft_loss": 2.0, "sft/skipped": 1.0, "sft/grad_norm": math.inf}, 1)
    g.observe({"sft/sft_loss": 2.0, "sft/skipped": 1.0, "sft/grad_norm": math.inf}, 2)
    with pytest.raises(TrainingDiverged, match=r"at step 2 .*none of its 2 step\(s\) applied an update"):
        g.end_stage()
    g = guard()
    g.observe({"sft/sft_loss": 2.0, "sft/skipped": 0.0}, 1)
    g.observe({"sft/sft_loss": 2.0, "sft/skipped": 1.0}, 2)
    g.end_stage()  # one update applied: not this symptom
    guard().end_stage()  # nothing observed: nothing to say


def test_nonfinite_weights_are_named_and_checked_every_k_steps():
    class Strategy:
        world_size = data_world_size = 1

        def __init__(self, module):
            self.module = module

        def unwrap(self):
            return self.module

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    assert first_nonfinite_parameter(model) is None
    with torch.no_grad():
        model[1].bias[0] = math.inf
    assert first_nonfinite_parameter(model) == "1.bias"

    g = guard(check_weights_every=4)
    for step in (1, 2, 3):
        g.observe(healthy(), step, Strategy(model))  # not a check step
    with pytest.raises(TrainingDiverged, match=r"the policy's weights are not finite \(1.bias is the first") as info:
        g.observe(healthy(), 4, Strategy(model))
    assert info.value.symptom == "nonfinite_weights"

    class Pair:  # the ppo recipe checkpoints policy and critic as one
        def __init__(self):
            self.policy, self.critic = Strategy(torch.nn.Linear(2, 2)), Strategy(model)

    with pytest.raises(TrainingDiverged, match="the critic's weights are not finite"):
        guard().check_weights(Pair(), 7)


def test_the_weights_check_before_a_checkpoint_calls_every_checkpoint_good(tmp_path):
    class Strategy:
        world_size = data_world_size = 1

        def unwrap(self):
            return bad

    bad = torch.nn.Linear(2, 2)
    with torch.no_grad():
        bad.weight.fill_(math.nan)
    g = guard(tmp_path, first_step=10)
    g.checkpoints.save(12, None, {})  # written after the check of stage step 2 passed
    with pytest.raises(TrainingDiverged) as info:
        g.check_weights(Strategy(), 3)
    assert info.value.checkpoint == g.checkpoints.path_for(12) and info.value.step == 13


def test_disabled_guard_never_stops():
    g = guard(enabled=False, max_skipped_steps=1, entropy_patience=1)
    for step in range(1, 5):
        g.observe({"entropy": LOG_V, "pg_loss": math.nan, "skipped": 1.0}, step)
    g.end_stage()


def test_counters_survive_a_checkpoint():
    g = guard(entropy_patience=3, max_skipped_steps=3)
    g.observe(healthy(), 1)
    g.observe(healthy(LOG_V), 2)
    g.observe(healthy(LOG_V), 3)
    resumed = guard(entropy_patience=3)
    resumed.load_state_dict(g.state_dict())
    with pytest.raises(TrainingDiverged, match=r"since step 2"):
        resumed.observe(healthy(LOG_V), 4)
    fresh = guard(entropy_patience=3)
    fresh.load_state_dict({})  # a checkpoint written before the guard existed
    fresh.observe(healthy(LOG_V), 4)  # not armed: a fresh count


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=1.0e-4 * 1.0001, max_value=0.999), min_size=1, max_size=40))
def test_entropy_inside_the_band_never_stops(fractions):
    g = guard(entropy_patience=1)
    for step, f in enumerate(fractions, start=1):
        g.observe(healthy(f * LOG_V), step)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["ok", "high", "low", "idle"]), min_size=1, max_size=30),
       st.integers(min_value=1, max_value=4), st.integers(min_value=1, max_value=4))
def test_it_stops_exactly_where_a_run_of_bad_steps_first_reaches_its_limit(kinds, patience, max_skipped):
    """Oracle: the first step ending `patience` same-side entropy steps (after one in-band step) or
    `max_skipped` idle steps in a row."""
    metrics = {"ok": healthy(), "high": healthy(LOG_V), "low": healthy(0.0),
               "idle": {"entropy": 0.5, "pg_loss": 0.0, "skipped": 1.0}}
    expected, armed, run_kind, run_len, idle_len = None, False, None, 0, 0
    for step, kind in enumerate(kinds, start=1):
        idle_len = idle_len + 1 if kind == "idle" else 0
        if idle_len >= max_skipped:
            expected = (step, "nothing_trained")
            break
        armed = armed or kind in ("ok", "idle", "low")
        side = kind if kind == "low" or (kind == "high" and armed) else None
        run_len = run_len + 1 if side is not None and side == run_kind else (1 if side else 0)
        run_kind = side
        if side and run_len >= patience:
            expected = (step, "entropy_uniform" if side == "high" else "entropy_zero")
            break
    g = guard(entropy_patience=patience, max_skipped_steps=max_skipped)
    got = None
    try:
        for step, kind in enumerate(kinds, start=1):
            g.observe(metrics[kind], step)
    except TrainingDiverged as err:
        got = (err.step, err.symptom)
    assert got == expected
