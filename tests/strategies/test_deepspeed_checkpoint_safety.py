"""Issue 12, item 1 under DeepSpeed: a pickle planted in any file of a ZeRO checkpoint never runs.

One process (ds_safety_worker.py) saves a ZeRO-2 and a ZeRO-3 checkpoint and
loads copies with a payload planted in each file in turn, then feeds planted
shards to DeepSpeed's own readers past rltk's file checks. A payload that ran
would create ``MARKER``; the control (DeepSpeed reading a planted shard without
rltk's guard) shows that it would.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.isolated import run_isolated
from tests.waits import scaled

HERE = Path(__file__).parent
ZERO2_FILES = ["deepspeed/latest", "deepspeed/state/mp_rank_00_model_states.pt",
               "deepspeed/state/zero_pp_rank_0_mp_rank_00_optim_states.pt", "deepspeed/zero_to_fp32.py",
               "deepspeed/zero_to_torch.py", "manifest.json", "model/config.json", "model/generation_config.json",
               "model/model.safetensors", "rng/rank_00000.pt", "state.json", "strategy.json"]
# ZeRO-3 keeps one model-state file per rank.
ZERO3_FILES = [f.replace("mp_rank_00_model_states", "zero_pp_rank_0_mp_rank_00_model_states") for f in ZERO2_FILES]
GUARDED_READERS = ("engine.load_checkpoint", "zero_to_fp32", "ds_to_universal")
CHECKED_ENTRY_POINTS = ("strategy.load", "convert_to_universal", "export_model_folder")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> tuple[Path, dict]:
    out_dir = tmp_path_factory.mktemp("ds_safety")
    run_isolated([sys.executable, str(HERE / "ds_safety_worker.py"), str(out_dir)], timeout=scaled(900),
                 extra_env={"RLTK_DISABLE_PLUGIN_AUTOLOAD": "1"})
    return out_dir, json.loads((out_dir / "results.json").read_text())


@pytest.mark.slow
def test_no_payload_ever_ran_and_the_control_shows_one_would_have(results):
    out_dir, found = results
    assert not (out_dir / "MARKER").exists()
    for stage in ("zero2", "zero3"):
        assert (out_dir / f"CONTROL_MARKER_{stage}").exists(), f"{stage}: unguarded DeepSpeed did not run the payload"


@pytest.mark.slow
@pytest.mark.parametrize("stage, files", [("zero2", ZERO2_FILES), ("zero3", ZERO3_FILES)])
def test_a_payload_in_each_file_is_refused_naming_the_file(results, stage, files):
    _, found = results
    run = found[stage]
    assert run["files"] == files  # every file of the checkpoint was planted in turn
    for relative in files:
        error, message = run["planted"][relative]
        if relative.endswith(".pt"):
            assert error == "UnsafeCheckpointError", (relative, error, message)
            assert f"step_000001/{relative}': it asks the unpickler for posix.system" in message
            assert "could run arbitrary code" in message
        else:  # JSON, safetensors, DeepSpeed's text and scripts: not unpickled; their bytes no longer match
            assert error == "DamagedCheckpointError", (relative, error, message)
            assert f"is damaged: {relative} (" in message
    assert run["resumed"] == ["ok", ""]  # the intact checkpoint still loads afterwards


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_deepspeed_readers_asking_for_full_unpickling_are_refused_past_rltks_checks(results, stage):
    _, found = results
    guard = found[stage]["guard"]
    files = {"zero2": ZERO2_FILES, "zero3": ZERO3_FILES}[stage]
    assert sorted(guard) == sorted(Path(f).name for f in files if f.startswith("deepspeed/state/"))
    for shard, readers in guard.items():
        for reader in GUARDED_READERS:  # torch.load(weights_only=False) inside weights_only_everywhere
            error, message = readers[reader]
            assert error == "UnpicklingError" and "posix.system" in message, (shard, reader, error, message)
        for entry in CHECKED_ENTRY_POINTS:  # rltk's entry points name the file first
            error, message = readers[entry]
            assert error == "UnsafeCheckpointError" and f"deepspeed/state/{shard}'" in message, (shard, entry, error)


def test_only_deepspeeds_plain_records_are_allow_listed_and_rltks_own_formats_need_none():
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    from rltk.checkpoint import strategy_checkpoint_globals
    from rltk.strategies.accelerate_strategy import AccelerateStrategy
    from rltk.strategies.deepspeed_strategy import DeepSpeedStrategy
    from rltk.training.updates.ppo import PolicyAndCritic

    assert DeepSpeedStrategy.checkpoint_globals() == [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]
    assert AccelerateStrategy.checkpoint_globals() == []
    assert strategy_checkpoint_globals(None) == [] and strategy_checkpoint_globals(object()) == []
    # One checkpoint for policy and critic allows what either strategy's files hold.
    both = PolicyAndCritic(AccelerateStrategy, DeepSpeedStrategy)
    assert strategy_checkpoint_globals(both) == DeepSpeedStrategy.checkpoint_globals()
