"""The mismatch correction inside the policy update: what it weighs, what it drops, what it logs.

The update with a correction is compared with a plain update on a batch changed by hand the way the
correction should act: a weight on a token's policy-loss term is the same as scaling that token's
advantage by it (every builtin loss is positively homogeneous in the advantage), and a dropped token is
the same as a token off the response mask, normalisers included.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import rltk
from rltk.algorithms.mismatch import rollout_correction
from rltk.batch import Experience, collate
from rltk.training.step.forward import ForwardSettings, batched_logprobs
from rltk.training.step.estimator import compute_advantages
from rltk.training.step.loss_components import LossComponents
from rltk.training.updates.rl import policy_update
from rltk.algorithms.mismatch import weighted_loss_agg
from rltk.training.step.rollout_correction import WEIGHTS_KEY, _reduce, apply_rollout_correction, correctable_mask
from tests.training.rl_step_helpers import one_process_strategy, worker
from tests.waits import scaled


def _perturbation(shape) -> torch.Tensor:
    """log(pi_old / pi_rollout) per token: a fixed pattern of mild and large mismatches."""
    pattern = torch.tensor([0.05, -0.1, 1.2, 0.0, -1.5, 0.3, 0.9, -0.02])  # ratios ~1.05 .. 3.3 and 0.22
    return pattern.repeat(shape[0] * shape[1] // len(pattern) + 1)[: shape[0] * shape[1]].view(shape)


def _batch(strategy, estimator="grpo"):
    """Rollouts of the tiny model's test task, with engine log-probs that differ from the trainer's."""
    batch = collate(worker.local_experiences(0, 0, 1), pad_token_id=0)
    batch["old_logprobs"], _ = batched_logprobs(strategy.unwrap(), batch, ForwardSettings(micro_batch_size=4))
    batch["rollout_logprobs"] = (batch["old_logprobs"] - _perturbation(batch["old_logprobs"].shape)) \
        * batch["response_mask"]
    batch["has_rollout_logprobs"] = torch.ones(len(batch["scores"]), dtype=torch.bool)
    compute_advantages(rltk.get_component("advantage_fn", estimator), batch, {})
    return batch


def _loss(policy_loss="ppo_clip", loss_agg="token-mean", **kw):
    return LossComponents(policy_loss=rltk.get_component("policy_loss", policy_loss),
                          loss_agg=rltk.get_component("loss_agg", loss_agg), entropy_coef=0.01, **kw)


def _update(strategy, batch, loss):
    return policy_update(strategy, batch, loss, ForwardSettings(micro_batch_size=3), kl_coef=0.0, mini_batches=2,
                         ppo_epochs=2, generator=torch.Generator().manual_seed(3)).metrics


def _assert_same_weights(a, b):
    for name, value in b.full_state_dict().items():
        torch.testing.assert_close(a.full_state_dict()[name], value, atol=2e-6, rtol=0, msg=name)


@pytest.mark.parametrize("policy_loss, loss_agg, settings", [
    ("ppo_clip", "token-mean", {"tis": "token", "tis_cap": 2.0}),
    ("gspo", "seq-mean-token-mean", {"tis": "sequence", "tis_cap": 3.0}),
    ("cispo", "seq-mean-token-sum", {"tis": "token", "tis_cap": 1.5}),
    ("reinforce", "seq-mean-token-sum-norm", {"tis": "token", "tis_cap": 2.0}),
])
def test_the_weight_multiplies_the_policy_loss_term_of_every_loss(policy_loss, loss_agg, settings):
    corrected, reference = one_process_strategy(), one_process_strategy()
    batch = _batch(corrected)
    weights = rollout_correction(batch["old_logprobs"], batch["rollout_logprobs"], batch["response_mask"],
                                 **settings).weights
    assert ((weights - 1).abs() > 0.01).any() and (weights < 1).any()  # a batch the weights really change
    metrics = _update(corrected, batch, _loss(policy_loss, loss_agg, rollout_correction=settings))
    by_hand = {**batch, "advantages": batch["advantages"] * weights}
    reference_metrics = _update(reference, by_hand, _loss(policy_loss, loss_agg))
    _assert_same_weights(corrected, reference)
    # the entropy bonus is not weighted: the same entropy term either way
    assert metrics["entropy"] == pytest.approx(reference_metrics["entropy"], rel=1e-5)
    assert metrics["mismatch/truncated_frac"] > 0


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_dropped_tokens_leave_the_mask_and_every_normaliser(loss_agg):
    settings = {"mis": "token", "mis_low": 0.5, "mis_high": 2.0, "rejection": "geometric",
                "rejection_low": 0.8, "rejection_high": 1.25}
    corrected, reference = one_process_strategy(), one_process_strategy()
    batch = _batch(corrected)
    c = rollout_correction(batch["old_logprobs"], batch["rollout_logprobs"], batch["response_mask"], **settings)
    assert c.rejected.any() and not c.rejected.all() and (c.dropped & ~c.rejected[:, None]).any()
    _update(corrected, batch, _loss("ppo_clip", loss_agg, rollout_correction=settings))
    kept = batch["response_mask"] * ~c.dropped
    by_hand = {**batch, "response_mask": kept, "advantages": batch["advantages"] * c.weights}
    _update(reference, by_hand, _loss("ppo_clip", loss_agg))
    _assert_same_weights(corrected, reference)


def test_metrics_report_the_mismatch_and_logging_alone_changes_nothing():
    corrected, reference = one_process_strategy(), one_process_strategy()
    batch = _batch(corrected)
    batch["rollout_logprobs"] = (batch["old_logprobs"] - 0.1) * batch["response_mask"]  # every ratio e^0.1
    metrics = _update(corrected, batch, _loss(log_mismatch_metrics=True))
    plain = _update(reference, batch, _loss())
    _assert_same_weights(corrected, reference)
    assert not any(k.startswith("mismatch/") for k in plain)
    r = math.exp(0.1)
    expected = {"kl": r - 1 - 0.1, "kl_k1": -0.1, "ratio_mean": r, "ratio_min": r, "ratio_max": r,
                "seq_ratio_mean": r, "weight_mean": 1.0, "dropped_frac": 0.0, "rejected_frac": 0.0,
                "truncated_frac": 0.0}
    for k, v in expected.items():
        assert metrics[f"mismatch/{k}"] == pytest.approx(v, rel=1e-4, abs=1e-6), k


def test_the_batch_handed_in_is_not_changed_and_off_means_untouched():
    batch = {"response_mask": torch.ones(2, 3), "old_logprobs": torch.zeros(2, 3),
             "rollout_logprobs": torch.full((2, 3), -2.0), "has_rollout_logprobs": torch.tensor([True, True])}
    same, metrics = apply_rollout_correction(batch, {"tis": None})
    assert same is batch and metrics == {}
    corrected, metrics = apply_rollout_correction(batch, {"mis": "token"})
    assert corrected is not batch and WEIGHTS_KEY not in batch and batch["response_mask"].sum() == 6
    assert corrected["response_mask"].sum() == 0  # every ratio e^2 > 2
    assert metrics["mismatch/dropped_frac"] == 1.0


def test_responses_without_rollout_log_probs_are_neither_corrected_nor_measured():
    expert = Experience([1, 2], [3, 4], 1.0, group_id=0)  # e.g. mixed-in expert data: no engine log-probs
    sampled = Experience([1, 2], [5, 6], 0.0, group_id=1, rollout_logprobs=[-3.0, -0.5])
    batch = collate([expert, sampled], pad_token_id=0)
    assert batch["has_rollout_logprobs"].tolist() == [False, True]
    batch["old_logprobs"] = torch.tensor([[-4.0, -4.0], [-0.5, -0.5]])  # 2nd response: ratios e^2.5 and 1
    assert correctable_mask(batch).tolist() == [[0.0, 0.0], [1.0, 1.0]]
    corrected, metrics = apply_rollout_correction(batch, {"mis": "token"})
    assert corrected["response_mask"].tolist() == [[1.0, 1.0], [0.0, 1.0]]
    torch.testing.assert_close(corrected[WEIGHTS_KEY], torch.tensor([[1.0, 1.0], [0.0, 1.0]]))
    assert metrics["mismatch/dropped_frac"] == 0.5  # of the two measured tokens
    assert metrics["mismatch/ratio_max"] == pytest.approx(math.exp(2.5))


def test_missing_log_probs_name_the_config_key_and_the_fields():
    with pytest.raises(ValueError, match=r"algorithm.rollout_correction needs batch field\(s\) \['rollout_logprobs'\]"):
        apply_rollout_correction({"response_mask": torch.ones(1, 2), "old_logprobs": torch.zeros(1, 2)},
                                 {"tis": "token"})


def test_weighted_loss_agg_weighs_the_matrix_and_refuses_another_shape():
    agg = rltk.get_component("loss_agg", "token-mean")
    weighted = weighted_loss_agg(agg, torch.tensor([[2.0, 0.5], [1.0, 0.0]]))
    loss = weighted(torch.tensor([[1.0, 4.0], [3.0, 100.0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]]))
    assert loss.item() == pytest.approx((2.0 + 2.0 + 3.0) / 3)
    with pytest.raises(ValueError, match=r"loss_mat \(2, 1\) for weights \(2, 2\)"):
        weighted(torch.ones(2, 1), torch.ones(2, 1))


class _TwoRanks:
    """A strategy stand-in whose other rank contributed ``other``: sums add it, maxima take the larger."""

    world_size = data_world_size = 2

    def __init__(self, other: torch.Tensor):
        self.other = other

    def all_reduce_sum(self, tensor):
        return tensor + self.other[: len(tensor)]

    def all_reduce_max(self, tensor):
        return torch.maximum(tensor, self.other[: len(tensor)])


def test_statistics_are_summed_maxed_and_minned_over_ranks():
    stats = {"tokens": torch.tensor(3.0, dtype=torch.float64), "ratio_max": torch.tensor(2.0, dtype=torch.float64),
             "ratio_min": torch.tensor(0.5, dtype=torch.float64)}
    # sums first (tokens), then the extremes in name order, with minima negated: ratio_max, -ratio_min
    assert _reduce(_TwoRanks(torch.tensor([4.0], dtype=torch.float64)), {"tokens": stats["tokens"]}) == {"tokens": 7.0}
    other = torch.tensor([5.0, -0.25], dtype=torch.float64)  # the other rank's max 5 and min 0.25
    reduced = _reduce(_TwoRanks(other), {k: v for k, v in stats.items() if k != "tokens"})
    assert reduced == {"ratio_max": 5.0, "ratio_min": 0.25}
    # a rank without tokens reports -inf / +inf, the identities: the other rank's values survive
    empty = _reduce(_TwoRanks(torch.tensor([-math.inf, -math.inf], dtype=torch.float64)),
                    {"ratio_max": stats["ratio_max"], "ratio_min": stats["ratio_min"]})
    assert empty == {"ratio_max": 2.0, "ratio_min": 0.5}


def test_loss_components_read_the_config_section():
    from rltk.config.schema import RunConfig

    cfg = OmegaConf.structured(RunConfig)
    cfg.algorithm.rollout_correction.tis = "sequence"
    cfg.algorithm.rollout_correction.log_metrics = True
    loss = LossComponents.from_config(cfg)
    assert loss.log_mismatch_metrics is True
    assert loss.rollout_correction == {"tis": "sequence", "tis_cap": 2.0, "mis": None, "mis_low": 0.5,
                                       "mis_high": 2.0, "rejection": None, "rejection_low": 0.5,
                                       "rejection_high": 2.0}


@pytest.mark.slow  # trains the tiny default for 2 warm-up and 2 RL steps (~15 s)
def test_a_tiny_grpo_run_with_the_correction_on_logs_finite_mismatch_metrics(tmp_path):
    from rltk.commands.cli import main

    run_dir = tmp_path / "run"
    # top_k=3: the engine samples from (and records log-probs of) the top-3 distribution while the trainer
    # scores the full softmax, a real mismatch with pi_old / pi_rollout <= 1 on every token
    assert main(["run", "grpo", f"output_dir={run_dir}", "sft.steps=2", "sft.warmup_steps=0",
                 "trainer.total_steps=2", "trainer.warmup_steps=0", "data.train_size=40", "data.eval_size=8",
                 "trainer.prompts_per_step=4", "rollout.n=2", "rollout.top_k=3", "checkpoint.every=0",
                 "logging.logger=[jsonl]", "logging.plot=false", "checkpoint.resume=never",
                 "algorithm.rollout_correction.tis=token", "algorithm.rollout_correction.rejection=token",
                 "algorithm.rollout_correction.rejection_low=0"]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if "mismatch/kl" in r]
    assert len(rl) == 2  # every RL step
    for r in rl:
        mismatch = {k: v for k, v in r.items() if k.startswith("mismatch/")}
        assert len(mismatch) == 12 and all(math.isfinite(v) for v in mismatch.values())
        assert r["mismatch/ratio_max"] <= 1 + 1e-5 and r["mismatch/ratio_min"] < 1
        assert r["mismatch/kl"] > 0 and r["mismatch/kl_k1"] > 0
        # every ratio is <= 1, inside [0, 2] and under the cap 2: nothing rejected or truncated, so each
        # token's weight is its ratio
        assert r["mismatch/rejected_frac"] == r["mismatch/dropped_frac"] == r["mismatch/truncated_frac"] == 0.0
        assert r["mismatch/weight_mean"] == pytest.approx(r["mismatch/ratio_mean"], rel=1e-5)
        assert math.isfinite(r["pg_loss"])  # (0 here: the barely warmed-up model scores 0 on every prompt)


def test_turning_the_metrics_on_keeps_a_run_resumable_but_a_correction_mode_does_not():
    from rltk.config import load_config
    from rltk.training.scaffold.resume import config_differences

    def plain(*overrides):
        return OmegaConf.to_container(load_config([], list(overrides), warn=False), resolve=True)

    saved = plain()
    assert config_differences(saved, plain("algorithm.rollout_correction.log_metrics=true")) == []
    assert config_differences(saved, plain("algorithm.rollout_correction.tis=token")) == [
        ("algorithm.rollout_correction.tis", None, "token")]


@pytest.mark.distributed
@pytest.mark.slow  # two processes (torchrun, gloo) and a one-process reference (~20 s)
def test_two_ranks_drop_normalise_and_measure_as_one_process_holding_every_rollout(tmp_path):
    import os
    import subprocess
    import sys

    path = Path(__file__).with_name("rollout_correction_worker.py")
    spec = importlib.util.spec_from_file_location("rltk_tests_rollout_correction_worker", path)
    correction_worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(correction_worker)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RLTK_DISABLE_PLUGIN_AUTOLOAD": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(path), str(tmp_path)], env=env, capture_output=True, text=True, timeout=scaled(300))
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    reference = correction_worker.corrected_update(one_process_strategy())
    expected = reference["metrics"]
    # the split must exercise what the reduction does: something dropped, rejected, kept on each side
    assert 0 < expected["mismatch/rejected_frac"] < 1 and 0 < expected["mismatch/dropped_frac"] < 1
    assert ranks[0]["metrics"] == ranks[1]["metrics"], "ranks must log the same (global) numbers"
    assert ranks[0]["metrics"].keys() == expected.keys()
    for key, value in expected.items():
        assert ranks[0]["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for name, value in reference["weights"].items():
        torch.testing.assert_close(ranks[0]["weights"][name], value, atol=1e-6, rtol=0, msg=name)
