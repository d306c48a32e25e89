"""End-to-end recipe runs under engines that shard the policy: DeepSpeed ZeRO-3 and FSDP2 (slow; run in CI).

Both convert the policy in place, so these runs exercise what DDP never needs: the SFT stage hands a plain module to the RL stage
(``release_model``), the rollout engine and the frozen reference sample from
whole copies (``full_model_copy``), the engine's copy follows every optimizer
step and a resumed checkpoint, and the fused log-prob op gathers the
partitioned LM head. Each run is checked against the default strategy on the
same config: ZeRO-3 must change where weights live, not what is learned.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from rltk.commands.cli import main
from tests.crash import CRASH_DRIVER
from tests.isolated import run_isolated

pytestmark = pytest.mark.slow

TINY = [
    "model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.intermediate_size=256",
    "data.task_args.max_digits=1", "data.train_size=70", "data.eval_size=20",
    "sft.steps=10", "sft.batch_size=32", "sft.warmup_steps=2",
    "trainer.prompts_per_step=16", "trainer.total_steps=4", "trainer.warmup_steps=2", "trainer.eval_every=2",
    "checkpoint.every=2", "logging.logger=[jsonl]", "logging.plot=false",
]
GRPO = [*TINY, "algorithm.kl_coef=0.01", "trainer.lr=3e-3"]  # a reference model, and steps that move the weights
PPO = [*TINY, "critic.warmup_steps=1"]
# By default DeepSpeed leaves tensors under 1e5 elements whole, which is every tensor of this model.
ZERO3 = ["strategy=deepspeed", "strategy_args.zero_stage=3",
         "strategy_args.config={zero_optimization: {stage3_param_persistence_threshold: 0}}"]
# Values that depend on every piece: the rollouts (the engine's weights), the policy's and the
# reference's log-probs, the update, and the held-out evaluation.
COMPARED = ("sft/sft_loss", "reward", "response_length", "pg_loss", "kl", "entropy", "grad_norm",
            "critic/vf_loss", "critic/values_mean", "eval/accuracy", "eval/mean_response_length")



def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def launch(command: list[str], *, expect: int = 0):
    # Separate processes: DeepSpeed initialises torch.distributed, which must not leak into other tests.
    return run_isolated(command, expect=expect)


def rltk_run(*args: str, expect: int = 0):
    return launch([sys.executable, "-m", "rltk.commands.cli", "run", *args], expect=expect)


def torchrun(*args: str):
    return launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   "-m", "rltk.commands.cli", "run", *args])


def assert_same_metrics(ours: list[dict], theirs: list[dict], *, rel: float, reference_is_policy: bool = True) -> None:
    assert [m["step"] for m in ours] == [m["step"] for m in theirs]
    # At the first RL step the policy is the reference: their log-probs come from the same forward
    # path, so the KL is exactly 0 (rounding noise there is a gradient Adam would scale to a full step).
    # With LoRA the reference is the base with adapters off, which the warm-up's adapter already left.
    for metrics in (ours, theirs):
        first_kl = [m["kl"] for m in metrics if "kl" in m][:1]
        assert first_kl in ([], [0.0]) if reference_is_policy else first_kl[0] > 0
    compared = 0
    for a, b in zip(ours, theirs):
        for key in COMPARED:
            if key in b:
                # PPO's pg_loss while its advantages cancel is float noise around 0
                floor = 1e-6 if key == "pg_loss" else 1e-7
                assert a[key] == pytest.approx(b[key], rel=rel, abs=floor), (a["step"], key, a[key], b[key])
                compared += 1
    assert compared > 20


def test_grpo_zero3_one_process_matches_the_default_strategy_and_resumes_after_a_crash(tmp_path):
    straight = tmp_path / "zero3"
    rltk_run("grpo", f"output_dir={straight}", *ZERO3, *GRPO)
    metrics = read_metrics(straight)
    assert [m["step"] for m in metrics if "reward" in m] == [11, 12, 13, 14]
    assert [m["step"] for m in metrics if "kl" in m] == [11, 12, 13, 14]
    assert max(m["kl"] for m in metrics if "kl" in m) > 0  # the reference is a separate, frozen copy
    # keep_last=2, and step_000010 ends the warm-up (a stage end outlives keep_last)
    assert sorted(p.name for p in (straight / "checkpoints").glob("step_*")) == [
        "step_000010", "step_000012", "step_000014"]
    assert json.loads((straight / "summary.json").read_text())["final"]["eval/num_responses"] == 20

    default = tmp_path / "default"
    assert main(["run", "grpo", f"output_dir={default}", *GRPO]) == 0
    assert_same_metrics(metrics, read_metrics(default), rel=1e-4)

    # Killed after step 13, one step past the checkpoint at 12: the resumed run must restore the
    # policy, the reference and the rollout engine's own copy, and repeat steps 13-14 exactly.
    crashing = tmp_path / "crashing"
    driver = tmp_path / "crash_driver.py"
    driver.write_text(CRASH_DRIVER)
    launch([sys.executable, str(driver), "13", "run", "grpo", f"output_dir={crashing}", *ZERO3, *GRPO], expect=3)
    assert sorted(p.name for p in (crashing / "checkpoints").glob("step_*")) == ["step_000010", "step_000012"]
    out = rltk_run("grpo", f"output_dir={crashing}", *ZERO3, *GRPO)
    assert "resuming from" in out.stdout and "step_000012" in out.stdout
    assert_same_metrics(read_metrics(crashing), metrics, rel=1e-6)


@pytest.fixture(scope="module")
def ddp_two_process_metrics(tmp_path_factory):
    ddp = tmp_path_factory.mktemp("ddp")
    torchrun("grpo", f"output_dir={ddp}", *GRPO)
    return read_metrics(ddp)


@pytest.mark.distributed
def test_grpo_zero3_under_torchrun_with_two_processes_matches_ddp(tmp_path, ddp_two_process_metrics):
    zero3 = tmp_path / "zero3"
    out = torchrun("grpo", f"output_dir={zero3}", *ZERO3, *GRPO)
    metrics = read_metrics(zero3)
    # Only the main rank logs, writes checkpoints and prints the summary.
    assert [m["step"] for m in metrics if "reward" in m] == [11, 12, 13, 14]
    assert [m["step"] for m in metrics if "sft/sft_loss" in m] == list(range(1, 11))
    assert out.stdout.count("rltk: final held-out") == 1
    assert sorted(p.name for p in (zero3 / "checkpoints").glob("step_*")) == [
        "step_000010", "step_000012", "step_000014"]  # keep_last=2 and the warm-up's end
    meta = json.loads((zero3 / "checkpoints" / "step_000014" / "strategy.json").read_text())
    assert meta["zero_stage"] == 3 and meta["world_size"] == 2
    assert_same_metrics(metrics, ddp_two_process_metrics, rel=1e-4)


@pytest.mark.distributed
def test_grpo_fsdp2_under_torchrun_with_two_processes_matches_ddp(tmp_path, ddp_two_process_metrics):
    # FSDP2 all-gathers in every forward of the policy, so the engine samples from a whole copy
    # (ranks generating their own prompts on the sharded module could stop at different steps and
    # hang; this tiny task rarely makes them differ, so the test checks the copy's numbers, not the hang).
    fsdp = tmp_path / "fsdp"
    out = torchrun("grpo", f"output_dir={fsdp}", "strategy_args.fsdp=true", *GRPO)
    metrics = read_metrics(fsdp)
    assert [m["step"] for m in metrics if "reward" in m] == [11, 12, 13, 14]
    assert out.stdout.count("rltk: final held-out") == 1
    assert_same_metrics(metrics, ddp_two_process_metrics, rel=1e-4)


LORA = ["model.lora.r=8", "model.lora.alpha=16"]  # adapters on every linear layer but the head


@pytest.mark.distributed
def test_grpo_lora_zero3_under_torchrun_with_two_processes_matches_ddp(tmp_path):
    """LoRA through the whole recipe: the SFT warm-up and GRPO train the adapter, the reference is the
    base model (adapters off, no copy), checkpoints hold the adapter; ZeRO-3 partitions the frozen
    base and the adapter across two processes and must learn what DDP learns."""
    ddp, zero3 = tmp_path / "ddp_lora", tmp_path / "zero3_lora"
    torchrun("grpo", f"output_dir={ddp}", *GRPO, *LORA)
    torchrun("grpo", f"output_dir={zero3}", *ZERO3, *GRPO, *LORA)
    metrics = read_metrics(zero3)
    assert [m["step"] for m in metrics if "reward" in m] == [11, 12, 13, 14]
    assert max(m["kl"] for m in metrics if "kl" in m) > 0  # the adapted policy moved away from its base
    for run_dir in (ddp, zero3):  # adapter-only checkpoints, whatever the strategy
        model_dir = run_dir / "checkpoints" / "step_000014" / "model"
        assert (model_dir / "adapter_config.json").is_file() and (model_dir / "adapter_model.safetensors").is_file()
        assert not list(model_dir.glob("model*.safetensors"))
    assert_same_metrics(metrics, read_metrics(ddp), rel=1e-4, reference_is_policy=False)


def test_ppo_zero3_one_process_matches_the_default_strategy(tmp_path):
    zero3, default = tmp_path / "zero3", tmp_path / "default"
    rltk_run("ppo", f"output_dir={zero3}", *ZERO3, *PPO)
    assert main(["run", "ppo", f"output_dir={default}", *PPO]) == 0
    metrics = read_metrics(zero3)
    assert [m["step"] for m in metrics if "critic/vf_loss" in m] == [11, 12, 13, 14]
    assert (zero3 / "checkpoints" / "step_000014" / "critic" / "strategy.json").is_file()
    assert_same_metrics(metrics, read_metrics(default), rel=1e-4)


# Offline DPO with the frozen reference (a whole copy, gathered from the shards) or with the reference's
# log-probs precomputed once; a learning rate that moves the margins within three steps.
DPO = ["stages=[{name: dpo, type: dpo}]", "trainer.total_steps=3", "trainer.warmup_steps=0", "trainer.eval_every=3",
       "trainer.lr=3e-3", "data.train_size=64", "data.eval_size=16", "checkpoint.every=2",
       "logging.logger=[jsonl]", "logging.plot=false"]
DPO_COMPARED = ("dpo_loss", "nll_loss", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected",
                "grad_norm", "eval/accuracy", "eval/mean_response_length")


@pytest.fixture(scope="module")
def dpo_one_process_metrics(tmp_path_factory):
    """One process's metrics of the DPO config with the given extra arguments (each run once)."""
    done = {}

    def get(*extra: str) -> list[dict]:
        if extra not in done:
            single = tmp_path_factory.mktemp("dpo_single")
            assert main(["run", "dpo", f"output_dir={single}", *DPO, *extra]) == 0
            done[extra] = read_metrics(single)
        return done[extra]

    return get


@pytest.mark.distributed
@pytest.mark.parametrize("strategy, precompute, lora, sharded", [
    # FSDP2: the reference copy is gathered from the shards
    (["strategy_args.fsdp=true"], "false", (), {"fsdp": True}),
    # ZeRO-3: the reference's log-probs from a gathered copy, once, before the copy goes
    (ZERO3, "true", (), {"zero_stage": 3}),
    # LoRA on ZeRO-3: the reference is the partitioned base with adapters off, so the one-off pass over
    # every pair is collective (each rank runs all of them, in step)
    (ZERO3, "true", ("model.lora.r=4",), {"zero_stage": 3}),
], ids=["fsdp2", "zero3", "zero3-lora"])
def test_dpo_sharded_under_torchrun_with_two_processes_matches_one_process(tmp_path, dpo_one_process_metrics,
                                                                          strategy, precompute, lora, sharded):
    """Each rank trains on its half of every global batch of pairs: the losses, margins and gradient norm of
    each step must be one process's (with DDP: tests/recipes/test_dpo_learning.py)."""
    run_dir = tmp_path / "sharded"
    out = torchrun("dpo", f"output_dir={run_dir}", *strategy, f"dpo.precompute_reference={precompute}", *DPO, *lora)
    assert out.stdout.count("rltk: final held-out") == 1
    meta = json.loads((run_dir / "checkpoints" / "step_000003" / "strategy.json").read_text())
    assert meta["world_size"] == 2 and sharded.items() <= meta.items()
    ours, theirs = read_metrics(run_dir), dpo_one_process_metrics(*lora)
    assert [m["step"] for m in ours] == [m["step"] for m in theirs]
    steps = [m for m in ours if "dpo_loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3] and all(m["pairs"] == 16 for m in steps)
    assert steps[0]["dpo_loss"] == pytest.approx(0.693147, abs=1e-5)  # the reference is the starting policy
    assert steps[-1]["rewards/margins"] > steps[0]["rewards/margins"] + 1e-3  # the steps moved the weights
    compared = 0
    for a, b in zip(ours, theirs):
        for key in DPO_COMPARED:
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key, a[key], b[key])
                compared += 1
    assert compared >= 20
