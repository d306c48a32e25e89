"""Expert parallelism (``strategy_args.expert_parallel_size``): the tiny MoE's experts split over two gloo
processes must compute what one process computes on the global batch.

Tolerance: fp32, 1e-5 absolute on log-probs and gradients. The two runs differ only in the order of float
sums: the combine adds a token's expert outputs in another order, and DDP's average then ``x world`` scaling
rounds (measured here: log-probs equal, gradients within 3e-8).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rltk.errors import ConfigError
from rltk.strategies.accelerate_strategy import AccelerateStrategy
from tests.isolated import load_worker
from tests.waits import scaled

WORKER_PATH = Path(__file__).with_name("expert_parallel_worker.py")
ATOL = 1e-5


worker = load_worker(WORKER_PATH, "rltk_tests_expert_parallel_worker")


def _launch(out_dir: Path, processes: int, phases: str) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RLTK_DISABLE_PLUGIN_AUTOLOAD": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
               str(WORKER_PATH), str(out_dir), phases]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=scaled(240))
    if proc.returncode != 0:
        pytest.fail(f"torchrun worker failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=True) for r in range(processes)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("expert_parallel")
    return out_dir, _launch(out_dir, 2, "all")


def _one_process(replay: bool, one_sided: bool = False):
    strategy = AccelerateStrategy(cpu=True)
    strategy.setup(worker.tiny_moe(), **worker.SETUP)
    batch = worker.rows_of(worker.global_batch(strategy.unwrap().config.vocab_size), 0, 1)
    logprobs = worker.forward_backward(strategy, worker.one_sided(batch) if one_sided else batch, replay)
    return logprobs, worker.reduced_gradients(strategy)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.mark.distributed
@pytest.mark.parametrize("replay", [False, True], ids=["own_routing", "routing_replay"])
def test_logprobs_and_every_gradient_match_one_process(two_ranks, replay):
    _, ranks = two_ranks
    suffix = "_replay" if replay else ""
    logprobs, grads = _one_process(replay)
    for rank in ranks:
        assert rank["local_expert_shape"][0] == 2  # each rank holds 2 of the 4 experts
        assert torch.allclose(rank["logprobs" + suffix], logprobs[rank["rows"]], atol=ATOL, rtol=0)
        assert _max_diff(rank["grads" + suffix], grads) < ATOL
    # the experts' gradients are not zero: a dispatch that lost tokens could not match them
    assert all(grads[k].abs().max() > 1e-4 for k in grads if "experts" in k)
    # replay changes the routing (the replayed experts are not the router's own)
    other_logprobs, _ = _one_process(not replay)
    assert (other_logprobs - logprobs).abs().max() > 1e-3


@pytest.mark.distributed
def test_experts_no_token_reaches_take_part_in_the_backward(two_ranks):
    # every token replayed to experts 0 and 1 (rank 0's): rank 1 still joins the backward all-to-all
    _, ranks = two_ranks
    logprobs, grads = _one_process(True, one_sided=True)
    for rank in ranks:
        assert torch.allclose(rank["logprobs_one_sided"], logprobs[rank["rows"]], atol=ATOL, rtol=0)
        assert _max_diff(rank["grads_one_sided"], grads) < ATOL
    unused = grads["model.layers.0.mlp.experts.down_proj"][2:]
    assert unused.abs().max() == 0 and grads["model.layers.0.mlp.experts.down_proj"][:2].abs().max() > 1e-4


@pytest.mark.distributed
def test_a_qwen2_moe_with_a_shared_expert_matches_one_process(two_ranks):
    _, ranks = two_ranks
    strategy = AccelerateStrategy(cpu=True)
    strategy.setup(worker.tiny_qwen2_moe(), **worker.SETUP)
    logprobs = worker.forward_backward(strategy, worker.rows_of(worker.global_batch(50), 0, 1), False)
    grads = worker.reduced_gradients(strategy)
    assert any("shared_expert." in name for name in grads)
    for rank in ranks:
        assert torch.allclose(rank["logprobs_qwen2_moe"], logprobs[rank["rows"]], atol=ATOL, rtol=0)
        assert _max_diff(rank["grads_qwen2_moe"], grads) < ATOL


@pytest.mark.distributed
def test_training_and_resuming_at_two_ranks_match_one_process(two_ranks):
    out_dir, ranks = two_ranks
    strategy = AccelerateStrategy(cpu=True)
    strategy.setup(worker.tiny_moe(), **worker.SETUP)
    worker.train(strategy, worker.rows_of(worker.global_batch(strategy.unwrap().config.vocab_size), 0, 1),
                 worker.STEPS)
    alone = strategy.full_state_dict()
    for rank in ranks:
        assert _max_diff(rank["trained"], alone) < ATOL
        assert _max_diff(rank["resumed"], rank["trained"]) == 0.0  # resumed at EP=2: exactly the same run
        assert _max_diff(rank["reference_copy"], rank["trained"]) == 0.0  # the plain copy has whole experts
        assert rank["copy_ddp_ignores"] == []  # a later stage's DDP over the copy syncs the experts too
    # the checkpoint holds whole experts in the hub format: it resumes in one process (another layout) too
    resumed = AccelerateStrategy(cpu=True)
    resumed.setup(worker.tiny_moe(seed=1), **worker.SETUP)
    resumed.load(out_dir / "checkpoint")
    assert resumed.optimizer_steps == worker.CHECKPOINT_STEP


@pytest.mark.distributed
@pytest.mark.slow  # four processes on a loaded 2-core machine (~60 s): the expert-data reduction runs here only
def test_two_expert_groups_of_two_ranks_match_one_process(tmp_path):
    # ranks {0, 1} and {2, 3} each split the experts; ranks 0 and 2 (1 and 3) sum their slice's gradients
    ranks = _launch(tmp_path, 4, "grads")
    strategy = AccelerateStrategy(cpu=True)
    strategy.setup(worker.tiny_moe(), **worker.SETUP)
    batch = worker.rows_of(worker.global_batch(strategy.unwrap().config.vocab_size), 0, 1)
    worker.train(strategy, batch, worker.STEPS)
    alone = strategy.full_state_dict()
    for replay in (False, True):
        suffix = "_replay" if replay else ""
        logprobs, grads = _one_process(replay)
        for rank in ranks:
            assert torch.allclose(rank["logprobs" + suffix], logprobs[rank["rows"]], atol=ATOL, rtol=0)
            assert _max_diff(rank["grads" + suffix], grads) < ATOL
    for rank in ranks:
        assert rank["local_expert_shape"][0] == 2
        assert _max_diff(rank["trained"], alone) < ATOL


def test_a_moe_checkpoint_resumes_in_one_process(tmp_path):
    # save_pretrained writes per-expert tensors (the hub format); loading stacks them back
    strategy = AccelerateStrategy(cpu=True)
    strategy.setup(worker.tiny_moe(), **worker.SETUP)
    strategy.save(tmp_path)
    resumed = AccelerateStrategy(cpu=True)
    resumed.setup(worker.tiny_moe(seed=3), **worker.SETUP)
    resumed.load(tmp_path)
    assert _max_diff(resumed.full_state_dict(), strategy.full_state_dict()) == 0.0


@pytest.mark.parametrize("size", [0, 1.5, True])
def test_a_size_that_is_not_a_rank_count_is_refused(size):
    with pytest.raises(ConfigError, match="strategy_args.expert_parallel_size"):
        AccelerateStrategy(cpu=True, expert_parallel_size=size)


def test_expert_parallel_with_fsdp_is_refused():
    with pytest.raises(ConfigError, match="strategy_args.expert_parallel_size=2 with strategy_args.fsdp"):
        AccelerateStrategy(cpu=True, fsdp=True, expert_parallel_size=2)


def test_a_size_that_does_not_divide_the_data_ranks_is_refused():
    with pytest.raises(ConfigError, match="strategy_args.expert_parallel_size=2 does not divide the 1 data"):
        AccelerateStrategy(cpu=True, expert_parallel_size=2)
