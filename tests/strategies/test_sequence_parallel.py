"""Ulysses sequence parallelism through the strategy seam (issue 56, item 2) and the layout's refusals (item 1).

Real gloo processes (torchrun) run ``strategy.forward_backward`` over ``strategy.logprobs`` with
``sequence_parallel_size=2``; every rank's per-token log-probs, entropy and every parameter's gradient must
equal one process on the same global batch. Tolerance: 1e-5 absolute in fp32 (measured: log-probs and
entropy bitwise equal, gradients within 3e-8; the all-to-all only reorders which rank computes a head).
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

WORKER_PATH = Path(__file__).with_name("sequence_parallel_worker.py")
ATOL = 1e-5


worker = load_worker(WORKER_PATH, "rltk_tests_sequence_parallel_worker")


@pytest.fixture(scope="module")
def one_process():
    strategy = AccelerateStrategy(cpu=True)
    strategy.setup(worker.tiny_qwen2(), **worker.SETUP)
    return worker.run(strategy, torch.arange(worker.GLOBAL_BATCH))


def _launch(tmp_path: Path, processes: int, *args: str) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RLTK_DISABLE_PLUGIN_AUTOLOAD": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
               str(WORKER_PATH), str(tmp_path), *args]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=scaled(60 * processes))
    if proc.returncode != 0:
        pytest.fail(f"torchrun worker failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(processes)]


def _assert_like_one_process(ranks: list[dict], reference: dict, data_ranks: int, left_padding: bool = True) -> None:
    rows = torch.cat([r["rows"] for r in ranks[:: len(ranks) // data_ranks]])
    assert sorted(rows.tolist()) == list(range(worker.GLOBAL_BATCH))  # the data ranks split the rows
    mask = worker.global_batch(left_padding)["response_mask"].bool()
    for result in ranks:
        rows = result["rows"]
        for key in ("logprobs", "entropy"):
            torch.testing.assert_close(result[key][mask[rows]], reference[key][rows][mask[rows]], rtol=0, atol=ATOL)
        assert result["grads"].keys() == reference["grads"].keys()
        for name, grad in reference["grads"].items():
            torch.testing.assert_close(result["grads"][name], grad, rtol=0, atol=ATOL, msg=name)
    # each data rank's share of the loss (the same on every rank of its sequence group) adds up to the whole
    shares = torch.stack([r["loss"] for r in ranks[:: len(ranks) // data_ranks]])
    torch.testing.assert_close(shares.sum(), reference["loss"], rtol=0, atol=ATOL)
    assert all(g.abs().max() > 0 for g in reference["grads"].values())  # every parameter is tested


@pytest.mark.distributed
def test_two_ranks_splitting_every_sequence_match_one_process(tmp_path, one_process):
    ranks = _launch(tmp_path, 2, "2")
    _assert_like_one_process(ranks, one_process, data_ranks=1)


@pytest.mark.distributed
def test_rows_without_left_padding_split_on_causality_alone_and_match_one_process(tmp_path):
    from rltk.models.parallel.sequence import only_trailing_padding

    batch = worker.global_batch(left_padding=False)
    assert only_trailing_padding(batch["attention_mask"]) and not only_trailing_padding(
        worker.global_batch()["attention_mask"])
    strategy = AccelerateStrategy(cpu=True)
    strategy.setup(worker.tiny_qwen2(), **worker.SETUP)
    reference = worker.run(strategy, torch.arange(worker.GLOBAL_BATCH), left_padding=False)
    _assert_like_one_process(_launch(tmp_path, 2, "2", "causal"), reference, data_ranks=1, left_padding=False)


@pytest.mark.distributed
def test_a_lora_adapter_split_over_two_ranks_matches_one_process(tmp_path):
    strategy = AccelerateStrategy(cpu=True)
    strategy.setup(worker.tiny_lora_qwen2(), **worker.SETUP)
    reference = worker.run(strategy, torch.arange(worker.GLOBAL_BATCH))
    assert all("lora_" in name for name in reference["grads"])  # only the adapter trains
    _assert_like_one_process(_launch(tmp_path, 2, "2", "lora"), reference, data_ranks=1)


@pytest.mark.distributed
@pytest.mark.slow  # two torchrun processes: ~20 s
def test_two_ranks_splitting_every_sequence_and_sharding_with_fsdp2_match_one_process(tmp_path, one_process):
    # FSDP2 shards the parameters over the sequence group's two ranks: each forward gathers them, each backward
    # reduce-scatters the two token shares' gradients (averaged, then scaled back to their sum)
    ranks = _launch(tmp_path, 2, "2", "fsdp")
    _assert_like_one_process(ranks, one_process, data_ranks=1)


@pytest.mark.distributed
@pytest.mark.slow  # four torchrun processes on the CI's two cores: about a minute
def test_sequence_parallel_2_by_data_parallel_2_match_one_process(tmp_path, one_process):
    ranks = _launch(tmp_path, 4, "2")
    assert [r["rows"].tolist() for r in ranks] == [[0, 2], [0, 2], [1, 3], [1, 3]]  # ranks 0-1: data rank 0
    _assert_like_one_process(ranks, one_process, data_ranks=2)


def test_sizes_that_do_not_divide_the_processes_name_the_key():
    with pytest.raises(ConfigError, match=r"strategy_args.sequence_parallel_size=2 .* does not divide the 1 processes"):
        AccelerateStrategy(cpu=True, sequence_parallel_size=2)


@pytest.mark.parametrize("key", ["sequence_parallel_size", "tensor_parallel_size", "expert_parallel_size"])
def test_sizes_an_engine_does_not_build_are_refused_naming_the_key(key):
    from rltk.strategies.deepspeed_strategy import DeepSpeedStrategy

    # a world of 2 that the sizes divide, without starting a process group (the refusal comes first)
    strategy = DeepSpeedStrategy.__new__(DeepSpeedStrategy)
    strategy._world_size = 2
    with pytest.raises(ConfigError, match=rf"strategy_args.{key}=2: DeepSpeedStrategy does not run this kind"):
        strategy._init_layout(**{key: 2})
    accelerate = AccelerateStrategy.__new__(AccelerateStrategy)
    accelerate._world_size = 2
    accelerate._init_layout(sequence_parallel_size=2)
    assert (accelerate.data_rank, accelerate.data_world_size) == (0, 1)


def test_heads_that_the_size_does_not_divide_are_refused_naming_the_key():
    from rltk.models.parallel.sequence import check_heads_divide

    model = worker.tiny_qwen2()  # 4 heads over 2 key/value heads
    check_heads_divide(model, 2)
    with pytest.raises(ConfigError, match=r"strategy_args.sequence_parallel_size=4 does not divide .* 2 key/value"):
        check_heads_divide(model, 4)


def test_the_data_coordinates_follow_the_layout():
    strategy = AccelerateStrategy.__new__(AccelerateStrategy)
    strategy._world_size, strategy._rank = 4, 3
    strategy._init_layout(sequence_parallel_size=2)
    assert (strategy.data_rank, strategy.data_world_size, strategy.world_size) == (1, 2, 4)
    strategy._init_layout()
    assert (strategy.data_rank, strategy.data_world_size) == (3, 4)


def test_a_run_with_a_size_that_does_not_divide_exits_2_naming_the_key(tmp_path, capsys):
    from rltk.commands.cli import main

    code = main(["run", "sft", f"output_dir={tmp_path / 'run'}", "strategy_args.tensor_parallel_size=2",
                 "sft.steps=1", "logging.logger=[jsonl]", "logging.plot=false", "checkpoint.every=0"])
    assert code == 2
    assert "strategy_args.tensor_parallel_size=2" in capsys.readouterr().err


GRPO_SHORT = ["logging.logger=[jsonl]", "logging.plot=false", "checkpoint.every=0", "data.task_args.max_digits=1",
              "data.train_size=70", "data.eval_size=20", "sft.steps=6", "sft.stop_at_accuracy=null",
              "sft.warmup_steps=2", "trainer.total_steps=3", "trainer.warmup_steps=1", "trainer.eval_every=2"]


def _metrics(run_dir: Path) -> list[dict]:
    import json

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not (k.startswith("time/") or k.endswith("_per_s"))} for row in rows]


@pytest.mark.distributed
@pytest.mark.slow  # an SFT warm-up and three GRPO steps, once in two processes and once in one: about two minutes
def test_seeded_grpo_steps_with_sequence_parallel_log_what_one_process_logs(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RLTK_DISABLE_PLUGIN_AUTOLOAD": "1", "WANDB_MODE": "offline"}
    cli = ["-m", "rltk.commands.cli", "run", "grpo"]
    runs = {"one": [sys.executable, *cli, f"output_dir={tmp_path / 'one'}", *GRPO_SHORT],
            "split": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *cli,
                      f"output_dir={tmp_path / 'split'}", "strategy_args.sequence_parallel_size=2", *GRPO_SHORT]}
    for name, command in runs.items():
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=scaled(600))
        assert proc.returncode == 0, f"{name}: {proc.stderr[-4000:]}"
    one, split = _metrics(tmp_path / "one"), _metrics(tmp_path / "split")
    assert [r["step"] for r in one] == [r["step"] for r in split] and any("grad_norm" in r for r in one)
    for a, b in zip(one, split):
        assert a.keys() == b.keys()
        for key, value in a.items():
            # the same samples and rewards; losses, norms and entropy up to fp32 rounding of the split forward
            assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-6), f"step {a['step']}: {key}"
