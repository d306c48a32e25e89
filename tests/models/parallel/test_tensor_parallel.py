"""Tensor parallelism at TP=2 (2 gloo processes) and TP=2 x FSDP2=2 (4 processes, a 2-D mesh) computes what one
process computes on the same global batch: per-token log-probs and entropy through the vocabulary-parallel head,
every parameter's gradient (gathered to full) and the weights after one clipped AdamW step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from rltk.errors import ConfigError
from rltk.models.logprobs import response_logprobs
from tests.isolated import load_worker, run_isolated

HERE = Path(__file__).resolve().parent
WORKER = HERE / "tensor_parallel_worker.py"
# fp32 throughout; the sharded matmuls and all-reduces sum in other orders (measured up to ~1e-6 here)
TOLERANCE = 1e-5


worker = load_worker(WORKER, "rltk_tests_tensor_parallel_worker")


def _launch(tmp_path: Path, processes: int, fsdp: bool, tie: bool) -> list[dict]:
    run_isolated([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
                  str(WORKER), str(tmp_path), "1" if fsdp else "0", "1" if tie else "0"],
                 extra_env={"PYTHONPATH": str(HERE.parents[2]), "RLTK_DISABLE_PLUGIN_AUTOLOAD": "1"}, timeout=300)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(processes)]


def _one_process(tie: bool) -> dict:
    from rltk.strategies.accelerate_strategy import AccelerateStrategy

    strategy = AccelerateStrategy(cpu=True)
    strategy.setup(worker.tiny_qwen2(tie), **worker.SETUP)
    ids, mask = worker.global_batch()
    logprobs, entropy = response_logprobs(strategy.model, ids, mask, worker.RESPONSE, temperature=worker.TEMPERATURE,
                                          impl="torch", with_entropy=True)
    strategy.backward(worker.loss_of(logprobs, entropy, mask, mask[:, -worker.RESPONSE:].sum()))
    grads = {name: p.grad.detach().clone() for name, p in strategy.model.named_parameters()}
    grad_norm = strategy.step()["grad_norm"]
    return {"logprobs": logprobs.detach(), "entropy": entropy.detach(), "grads": grads, "grad_norm": grad_norm,
            "weights": strategy.full_state_dict()}


def _assert_close(name: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.shape == expected.shape, name
    difference = (got - expected).abs().max().item()
    assert difference <= TOLERANCE, f"{name}: max |difference| {difference:.3g} > {TOLERANCE}"


def _compare(ranks: list[dict], reference: dict) -> None:
    for rank in ranks:
        rows = slice(*rank["rows"])
        _assert_close("logprobs", rank["logprobs"], reference["logprobs"][rows])
        _assert_close("entropy", rank["entropy"], reference["entropy"][rows])
        assert rank["grads"].keys() == reference["grads"].keys()
        for name, grad in reference["grads"].items():
            _assert_close(f"gradient of {name}", rank["grads"][name], grad)
        assert rank["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
        for name, weight in reference["weights"].items():
            _assert_close(f"{name} after the step", rank["weights"][name], weight)
            assert torch.equal(rank["copy"][name], rank["weights"][name]), f"full_model_copy: {name}"
        assert rank["copy_tied"] == rank["tied"]  # the copy's head is its embedding exactly when the model's is
    assert {rank["rows"] for rank in ranks} == {(0, worker.BATCH)} or len(ranks) == 4


@pytest.mark.distributed
@pytest.mark.slow  # two torchrun processes importing transformers and a DTensor model: ~35 s on a loaded 2-core machine
@pytest.mark.parametrize("tie", [True, False], ids=["tied-head", "own-head"])
def test_tp2_matches_one_process(tmp_path, tie):
    ranks = _launch(tmp_path, 2, fsdp=False, tie=tie)
    assert [rank["rows"] for rank in ranks] == [(0, worker.BATCH)] * 2  # one data share: both ranks, all rows
    _compare(ranks, _one_process(tie))


@pytest.mark.distributed
@pytest.mark.slow  # four processes on two cores: ~40 s here
def test_tp2_by_fsdp2_on_a_2d_mesh_matches_one_process(tmp_path):
    ranks = _launch(tmp_path, 4, fsdp=True, tie=True)
    half = worker.BATCH // 2
    assert [rank["rows"] for rank in ranks] == [(0, half), (0, half), (half, worker.BATCH), (half, worker.BATCH)]
    _compare(ranks, _one_process(True))


@pytest.mark.parametrize("sizes, named", [
    ({"num_attention_heads": 3, "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 50},
     "num_attention_heads=3"),
    ({"num_attention_heads": 4, "num_key_value_heads": 1, "intermediate_size": 64, "vocab_size": 50},
     "num_key_value_heads=1"),
    ({"num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 63, "vocab_size": 50},
     "intermediate_size=63"),
    ({"num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 64, "vocab_size": 50},
     "vocab_size=50"),
])
def test_a_size_that_does_not_divide_is_refused_naming_the_key(sizes, named):
    from rltk.models.parallel.sizes import check_tensor_parallel_sizes

    tp = 2 if named != "vocab_size=50" else 4
    with pytest.raises(ConfigError, match=rf"strategy_args\.tensor_parallel_size={tp} does not divide {named}"):
        check_tensor_parallel_sizes(sizes, tp, "the test model")
