"""Two processes (torchrun, gloo on CPU) must train exactly like one process on the global batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from rltk.checkpoint import CheckpointManager
from rltk.strategies.accelerate_strategy import AccelerateStrategy

from tests.isolated import load_worker
from tests.waits import scaled

WORKER_PATH = Path(__file__).with_name("distributed_worker.py")


worker = load_worker(WORKER_PATH, "rltk_tests_distributed_worker")


def _max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def two_process_results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("distributed")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RLTK_DISABLE_PLUGIN_AUTOLOAD": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(WORKER_PATH), str(out_dir)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=scaled(180))
    if proc.returncode != 0:
        pytest.fail(f"torchrun worker failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    results = {path.stem: torch.load(path, weights_only=True) for path in out_dir.glob("*.pt")}
    return out_dir, results


@pytest.fixture(scope="module")
def single_process_reference():
    strategy = AccelerateStrategy(cpu=True)
    strategy.setup(worker.tiny_qwen2(seed=0), **worker.SETUP)
    losses, grad_norms = worker.train_steps(strategy, worker.global_batches(), micro_batches=2)
    return {"weights": strategy.full_state_dict(), "losses": losses, "grad_norms": grad_norms}


@pytest.mark.distributed
@pytest.mark.parametrize("phase", ["ddp", "fsdp"])
def test_ranks_hold_identical_parameters(two_process_results, phase):
    _, results = two_process_results
    rank0, rank1 = results[f"{phase}_rank0"], results[f"{phase}_rank1"]
    assert _max_abs_diff(rank0["weights"], rank1["weights"]) == 0.0
    assert rank0["losses"] == rank1["losses"]


@pytest.mark.distributed
@pytest.mark.parametrize("phase", ["ddp", "fsdp"])
def test_ddp_and_fsdp2_step_with_fused_adamw(two_process_results, phase):
    # FSDP2's DTensor parameters take torch's fused kernel as DDP's plain ones do: the implementations
    # agree only up to rounding, and the strategies must compute the same update the same way
    _, results = two_process_results
    assert results[f"{phase}_rank0"]["fused"] is True and results[f"{phase}_rank1"]["fused"] is True


@pytest.mark.distributed
@pytest.mark.parametrize("phase", ["ddp", "fsdp"])
def test_two_processes_match_one_process_on_the_global_batch(two_process_results, single_process_reference, phase):
    _, results = two_process_results
    distributed = results[f"{phase}_rank0"]
    reference = single_process_reference
    # Adam and clipping are blind to a constant gradient factor, so the parameters alone would not
    # catch a wrong world_size scaling in backward(); the pre-clipping gradient norm does.
    assert distributed["grad_norms"] == pytest.approx(reference["grad_norms"], rel=1e-6)
    assert distributed["losses"] == pytest.approx(reference["losses"], abs=1e-6)
    assert _max_abs_diff(distributed["weights"], reference["weights"]) < 1e-6


@pytest.mark.distributed
@pytest.mark.parametrize("phase", ["ddp", "fsdp"])
def test_resume_from_checkpoint_is_bitwise_identical_under_two_processes(two_process_results, phase):
    _, results = two_process_results
    straight, resumed = results[f"{phase}_rank0"], results[f"{phase}_resumed_rank0"]
    assert resumed["losses"] == straight["losses"][worker.CHECKPOINT_STEP:]
    assert resumed["grad_norms"] == straight["grad_norms"][worker.CHECKPOINT_STEP:]
    assert _max_abs_diff(resumed["weights"], straight["weights"]) == 0.0


@pytest.mark.distributed
def test_fsdp_checkpoint_resumes_in_one_process(two_process_results):
    """Weights and optimizer state are saved unsharded by name: a 2-process FSDP run continues in 1 process."""
    out_dir, results = two_process_results
    checkpoint = out_dir / "ckpt_fsdp" / f"step_{worker.CHECKPOINT_STEP:06d}"
    config = json.loads((checkpoint / "model" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]  # not FSDP2's FSDPQwen2ForCausalLM

    strategy = AccelerateStrategy(cpu=True)
    strategy.setup(worker.tiny_qwen2(seed=1), **worker.SETUP)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # rank 0 of the 2-process run left an RNG file for this rank 0
        CheckpointManager(checkpoint.parent).load(checkpoint, strategy)
    losses, _ = worker.train_steps(strategy, worker.global_batches()[worker.CHECKPOINT_STEP:], micro_batches=2)
    two_process = results["fsdp_rank0"]
    assert losses == pytest.approx(two_process["losses"][worker.CHECKPOINT_STEP:], abs=1e-6)
    assert _max_abs_diff(strategy.full_state_dict(), two_process["weights"]) < 1e-6


@pytest.mark.distributed
@pytest.mark.parametrize("phase", ["ddp", "fsdp"])
def test_plain_copy_and_released_model_hold_the_trained_weights(two_process_results, phase):
    # Under FSDP2 both are rebuilt from the structure taken before sharding: the original class,
    # whole tensors, and a module the next stage's strategy can shard again.
    _, results = two_process_results
    trained = results[f"{phase}_rank0"]["weights"]
    for rank in (0, 1):
        plain = results[f"{phase}_plain_rank{rank}"]
        assert plain["copy_class"] == plain["released_class"] == "Qwen2ForCausalLM"
        for name, value in trained.items():
            assert torch.equal(plain["copy"][name], value), name
            assert torch.equal(plain["follower"][name], value), name


# --------------------------------------------------------------------------
# LoRA (model.lora) under DDP: the adapter trains as in one process
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_two_process_results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("distributed_lora")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RLTK_DISABLE_PLUGIN_AUTOLOAD": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(WORKER_PATH), str(out_dir), "ddp_lora"]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=scaled(180))
    if proc.returncode != 0:
        pytest.fail(f"torchrun worker failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return {path.stem: torch.load(path, weights_only=True) for path in out_dir.glob("*.pt")}


@pytest.fixture(scope="module")
def lora_single_process_reference():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # module fixtures start before conftest's per-test one-thread fixture
    try:
        strategy = AccelerateStrategy(cpu=True)
        strategy.setup(worker.tiny_lora_qwen2(seed=0), **worker.SETUP)
        initial = {k: v.detach().clone() for k, v in strategy.unwrap().state_dict().items()}
        losses, grad_norms = worker.train_steps(strategy, worker.global_batches(), micro_batches=2)
        return {"weights": strategy.full_state_dict(), "losses": losses, "grad_norms": grad_norms,
                "initial": initial}
    finally:
        torch.set_num_threads(previous)


@pytest.mark.distributed
def test_lora_under_ddp_matches_one_process_on_the_global_batch(lora_two_process_results,
                                                               lora_single_process_reference):
    reference = lora_single_process_reference
    rank0, rank1 = lora_two_process_results["ddp_lora_rank0"], lora_two_process_results["ddp_lora_rank1"]
    assert _max_abs_diff(rank0["weights"], rank1["weights"]) == 0.0
    adapter = {k for k in reference["weights"] if "lora_" in k}
    assert len(adapter) == 2 * 7  # A and B of q, k, v, o, gate, up, down in the one layer
    # the adapter trained and nothing else moved, in one process as in two
    for name, initial in reference["initial"].items():
        moved = not torch.equal(reference["weights"][name], initial)
        assert moved == (name in adapter), name
    assert rank0["grad_norms"] == pytest.approx(reference["grad_norms"], rel=1e-6)
    assert rank0["losses"] == pytest.approx(reference["losses"], abs=1e-6)
    # Adam divides each gradient element by its own running RMS, so an element whose gradient is near
    # zero (B starts at zero, A's gradient is B^T times something) turns the all-reduce's float
    # rounding into an update difference that is a fraction of lr (1e-3), not of the gradient:
    # measured 2.3e-6 on an o_proj B entry of size 3.5e-3. A real fault (a rank's half of the batch
    # missing from the sum) moves weights by ~lr per step.
    assert _max_abs_diff(rank0["weights"], reference["weights"]) < 1e-5


@pytest.mark.distributed
def test_lora_under_ddp_resumes_bitwise_from_an_adapter_checkpoint(lora_two_process_results):
    straight, resumed = lora_two_process_results["ddp_lora_rank0"], lora_two_process_results["ddp_lora_resumed_rank0"]
    assert resumed["losses"] == straight["losses"][worker.CHECKPOINT_STEP:]
    assert resumed["grad_norms"] == straight["grad_norms"][worker.CHECKPOINT_STEP:]
    assert _max_abs_diff(resumed["weights"], straight["weights"]) == 0.0
