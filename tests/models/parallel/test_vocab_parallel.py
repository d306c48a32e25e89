"""Vocabulary-parallel log-probs and entropy (two gloo processes, each with half the head) equal the unsharded
computation: outputs and the gradients of hidden states, weight and bias, torch and Triton (interpreter) paths."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from rltk.kernels import naive_token_logprobs_and_entropy
from tests.isolated import load_worker, run_isolated

HERE = Path(__file__).resolve().parent
WORKER = HERE / "vocab_parallel_worker.py"
# fp32 on both sides, summed in other orders: measured differences are ~1e-6
TOLERANCE = 2e-5


worker = load_worker(WORKER, "rltk_tests_vocab_parallel_worker")


def _launch(tmp_path: Path, impl: str, extra_env: dict[str, str]) -> dict[str, dict]:
    run_isolated([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                  str(WORKER), str(tmp_path), impl],
                 extra_env={"PYTHONPATH": str(HERE.parents[2]), "RLTK_DISABLE_PLUGIN_AUTOLOAD": "1", **extra_env},
                 timeout=300)
    return {path.stem: torch.load(path, weights_only=True) for path in tmp_path.glob("*.pt")}


def _reference(name: str) -> dict[str, torch.Tensor]:
    hidden, weight, bias, labels, grad_lp, grad_ent, temperature = worker.case_inputs(name)
    leaves = [t.requires_grad_() for t in (hidden, weight, bias) if t is not None]
    logprobs, entropy, sum_pi_squared = naive_token_logprobs_and_entropy(
        hidden, weight, labels, bias=bias, temperature=temperature, ignore_index=worker.IGNORE,
        with_sum_pi_squared=True)
    ((logprobs * grad_lp).sum() + (entropy * grad_ent).sum()).backward()
    grads = [t.grad for t in leaves]
    return {"logprobs": logprobs.detach(), "entropy": entropy.detach(), "sum_pi_squared": sum_pi_squared,
            "grad_hidden": grads[0], "grad_weight": grads[1], "grad_bias": grads[2] if bias is not None else None}


def _check(results: dict[str, dict]) -> None:
    for name in worker.CASES:
        ranks = [results[f"{name}_rank{r}"] for r in range(2)]
        expected = _reference(name)
        for key in ("logprobs", "entropy", "sum_pi_squared", "grad_hidden"):
            assert torch.equal(ranks[0][key], ranks[1][key]), (name, key)  # replicated over the group
            assert torch.allclose(ranks[0][key], expected[key], atol=TOLERANCE, rtol=0), (name, key)
        for key in ("grad_weight", "grad_bias"):
            if expected[key] is not None:
                gathered = torch.cat([ranks[0][key], ranks[1][key]])
                assert torch.allclose(gathered, expected[key], atol=TOLERANCE, rtol=0), (name, key)
    # by hand: logits (0, 0, ln 2, ln 4), p = (1, 1, 2, 4) / 8, label 3 on rank 1's half
    ln2 = math.log(2.0)
    hand = [results[f"hand_rank{r}"] for r in range(2)]
    for rank in hand:
        assert rank["logprobs"].item() == pytest.approx(-ln2, abs=1e-6)
        assert rank["entropy"].item() == pytest.approx(7 / 4 * ln2, abs=1e-6)  # 2 (ln 8)/8 + (ln 4)/4 + (ln 2)/2
        assert rank["grad_hidden"].item() == pytest.approx(3 / 4 * ln2, abs=1e-6)  # sum_v (1[v=3] - p_v) z_v
    assert torch.allclose(hand[0]["grad_weight"], torch.tensor([[-1 / 8], [-1 / 8]]), atol=1e-6)  # (1[v=3]-p_v) h
    assert torch.allclose(hand[1]["grad_weight"], torch.tensor([[-1 / 4], [1 / 2]]), atol=1e-6)


@pytest.mark.distributed
def test_torch_path_at_tp2_equals_the_unsharded_op(tmp_path):
    _check(_launch(tmp_path, "torch", {}))


@pytest.mark.distributed
def test_triton_path_at_tp2_equals_the_unsharded_op(tmp_path):
    pytest.importorskip("triton")
    _check(_launch(tmp_path, "triton", {"TRITON_INTERPRET": "1", "TRITON_CACHE_DIR": str(tmp_path / "triton")}))


def test_labels_map_to_the_shard_rows_or_minus_one():
    from rltk.models.parallel.vocab_parallel import shard_labels

    labels = torch.tensor([0, 4, 5, 9, -100])
    assert shard_labels(labels, vocab_start=5, shard_size=5, ignore_index=-100).tolist() == [-1, -1, 0, 4, -1]
