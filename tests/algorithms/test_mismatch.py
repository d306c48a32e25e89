"""Rollout/trainer mismatch correction: weights, drops and metrics on hand-built perturbed batches.

Probabilities are powers of two, so every log-ratio below is an exact multiple of
log 2 in float32 and float64 alike (differences of such logs are exact), and
ratios 2 and 1/2 sit *exactly* on thresholds 2 and 0.5.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rltk.algorithms.mismatch import (
    check_rollout_correction, correction_active, mismatch_metrics, mismatch_statistics, rollout_correction,
)

DTYPES = [torch.float32, torch.float64]


def logs(probs, dtype=torch.float32):
    return torch.log(torch.tensor(probs, dtype=dtype))


def pair(ratios, dtype=torch.float32):
    """(old, rollout) log-probs of one row per list, with old/rollout = each given power-of-two ratio.

    The larger probability of each pair is 1/2, so ratios 2, 1 and 1/2 give log-ratios of exactly
    log 2 rounded to ``dtype``, 0 and minus that (log(1/4) is exactly twice log(1/2) when rounded).
    """
    old = [[0.5 * min(x, 1.0) for x in r] for r in ratios]
    rollout = [[0.5 / max(x, 1.0) for x in r] for r in ratios]
    return logs(old, dtype), logs(rollout, dtype)


def close(weights, expected):
    """Weights come from exp(): equal to the hand-derived numbers up to rounding."""
    torch.testing.assert_close(weights, torch.tensor(expected, dtype=weights.dtype), rtol=1e-6, atol=0)


# one row of token ratios: exactly at the upper threshold, above it, on-policy, at the lower one, below it
RATIOS = [[2.0, 4.0, 1.0, 0.5, 0.25]]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_ratio_is_old_over_rollout_and_exact_on_the_test_grid(dtype):
    old, rollout = pair(RATIOS, dtype)
    torch.testing.assert_close(torch.exp(old - rollout), torch.tensor(RATIOS, dtype=dtype))
    ln2 = torch.tensor(math.log(2.0), dtype=torch.float64).to(dtype).item()
    log_ratio = (old - rollout)[0].tolist()
    assert (log_ratio[0], log_ratio[2], log_ratio[3]) == (ln2, 0.0, -ln2)  # exactly on the thresholds 2, 1, 1/2


@pytest.mark.parametrize("dtype", DTYPES)
def test_token_tis_truncates_above_the_cap_and_keeps_a_ratio_exactly_at_it(dtype):
    old, rollout = pair(RATIOS, dtype)
    c = rollout_correction(old, rollout, torch.ones(1, 5), tis="token", tis_cap=2.0)
    close(c.weights, [[2.0, 2.0, 1.0, 0.5, 0.25]])
    assert c.truncated.tolist() == [[False, True, False, False, False]]  # 2 == cap is not truncated
    assert not c.dropped.any() and not c.rejected.any()  # TIS never drops


@pytest.mark.parametrize("dtype", DTYPES)
def test_sequence_tis_weights_every_token_by_the_capped_product(dtype):
    # products: 2 * 1 = 2 (at the cap), 2 * 2 = 4 (above), 0.5 * 1 = 0.5
    old, rollout = pair([[2.0, 1.0], [2.0, 2.0], [0.5, 1.0]], dtype)
    c = rollout_correction(old, rollout, torch.ones(3, 2), tis="sequence", tis_cap=2.0)
    close(c.weights, [[2.0, 2.0], [2.0, 2.0], [0.5, 0.5]])
    assert c.truncated.tolist() == [[False, False], [True, True], [False, False]]


@pytest.mark.parametrize("dtype", DTYPES)
def test_token_mis_drops_tokens_outside_the_closed_band_and_weights_the_rest_by_their_ratio(dtype):
    old, rollout = pair(RATIOS, dtype)
    c = rollout_correction(old, rollout, torch.ones(1, 5), mis="token", mis_low=0.5, mis_high=2.0)
    assert c.dropped.tolist() == [[False, True, False, False, True]]  # 2 and 0.5 are inside
    close(c.weights, [[2.0, 0.0, 1.0, 0.5, 0.0]])
    # low = 0 is no lower bound: only the ratio above 2 goes
    c = rollout_correction(old, rollout, torch.ones(1, 5), mis="token", mis_low=0.0, mis_high=2.0)
    assert c.dropped.tolist() == [[False, True, False, False, False]]


@pytest.mark.parametrize("dtype", DTYPES)
def test_sequence_mis_keeps_or_drops_whole_responses_by_their_product(dtype):
    # products 2 (at high), 4 (above), 0.5 (at low), 0.25 (below)
    old, rollout = pair([[2.0, 1.0], [2.0, 2.0], [0.5, 1.0], [0.5, 0.5]], dtype)
    c = rollout_correction(old, rollout, torch.ones(4, 2), mis="sequence", mis_low=0.5, mis_high=2.0)
    assert c.dropped.tolist() == [[False, False], [True, True], [False, False], [True, True]]
    close(c.weights, [[2.0, 2.0], [0.0, 0.0], [0.5, 0.5], [0.0, 0.0]])
    assert not c.rejected.any()  # MIS drops, "rejected" counts the rejection mode only


@pytest.mark.parametrize("dtype", DTYPES)
def test_geometric_rejection_uses_the_per_token_mean_log_ratio(dtype):
    # geometric means: sqrt(2 * 0.5) = 1, sqrt(2 * 2) = 2 (at high), sqrt(4 * 2) = 2.83, sqrt(0.5 * 0.5) = 0.5 (at low),
    # sqrt(0.25 * 0.5) = 0.35
    old, rollout = pair([[2.0, 0.5], [2.0, 2.0], [4.0, 2.0], [0.5, 0.5], [0.25, 0.5]], dtype)
    c = rollout_correction(old, rollout, torch.ones(5, 2), rejection="geometric", rejection_low=0.5,
                           rejection_high=2.0)
    assert c.rejected.tolist() == [False, False, True, False, True]
    assert c.dropped.tolist() == [[r, r] for r in c.rejected.tolist()]
    close(c.weights, [[0.0, 0.0] if r else [1.0, 1.0] for r in c.rejected.tolist()])  # no IS weight


@pytest.mark.parametrize("dtype", DTYPES)
def test_sequence_and_token_rejection(dtype):
    # products: 2 (at high), 4, 1 with a token at 4, 0.5 (at low)
    old, rollout = pair([[2.0, 1.0], [2.0, 2.0], [4.0, 0.25], [0.5, 1.0]], dtype)
    mask = torch.ones(4, 2)
    sequence = rollout_correction(old, rollout, mask, rejection="sequence", rejection_low=0.5, rejection_high=2.0)
    assert sequence.rejected.tolist() == [False, True, False, False]
    token = rollout_correction(old, rollout, mask, rejection="token", rejection_low=0.5, rejection_high=2.0)
    assert token.rejected.tolist() == [False, False, True, False]  # every token of rows 0, 1, 3 is in [0.5, 2]


def test_rejection_combines_with_tis_and_rejected_tokens_are_not_counted_as_truncated():
    old, rollout = pair([[4.0, 1.0], [4.0, 4.0]])
    c = rollout_correction(old, rollout, torch.ones(2, 2), tis="token", tis_cap=2.0, rejection="geometric",
                           rejection_low=0.5, rejection_high=2.0)
    assert c.rejected.tolist() == [False, True]  # geometric means 2 and 4
    close(c.weights, [[2.0, 1.0], [0.0, 0.0]])
    assert c.truncated.tolist() == [[True, False], [False, False]]


def test_tokens_off_the_mask_get_weight_one_never_drop_and_their_log_probs_may_be_anything():
    old, rollout = pair([[4.0, 0.25, 2.0]])
    old[0, 2] = -math.inf  # padding log-probs can be -inf or NaN
    rollout[0, 2] = float("nan")
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    c = rollout_correction(old, rollout, mask, mis="token", rejection="token")
    assert c.weights[0, 2].item() == 1.0 and not c.dropped[0, 2]
    assert c.rejected.tolist() == [True]  # from the masked tokens 4 and 0.25 only
    stats = mismatch_statistics(old, rollout, mask, c)
    assert all(math.isfinite(v) for v in mismatch_metrics(stats).values())


def test_a_response_with_no_mask_token_is_never_rejected():
    old, rollout = pair([[4.0, 4.0], [1.0, 1.0]])
    c = rollout_correction(old, rollout, torch.tensor([[0.0, 0.0], [1.0, 1.0]]), rejection="sequence")
    assert c.rejected.tolist() == [False, False] and not c.dropped.any()


def test_every_mode_off_changes_nothing():
    old, rollout = pair(RATIOS)
    c = rollout_correction(old, rollout, torch.ones(1, 5))
    assert c.weights.tolist() == [[1.0] * 5] and not c.dropped.any() and not c.truncated.any()
    assert not correction_active({"tis": None, "mis": None, "rejection": None, "tis_cap": 3.0})
    assert correction_active({"rejection": "geometric"})


def test_half_precision_log_probs_are_compared_in_float32():
    old, rollout = pair(RATIOS, torch.float32)
    c = rollout_correction(old.bfloat16(), rollout.bfloat16(), torch.ones(1, 5), tis="token")
    assert c.weights.dtype == torch.float32
    assert c.truncated.tolist() == [[False, True, False, False, False]]


def test_metrics_on_a_perturbed_batch_by_hand():
    # tokens with ratios 2, 4, 1, 0.5, 0.25 in one response; a second response at ratios 1, 1
    old, rollout = pair([RATIOS[0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0] * 5, [1.0, 1.0, 0.0, 0.0, 0.0]])
    c = rollout_correction(old, rollout, mask, tis="token", tis_cap=2.0)
    m = mismatch_metrics({k: float(v) for k, v in mismatch_statistics(old, rollout, mask, c).items()})
    ln2 = math.log(2)
    # k3 per token rho - 1 - log rho: (1 - ln2) + (3 - 2 ln2) + 0 + (-0.5 + ln2) + (-0.75 + 2 ln2) = 2.75; over 7 tokens
    expected = {
        "kl": 2.75 / 7,
        "kl_k1": -(ln2 + 2 * ln2 + 0 - ln2 - 2 * ln2) / 7,  # = 0: the log-ratios cancel
        "ratio_mean": (2 + 4 + 1 + 0.5 + 0.25 + 1 + 1) / 7,
        "ratio_min": 0.25, "ratio_max": 4.0,
        "seq_ratio_mean": 1.0, "seq_ratio_min": 1.0, "seq_ratio_max": 1.0,  # both geometric means are 1
        "weight_mean": (2 + 2 + 1 + 0.5 + 0.25 + 1 + 1) / 7,
        "truncated_frac": 1 / 7, "dropped_frac": 0.0, "rejected_frac": 0.0,
    }
    assert m.keys() == expected.keys()
    for k, v in expected.items():
        assert m[k] == pytest.approx(v, rel=1e-6, abs=1e-7), k


def test_metrics_count_drops_and_rejections():
    old, rollout = pair([[2.0, 1.0], [4.0, 4.0], [0.25, 1.0]])
    mask = torch.ones(3, 2)
    c = rollout_correction(old, rollout, mask, mis="token", mis_low=0.5, mis_high=2.0, rejection="sequence",
                           rejection_low=0.5, rejection_high=2.0)
    # row 1 rejected (product 16), row 2 keeps its ratio-1 token and drops the 0.25 one (MIS); row 2's product
    # 0.25 is below the band, so it is rejected too
    assert c.rejected.tolist() == [False, True, True]
    m = mismatch_metrics({k: float(v) for k, v in mismatch_statistics(old, rollout, mask, c).items()})
    assert m["rejected_frac"] == pytest.approx(2 / 3)
    assert m["dropped_frac"] == pytest.approx(4 / 6)
    assert m["weight_mean"] == pytest.approx((2.0 + 1.0) / 2)  # over the kept tokens only
    assert m["seq_ratio_max"] == pytest.approx(4.0) and m["seq_ratio_min"] == pytest.approx(0.5)


def test_metrics_of_an_empty_mask_are_neutral_not_nan():
    old, rollout = pair(RATIOS)
    stats = mismatch_statistics(old, rollout, torch.zeros(1, 5))
    assert stats["ratio_max"] == -math.inf and stats["ratio_min"] == math.inf  # identities for the rank reduction
    m = mismatch_metrics({k: float(v) for k, v in stats.items()})
    assert m["kl"] == 0.0 and m["ratio_min"] == m["ratio_max"] == m["ratio_mean"] == 1.0 and m["dropped_frac"] == 0.0


def test_a_diverged_token_does_not_overflow_the_metrics():
    old = torch.tensor([[-1e-3, -200.0]])
    rollout = torch.tensor([[-300.0, -1e-3]])
    m = mismatch_metrics({k: float(v) for k, v in mismatch_statistics(old, rollout, torch.ones(1, 2)).items()})
    assert all(math.isfinite(v) for v in m.values())
    assert m["ratio_max"] == pytest.approx(math.exp(20.0)) and m["ratio_min"] == pytest.approx(math.exp(-20.0))
    c = rollout_correction(old, rollout, torch.ones(1, 2), tis="sequence", tis_cap=3.0)
    close(c.weights, [[3.0, 3.0]])  # a product of e^100 is capped without overflow


# ---------------------------------------------------------------- invariants


log_probs = st.lists(st.floats(-8.0, 0.0, allow_nan=False), min_size=12, max_size=12)


@settings(max_examples=60, deadline=None)
@given(old=log_probs, rollout=log_probs, mask=st.lists(st.booleans(), min_size=12, max_size=12),
       cap=st.floats(1.0, 5.0), low=st.floats(0.0, 1.0), high=st.floats(1.0, 5.0),
       level=st.sampled_from(["token", "sequence"]),
       rejection=st.sampled_from([None, "geometric", "sequence", "token"]))
def test_invariants(old, rollout, mask, cap, low, high, level, rejection):
    old, rollout = torch.tensor(old).view(3, 4), torch.tensor(rollout).view(3, 4)
    mask = torch.tensor(mask, dtype=torch.float32).view(3, 4)
    on = mask > 0
    tis = rollout_correction(old, rollout, mask, tis=level, tis_cap=cap, rejection=rejection,
                             rejection_low=low, rejection_high=high)
    # TIS weights are positive and at most the cap; only rejection drops, and it drops whole responses
    assert (tis.weights[on & ~tis.dropped] > 0).all() and (tis.weights[on] <= cap * (1 + 1e-6)).all()
    assert (tis.dropped == (on & tis.rejected.unsqueeze(-1))).all()
    mis = rollout_correction(old, rollout, mask, mis=level, mis_low=low, mis_high=high)
    kept = on & ~mis.dropped
    assert ((mis.weights[kept] >= low * (1 - 1e-6)) & (mis.weights[kept] <= high * (1 + 1e-6))).all()
    assert (mis.weights[mis.dropped] == 0).all()
    for c in (tis, mis):
        assert (c.weights[~on] == 1).all() and not c.dropped[~on].any()
    if level == "sequence":  # a sequence-level weight is one number per response
        for i in range(3):
            if on[i].any():
                assert mis.dropped[i][on[i]].unique().numel() == 1  # all of a response's tokens, or none
                for c in (tis, mis):
                    w = c.weights[i][on[i]]
                    assert torch.equal(w, w[:1].expand_as(w))


@settings(max_examples=30, deadline=None)
@given(lp=log_probs, mask=st.lists(st.booleans(), min_size=12, max_size=12))
def test_on_policy_rollouts_are_left_alone_and_show_no_mismatch(lp, mask):
    lp = torch.tensor(lp).view(3, 4)
    mask = torch.tensor(mask, dtype=torch.float32).view(3, 4)
    for modes in ({"tis": "token"}, {"tis": "sequence"}, {"mis": "token", "rejection": "token"},
                  {"mis": "sequence", "rejection": "geometric", "rejection_low": 1.0, "rejection_high": 1.0}):
        c = rollout_correction(lp, lp.clone(), mask, **modes)
        assert (c.weights == 1).all() and not c.dropped.any()
    m = mismatch_metrics({k: float(v) for k, v in mismatch_statistics(lp, lp.clone(), mask).items()})
    assert m["kl"] == 0.0 and m["kl_k1"] == 0.0 and m["dropped_frac"] == 0.0
    if mask.any():
        assert m["ratio_min"] == m["ratio_max"] == m["ratio_mean"] == 1.0


# ---------------------------------------------------------------- settings


@pytest.mark.parametrize("settings_, match", [
    ({"tis": "tokens"}, r"bad value 'tokens' for 'rc\.tis'\. Valid: null \(off\), token, sequence"),
    ({"mis": "geometric"}, r"'rc\.mis'\. Valid: null \(off\), token, sequence"),
    ({"rejection": "seq"}, r"'rc\.rejection'\. Valid: null \(off\), geometric, sequence, token"),
    ({"tis": "token", "mis": "token"}, r"'rc\.tis'='token' and 'rc\.mis'='token' both set the importance weight"),
    ({"tis_cap": 0.5}, r"bad value 0\.5 for 'rc\.tis_cap': must be a number >= 1"),
    ({"tis_cap": float("inf")}, r"'rc\.tis_cap'"),
    ({"mis_low": 1.5}, r"bad value 1\.5 for 'rc\.mis_low': must be in \[0, 1\]"),
    ({"rejection_high": 0.9}, r"bad value 0\.9 for 'rc\.rejection_high': must be a number >= 1"),
    ({"rejection_low": -0.1}, r"'rc\.rejection_low'"),
    ({"cap": 2.0}, r"rc\.cap: no such setting\. Valid: tis, tis_cap, mis"),
])
def test_bad_settings_name_the_setting_and_what_is_valid(settings_, match):
    with pytest.raises(ValueError, match=match):
        check_rollout_correction(settings_, where="rc")


def test_the_function_checks_its_own_arguments():
    old, rollout = pair(RATIOS)
    with pytest.raises(ValueError, match="both set the importance weight"):
        rollout_correction(old, rollout, torch.ones(1, 5), tis="token", mis="token")
    with pytest.raises(ValueError, match=r"must be the same \[B, T\]"):
        rollout_correction(old, rollout[:, :3], torch.ones(1, 5), tis="token")
