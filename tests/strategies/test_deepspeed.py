"""DeepSpeedStrategy: config derivation and errors (in process), and ZeRO runs in real processes.

The ZeRO runs happen in three launches of ds_worker.py, shared by the tests
below through module fixtures:

* two processes under torchrun: ZeRO-2 with a shards-only checkpoint on the
  way, ZeRO-3, ZeRO-3 with tied embeddings, and a ZeRO-3 run killed one step
  after its checkpoint;
* two fresh processes started by the ``deepspeed`` launcher, resuming that
  checkpoint;
* one process without any launcher: ZeRO-1, ZeRO-2 with optimizer offload,
  ZeRO-3 with optimizer and parameter offload, bf16, a NaN step, and the
  two-process ZeRO-2 and ZeRO-3 checkpoints resumed in one process.

Every run is compared with an independent plain-torch AdamW loop over the
same global batches.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import rltk
from rltk.strategies.base import OptimizerSettings, TrainingStrategy, build_adamw, build_lr_scheduler
from rltk.distributed import ensure_single_process_environment, free_local_port, strip_local_rank_argument
from rltk.strategies.deepspeed_checkpoint import check_resumable, export_model_folder, read_checkpoint_meta
from rltk.strategies.deepspeed_config import (
    derive_deepspeed_config,
    merge_deepspeed_config,
    read_deepspeed_config,
    resolve_deepspeed_config,
)
from rltk.strategies.deepspeed_strategy import DeepSpeedStrategy

from tests.waits import scaled

HERE = Path(__file__).parent
CPU = torch.device("cpu")
RENDEZVOUS_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _load(name: str, filename: str):
    spec = importlib.util.spec_from_file_location(name, HERE / filename)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


shared = _load("rltk_tests_distributed_worker", "distributed_worker.py")


def resolve(**overrides) -> dict:
    arguments = dict(zero_stage=2, offload_optimizer=False, offload_params=False, mixed_precision="no",
                     user_config={}, world_size=2, device=CPU)
    return resolve_deepspeed_config(**{**arguments, **overrides})


# --------------------------------------------------------------------------
# Registration and config derivation (no processes started)
# --------------------------------------------------------------------------


def test_registered_as_training_strategy_deepspeed():
    assert rltk.get_component("training_strategy", "deepspeed") is DeepSpeedStrategy
    assert issubclass(DeepSpeedStrategy, TrainingStrategy)


def test_derived_config_maps_every_rltk_setting():
    config = derive_deepspeed_config(zero_stage=3, offload_optimizer=True, offload_params=True,
                                     mixed_precision="bf16", grad_clip=0.5, world_size=4)
    assert config == {
        "train_micro_batch_size_per_gpu": 1,
        "train_batch_size": 4,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": 0.5,
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False},
                              "offload_param": {"device": "cpu", "pin_memory": False}},
        "bf16": {"enabled": True},
        "fp16": {"enabled": False, "loss_scale": 0, "initial_scale_power": 16},
        "wall_clock_breakdown": False,
        "zero_force_ds_cpu_optimizer": False,
    }


def test_without_offload_deepspeed_keeps_its_default_optimizer_check_and_no_clipping_is_zero():
    config = derive_deepspeed_config(zero_stage=1, offload_optimizer=False, offload_params=False,
                                     mixed_precision="no", grad_clip=None, world_size=1)
    assert "zero_force_ds_cpu_optimizer" not in config
    assert config["zero_optimization"] == {"stage": 1}
    assert config["gradient_clipping"] == 0.0
    assert (config["bf16"]["enabled"], config["fp16"]["enabled"]) == (False, False)


def test_user_config_merges_key_by_key_and_auto_keeps_rltk_value():
    merged = merge_deepspeed_config(
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}, "bf16": {"enabled": True},
         "gradient_clipping": 1.0},
        {"zero_optimization": {"reduce_bucket_size": 1000, "offload_optimizer": {"pin_memory": True}},
         "bf16": {"enabled": "auto"}, "gradient_clipping": "auto", "steps_per_print": 7},
    )
    assert merged == {
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000,
                              "offload_optimizer": {"device": "cpu", "pin_memory": True}},
        "bf16": {"enabled": True}, "gradient_clipping": 1.0, "steps_per_print": 7,
    }


def _leaves(tree: dict, prefix: tuple = ()) -> dict[tuple, object]:
    """``{key path: value}`` of every non-dict value; an empty dict has no leaves (merging it changes nothing)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_leaves(value, prefix + (key,)))
        else:
            out[prefix + (key,)] = value
    return out


_keys = st.sampled_from(["zero_optimization", "stage", "bf16", "enabled", "reduce_bucket_size", "x", "y"])
_trees = st.recursive(st.one_of(st.integers(-3, 3), st.booleans(), st.text("ab", max_size=2)),
                      lambda children: st.dictionaries(_keys, children, max_size=3), max_leaves=8)


@settings(max_examples=200, deadline=None)
@given(derived=st.dictionaries(_keys, _trees, max_size=4), user=st.dictionaries(_keys, _trees, max_size=4))
def test_merge_keeps_every_user_leaf_and_every_derived_leaf_the_user_did_not_touch(derived, user):
    merged = merge_deepspeed_config(derived, user)
    merged_leaves, user_leaves = _leaves(merged), _leaves(user)
    for path, value in user_leaves.items():
        assert merged_leaves[path] == value
    for path, value in _leaves(derived).items():
        # The merge descends only where both sides hold a dict: a derived leaf is replaced when the user
        # sets anything at its path, or a non-dict at a section above it.
        node, overridden = user, False
        for depth, key in enumerate(path):
            if not isinstance(node, dict) or key not in node:
                break
            node = node[key]
            if depth == len(path) - 1 or not isinstance(node, dict):
                overridden = True
                break
        if not overridden:
            assert merged_leaves[path] == value


@pytest.mark.parametrize("user, message", [
    ({"optimizer": {"type": "AdamW"}}, r"'optimizer' is not allowed: rltk passes its own torch AdamW"),
    ({"scheduler": {"type": "WarmupLR"}}, r"'scheduler' is not allowed: rltk passes its own LambdaLR"),
    ({"gradient_accumulation_steps": 4}, r"'gradient_accumulation_steps'=4 is not supported: rltk accumulates"),
    ({"managed_gradient_accumulation": True}, r"'managed_gradient_accumulation'=True is not supported"),
    ({"zero_optimization": {"sub_group_size": "auto"}},
     r"'zero_optimization.sub_group_size' is \"auto\" but rltk derives no value for it"),
])
def test_config_keys_rltk_owns_are_refused_with_the_reason(user, message):
    with pytest.raises(ValueError, match=message):
        resolve(user_config=user)


def test_accumulation_keys_equal_to_rltk_values_are_accepted():
    config = resolve(user_config={"gradient_accumulation_steps": 1, "managed_gradient_accumulation": False})
    assert config["gradient_accumulation_steps"] == 1


@pytest.mark.parametrize("overrides, error, message", [
    (dict(user_config={"zero_optimization": {"stage": 0}}), ValueError,
     r"'zero_optimization.stage'=0 is invalid; valid: 1, 2, 3 \(for plain data parallelism use "
     r"training_strategy=accelerate\)"),
    (dict(offload_params=True), ValueError, r"offload_params=True .* needs zero_stage=3, got zero_stage=2"),
    (dict(mixed_precision="bf16", user_config={"fp16": {"enabled": True}}), ValueError,
     r"enables both 'bf16.enabled' and 'fp16.enabled'"),
    (dict(mixed_precision="fp16"), ValueError, r"mixed_precision='fp16' needs a CUDA device"),
    (dict(user_config={"train_batch_size": 3}), ValueError,
     r"'train_batch_size'=3 must equal train_micro_batch_size_per_gpu x gradient_accumulation_steps x world "
     r"size = 1 x 1 x 2 = 2"),
    (dict(user_config={"train_micro_batch_size_per_gpu": 0}), ValueError,
     r"'train_micro_batch_size_per_gpu'=0 must be an integer >= 1"),
])
def test_inconsistent_settings_are_errors_naming_the_key(overrides, error, message):
    with pytest.raises(error, match=message):
        resolve(**overrides)


def test_train_batch_size_follows_the_micro_batch_size_and_world_size():
    assert resolve(user_config={"train_micro_batch_size_per_gpu": 4}, world_size=3)["train_batch_size"] == 12
    assert resolve(user_config={"train_batch_size": "auto"}, world_size=3)["train_batch_size"] == 3
    assert resolve(user_config={"train_batch_size": 6, "train_micro_batch_size_per_gpu": 3})["train_batch_size"] == 6


def test_raw_config_is_read_from_a_json_file_a_dict_or_an_omegaconf_node(tmp_path):
    from omegaconf import OmegaConf

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    assert read_deepspeed_config(path) == {"zero_optimization": {"stage": 3}}
    assert read_deepspeed_config(str(path)) == {"zero_optimization": {"stage": 3}}
    original = {"bf16": {"enabled": True}}
    copied = read_deepspeed_config(original)
    copied["bf16"]["enabled"] = False
    assert original == {"bf16": {"enabled": True}}  # the caller's dict is never modified
    assert read_deepspeed_config(OmegaConf.create({"a": {"b": "${c}"}, "c": 2})) == {"a": {"b": 2}, "c": 2}
    assert read_deepspeed_config(None) == {}


def test_bad_raw_config_files_are_errors_naming_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config='.*missing.json' is not a file"):
        read_deepspeed_config(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{'stage': 3}")
    with pytest.raises(ValueError, match=r"config file '.*bad.json' is not valid JSON"):
        read_deepspeed_config(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"must hold a JSON object, got list"):
        read_deepspeed_config(tmp_path / "list.json")
    with pytest.raises(TypeError, match=r"config=3 must be a path to a DeepSpeed JSON file, a dict, or None"):
        read_deepspeed_config(3)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(zero_stage=0), ValueError, r"zero_stage=0 is invalid; valid: 1 \(optimizer state\), 2 \(\+ gradients\)"),
    (dict(zero_stage=True), ValueError, r"zero_stage=True is invalid"),
    (dict(offload_optimizer="yes"), TypeError, r"offload_optimizer='yes' must be True or False"),
    (dict(mixed_precision="fp8"), ValueError, r"unknown mixed_precision 'fp8'"),
    (dict(mixed_precision="fp16"), ValueError, r"mixed_precision='fp16' needs a CUDA device"),
    (dict(seed="1"), TypeError, r"seed='1' must be an integer or None"),
])
def test_bad_constructor_arguments_fail_before_any_process_group_starts(kwargs, error, message):
    initialized_before = torch.distributed.is_initialized()
    with pytest.raises(error, match=message):
        DeepSpeedStrategy(**kwargs)
    assert torch.distributed.is_initialized() == initialized_before


def test_strip_local_rank_argument_removes_both_spellings_and_keeps_the_value(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert strip_local_rank_argument(["grpo", "--local_rank=3", "lr=1e-5"]) == ["grpo", "lr=1e-5"]
    assert os.environ["LOCAL_RANK"] == "3"
    monkeypatch.delenv("LOCAL_RANK")
    assert strip_local_rank_argument(["--local_rank", "1", "x=2"]) == ["x=2"]
    assert os.environ["LOCAL_RANK"] == "1"
    assert strip_local_rank_argument(["--local-rank=5"]) == []
    assert os.environ["LOCAL_RANK"] == "1"  # an exported LOCAL_RANK wins over the argument
    assert strip_local_rank_argument(["--local_rankish", "a"]) == ["--local_rankish", "a"]


def test_a_process_without_launcher_gets_a_one_process_world_on_a_free_port(monkeypatch):
    for name in RENDEZVOUS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    ensure_single_process_environment()
    assert [os.environ[name] for name in RENDEZVOUS_VARIABLES[:4]] == ["0", "1", "0", "127.0.0.1"]
    assert 0 < int(os.environ["MASTER_PORT"]) < 65536


def test_an_explicit_one_process_world_gets_the_missing_rendezvous_filled_in(monkeypatch):
    for name in RENDEZVOUS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    ensure_single_process_environment()
    assert (os.environ["LOCAL_RANK"], os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("0", "127.0.0.1",
                                                                                                 "29999")


def test_a_partial_multi_process_environment_names_what_is_missing(monkeypatch):
    for name in RENDEZVOUS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"RANK, WORLD_SIZE are set but LOCAL_RANK, MASTER_ADDR, MASTER_PORT "
                                           r"are not\. Start the script with a launcher"):
        ensure_single_process_environment()


def test_checkpoint_meta_errors_say_what_the_folder_is(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"has no strategy.json: it is not a checkpoint written by "
                                                r"DeepSpeedStrategy.save\(\)"):
        read_checkpoint_meta(tmp_path)
    (tmp_path / "strategy.json").write_text(json.dumps({"format": "rltk-accelerate-v1",
                                                         "strategy": "AccelerateStrategy"}))
    with pytest.raises(ValueError, match=r"has format 'rltk-accelerate-v1' \(strategy 'AccelerateStrategy'\); "
                                         r"DeepSpeedStrategy reads 'rltk-deepspeed-v1'"):
        read_checkpoint_meta(tmp_path)


# --------------------------------------------------------------------------
# ZeRO in real processes
# --------------------------------------------------------------------------


def reference_run(batches, *, stop_after: int | None = None) -> dict:
    """Plain torch: AdamW + LambdaLR + clip_grad_norm_ over the whole global batch, two micro-batches."""
    settings = OptimizerSettings(**shared.SETUP)
    model = shared.tiny_qwen2(seed=0)
    optimizer = build_adamw(model, settings)
    scheduler = build_lr_scheduler(optimizer, settings)
    losses, grad_norms = [], []
    for batch in batches[:stop_after]:
        ids, mask = batch["input_ids"], batch["attention_mask"]
        target_mask = mask[:, 1:].float()
        tokens = target_mask.sum()
        step_loss = 0.0
        for part in (slice(0, shared.GLOBAL_BATCH // 2), slice(shared.GLOBAL_BATCH // 2, shared.GLOBAL_BATCH)):
            logits = model(input_ids=ids[part], attention_mask=mask[part]).logits
            token_loss = F.cross_entropy(logits[:, :-1].transpose(1, 2).float(), ids[part, 1:], reduction="none")
            loss = (token_loss * target_mask[part]).sum() / tokens
            loss.backward()
            step_loss += loss.item()
        grad_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), settings.clip_norm)))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(step_loss)
    return {"weights": {k: v.detach().clone() for k, v in model.state_dict().items()}, "losses": losses,
            "grad_norms": grad_norms}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _launch(command: list[str], *, single_process: bool = False) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RLTK_DISABLE_PLUGIN_AUTOLOAD": "1"}
    # DeepSpeed compiles a shared-memory op on first use (~1-2 min); a stable folder lets CI reuse it.
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "rltk" / "torch_extensions"))
    if single_process:  # exercise the no-launcher defaults
        for name in RENDEZVOUS_VARIABLES:
            env.pop(name, None)
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=scaled(900))
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(command[-4:])} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                    f"{proc.stderr[-8000:]}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict]:
    out_dir = tmp_path_factory.mktemp("deepspeed")
    worker = str(HERE / "ds_worker.py")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", worker,
                str(out_dir)]
    _launch(torchrun + ["zero2", "zero3", "zero3_tied", "zero3_crash"])
    # The new processes come from DeepSpeed's own launcher, which appends --local_rank=N to the arguments.
    _launch([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
             str(free_local_port()), worker, str(out_dir), "zero3_resume"])
    _launch([sys.executable, worker, str(out_dir), "zero1", "zero2_offload", "zero3_offload", "zero2_bf16",
             "zero2_nonfinite", "zero2_resume", "zero3_resume"], single_process=True)
    results = {path.stem: torch.load(path, weights_only=True) for path in out_dir.glob("*.pt")}
    return out_dir, results


@pytest.fixture(scope="module")
def reference():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # module fixtures start before conftest's per-test one-thread fixture
    try:
        return reference_run(shared.global_batches())
    finally:
        torch.set_num_threads(previous)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("phase", ["zero2", "zero3"])
def test_two_ranks_hold_identical_parameters_and_losses(runs, phase):
    _, results = runs
    rank0, rank1 = results[f"{phase}_rank0_of2"], results[f"{phase}_rank1_of2"]
    assert max_abs_diff(rank0["weights"], rank1["weights"]) == 0.0
    assert rank0["losses"] == rank1["losses"]
    assert rank0["grad_norms"] == rank1["grad_norms"]


@pytest.mark.distributed
@pytest.mark.slow
def test_zero3_really_partitions_the_parameters(runs):
    _, results = runs
    assert results["zero2_rank0_of2"]["partitioned_fraction"] == 1.0
    for rank in (0, 1):  # each rank holds half of every tensor (plus padding of odd sizes)
        assert 0.5 <= results[f"zero3_rank{rank}_of2"]["partitioned_fraction"] < 0.51


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("phase", ["zero2_rank0_of2", "zero3_rank0_of2", "zero1_rank0_of1",
                                   "zero2_offload_rank0_of1", "zero3_offload_rank0_of1"])
def test_zero_matches_plain_adamw_on_the_global_batch(runs, reference, phase):
    """Two processes (each its half) or one process, all equal one plain AdamW over the global batch.

    ZeRO sums and updates flattened fp32 buffers in another order than per-tensor
    torch ops. Grad norms and losses agree to 1e-6; the weights, after Adam has
    divided each element's gradient by its own running scale, differed by ~2.5e-7
    at AVX-512 and by 1.07e-6 under ATEN_CPU_CAPABILITY=avx2 (zero3, and the
    checkpoint test below), so they are held to 1e-5, ~10x what rounding gave; a
    wrong gradient shows first in the grad norms and losses, held to 1e-6. Adam and clipping ignore a constant gradient factor,
    so the pre-clipping gradient norm is what catches a wrong world_size scaling in
    backward().
    """
    _, results = runs
    run = results[phase]
    assert run["optimizer_steps"] == shared.TOTAL_STEPS and run["skipped_steps"] == 0
    assert run["grad_norms"] == pytest.approx(reference["grad_norms"], rel=1e-6)
    assert run["losses"] == pytest.approx(reference["losses"], abs=1e-6)
    assert max_abs_diff(run["weights"], reference["weights"]) < 1e-5


@pytest.mark.distributed
@pytest.mark.slow
def test_killed_zero3_run_resumes_in_new_processes_bit_for_bit(runs):
    _, results = runs
    straight = results["zero3_rank0_of2"]
    for rank in (0, 1):
        resumed = results[f"zero3_resume_rank{rank}_of2"]
        assert resumed["resumed_at"] == shared.CHECKPOINT_STEP
        assert resumed["losses"] == straight["losses"][shared.CHECKPOINT_STEP:]
        assert resumed["grad_norms"] == straight["grad_norms"][shared.CHECKPOINT_STEP:]
        assert max_abs_diff(resumed["weights"], straight["weights"]) == 0.0


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_two_process_checkpoint_resumes_in_one_process(runs, stage):
    """Through DeepSpeed's universal checkpoint; equal to the uninterrupted run up to summation order."""
    out_dir, results = runs
    straight = results[f"zero{stage}_rank0_of2"]
    resumed = results[f"zero{stage}_resume_rank0_of1"]
    assert resumed["resumed_at"] == shared.CHECKPOINT_STEP
    assert resumed["losses"] == pytest.approx(straight["losses"][shared.CHECKPOINT_STEP:], abs=1e-6)
    assert resumed["grad_norms"] == pytest.approx(straight["grad_norms"][shared.CHECKPOINT_STEP:], rel=1e-6)
    # Biases and norms sit in the no-decay group, the group DeepSpeed's ZeRO-3 universal loader gets wrong
    # (shared Adam step counter, group 0's weight decay) unless the strategy repairs it.
    assert max_abs_diff(resumed["weights"], straight["weights"]) < 1e-6
    checkpoint = out_dir / f"ckpt_zero{stage}" / f"step_{shared.CHECKPOINT_STEP:06d}"
    assert (checkpoint / "deepspeed_universal" / "latest_universal").read_text() == "state"


def test_checkpoints_do_not_cross_between_zero_1_2_and_zero_3(tmp_path):
    check_resumable({"zero_stage": 1}, 2, tmp_path)
    check_resumable({"zero_stage": 3}, 3, tmp_path)
    with pytest.raises(ValueError, match=r"written under ZeRO-2 and cannot resume under ZeRO-3: .* Resume with "
                                         r"zero_stage=2 \(or the other of 1 and 2\), or start a new run from the "
                                         r"full weights in '.*model'"):
        check_resumable({"zero_stage": 2}, 3, tmp_path)
    with pytest.raises(ValueError, match=r"written under ZeRO-3 and cannot resume under ZeRO-1: .* Resume with "
                                         r"zero_stage=3, or start"):
        check_resumable({"zero_stage": 3}, 1, tmp_path)


@pytest.mark.distributed
@pytest.mark.slow
def test_checkpoint_holds_deepspeed_shards_and_a_loadable_hf_folder(runs):
    import transformers

    out_dir, results = runs
    checkpoint = out_dir / "ckpt_zero3" / f"step_{shared.CHECKPOINT_STEP:06d}"
    assert sorted(p.name for p in (checkpoint / "deepspeed" / "state").glob("*optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    meta = json.loads((checkpoint / "strategy.json").read_text())
    assert (meta["format"], meta["zero_stage"], meta["world_size"], meta["optimizer_steps"]) == (
        "rltk-deepspeed-v1", 3, 2, shared.CHECKPOINT_STEP)
    assert [group["weight_decay"] for group in meta["param_groups"]] == [shared.SETUP["weight_decay"], 0.0]
    model = transformers.Qwen2ForCausalLM.from_pretrained(checkpoint / "model", dtype=torch.float32)
    at_checkpoint = results["zero3_crash_rank0_of2"]["weights"]
    assert max_abs_diff(model.state_dict(), at_checkpoint) == 0.0
    reference_at_checkpoint = reference_run(shared.global_batches(), stop_after=shared.CHECKPOINT_STEP)
    # another summation order than plain AdamW's: 1.07e-6 under AVX2 (see the test above)
    assert max_abs_diff(at_checkpoint, reference_at_checkpoint["weights"]) < 1e-5


@pytest.mark.distributed
@pytest.mark.slow
def test_export_copies_the_full_weights_folder(runs, tmp_path):
    from safetensors.torch import load_file

    out_dir, results = runs
    checkpoint = out_dir / "ckpt_zero3" / f"step_{shared.CHECKPOINT_STEP:06d}"
    exported = export_model_folder(checkpoint, tmp_path / "exported")
    assert max_abs_diff(load_file(str(exported / "model.safetensors")),
                        results["zero3_crash_rank0_of2"]["weights"]) == 0.0


@pytest.mark.distributed
@pytest.mark.slow
def test_export_consolidates_a_checkpoint_saved_without_full_weights(runs, tmp_path):
    """ZeRO-2 saved with save_full_weights=False: only shards and the config; zero_to_fp32 rebuilds the weights."""
    import transformers

    out_dir, _ = runs
    checkpoint = out_dir / "ckpt_zero2" / f"step_{shared.CHECKPOINT_STEP:06d}"
    assert not (checkpoint / "model").exists()
    assert sorted(p.name for p in (checkpoint / "model_config").iterdir()) == ["config.json",
                                                                               "generation_config.json"]
    exported = export_model_folder(checkpoint, tmp_path / "exported")
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    at_checkpoint = reference_run(shared.global_batches(), stop_after=shared.CHECKPOINT_STEP)["weights"]
    assert max_abs_diff(model.state_dict(), at_checkpoint) < 1e-6


@pytest.mark.distributed
@pytest.mark.slow
def test_tied_weights_stay_tied_through_gathering_and_saving(runs):
    import transformers

    out_dir, results = runs
    rank0, rank1 = results["zero3_tied_rank0_of2"]["weights"], results["zero3_tied_rank1_of2"]["weights"]
    assert max_abs_diff(rank0, rank1) == 0.0
    assert torch.equal(rank0["lm_head.weight"], rank0["model.embed_tokens.weight"])
    model = transformers.Qwen2ForCausalLM.from_pretrained(out_dir / "ckpt_tied" / "model", dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert max_abs_diff(model.state_dict(), rank0) == 0.0


@pytest.mark.distributed
@pytest.mark.slow
def test_bf16_trains_bf16_weights_rounded_from_fp32_master_weights(runs, reference):
    _, results = runs
    run = results["zero2_bf16_rank0_of1"]
    assert {t.dtype for t in run["weights"].values()} == {torch.bfloat16}
    assert {t.dtype for t in run["master_weights"].values()} == {torch.float32}
    # The model's bf16 weights are exactly the optimizer's fp32 master weights rounded.
    for name, master in run["master_weights"].items():
        assert torch.equal(master.to(torch.bfloat16), run["weights"][name]), name
    # bf16 forward passes: losses within bf16 resolution of the fp32 run, and the 5 updates (Adam moves
    # every weight by ~lr whatever the gradient's size, so bf16 noise changes them) follow the fp32
    # run's: measured 4.7% relative difference of the total update, bounded here by 10%.
    assert run["losses"] == pytest.approx(reference["losses"], abs=5e-3)
    initial = shared.tiny_qwen2(seed=0).state_dict()
    update_error = sum((run["master_weights"][k] - reference["weights"][k]).square().sum() for k in initial)
    update_size = sum((initial[k] - reference["weights"][k]).square().sum() for k in initial)
    assert (update_error / update_size).sqrt() < 0.1


@pytest.mark.distributed
@pytest.mark.slow
def test_a_nan_loss_skips_the_step_and_leaves_no_trace(runs, reference):
    _, results = runs
    run = results["zero2_nonfinite_rank0_of1"]
    assert run["metrics"] == {"grad_norm": float("inf"), "lr": run["lr_before"], "skipped": 1.0}
    assert max_abs_diff(run["before"], run["after"]) == 0.0
    assert run["lr_after_skip"] == run["lr_before"]  # the schedule did not advance
    assert (run["skipped_steps"], run["optimizer_steps"]) == (1, 2)
    # The NaN gradients were dropped: the next step is the reference's second step exactly.
    assert run["next_losses"] == pytest.approx(reference["losses"][1:2], abs=1e-6)


# --------------------------------------------------------------------------
# LoRA (model.lora) under ZeRO-2 and ZeRO-3: the adapter trains as in one process
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory) -> dict:
    out_dir = tmp_path_factory.mktemp("deepspeed_lora")
    _launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
             str(HERE / "ds_worker.py"), str(out_dir), "zero2_lora", "zero3_lora", "zero3_lora_ckpt"])
    return {path.stem: torch.load(path, weights_only=True) for path in out_dir.glob("*.pt")}


@pytest.fixture(scope="module")
def lora_one_process():
    """The same LoRA training in one process with the default strategy (accelerate, plain AdamW)."""
    from rltk.strategies.accelerate_strategy import AccelerateStrategy

    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # module fixtures start before conftest's per-test one-thread fixture
    try:
        strategy = AccelerateStrategy(cpu=True)
        strategy.setup(shared.tiny_lora_qwen2(seed=0), **shared.SETUP)
        initial = {k: v.detach().clone() for k, v in strategy.unwrap().state_dict().items()}
        losses, grad_norms = shared.train_steps(strategy, shared.global_batches(), micro_batches=2)
        return {"weights": strategy.full_state_dict(), "losses": losses, "grad_norms": grad_norms,
                "initial": initial}
    finally:
        torch.set_num_threads(previous)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("phase", ["zero2_lora", "zero3_lora", "zero3_lora_ckpt"])
def test_lora_under_zero_with_two_processes_matches_one_process(lora_runs, lora_one_process, phase):
    """ZeRO-2 and ZeRO-3, and ZeRO-3 with gradient checkpointing (each layer's recompute in the backward
    pass gathers its partitioned weights again), train the adapter as one plain process does."""
    rank0, rank1 = lora_runs[f"{phase}_rank0_of2"], lora_runs[f"{phase}_rank1_of2"]
    assert max_abs_diff(rank0["weights"], rank1["weights"]) == 0.0
    assert rank0["losses"] == rank1["losses"]
    if phase.endswith("_ckpt"):  # the tiny model's one decoder layer really recomputes
        assert rank0["checkpointed_layers"] == 1
    if phase.startswith("zero3"):  # the frozen base is partitioned too, not only the adapter
        assert 0.5 <= rank0["partitioned_fraction"] < 0.51
    assert rank0["optimizer_steps"] == shared.TOTAL_STEPS and rank0["skipped_steps"] == 0
    reference = lora_one_process
    adapter = {k for k in reference["weights"] if "lora_" in k}
    assert rank0["weights"].keys() == reference["weights"].keys() and len(adapter) == 2 * 7
    for name, initial in reference["initial"].items():  # the adapter trained and nothing else moved
        assert torch.equal(rank0["weights"][name], initial) == (name not in adapter), name
    # The two processes sum each half of the batch and then the halves; one process sums micro-batches
    # in another order. In fp32 that moves the grad norm by rounding alone: measured 0.8e-6 relative
    # (AVX-512 and default kernels, this test's 5 steps) and 1.1e-7 (AVX2), 1.28e-6 on another AVX-512
    # machine. 1e-5 is ~80 ulps; a rank's half of the batch missing changes the norm by tens of percent.
    assert rank0["grad_norms"] == pytest.approx(reference["grad_norms"], rel=1e-5)
    assert rank0["losses"] == pytest.approx(reference["losses"], abs=1e-6)
    # Adam turns summation-order rounding of near-zero gradient elements (B starts at zero) into
    # update differences that are a fraction of lr (1e-3): see test_distributed's LoRA test. A rank's
    # half of the batch missing from the gradient moves the adapter by ~6e-3.
    assert max_abs_diff(rank0["weights"], reference["weights"]) < 1e-5
