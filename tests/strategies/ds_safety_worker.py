"""DeepSpeed worker for test_deepspeed_checkpoint_safety.py: plants a pickle payload in every checkpoint file.

``python ds_safety_worker.py OUT_DIR`` (one process, no launcher). For ZeRO-2
and ZeRO-3 it trains the tiny Qwen2 of distributed_worker.py one step, saves a
checkpoint through CheckpointManager, and then, for every file of that
checkpoint in turn, loads a copy with a payload planted in that file. It also
bypasses rltk's file checks to see the last line of defence: DeepSpeed's own
readers (``engine.load_checkpoint``, ``zero_to_fp32``, ``ds_to_universal``) under
:func:`rltk.serialization.weights_only_everywhere`. A payload, if it ever ran,
would create ``OUT_DIR/MARKER``; a control reads one planted shard with DeepSpeed
unguarded, which creates ``OUT_DIR/CONTROL_MARKER_zero<stage>``. Writes
``OUT_DIR/results.json``: ``{stage: {"files": [...], "planted": {file: [error
type, message]}, "guard": {shard: {reader: [...]}}, "control": [...], "resumed": [...]}}``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import distributed_worker as shared  # noqa: E402  (the tiny model and batches every strategy test shares)

ZERO3_CONFIG = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}


class Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch '{self.marker}'",)


def outcome(call) -> list[str]:
    """``[error type, message]`` of ``call()``, or ``["ok", ""]``."""
    try:
        call()
    except Exception as error:  # the test asserts on the type and message
        return [type(error).__name__, str(error)]
    return ["ok", ""]


def planted_copy(checkpoint: Path, work: Path, relative: str, marker: Path) -> Path:
    target = work / checkpoint.name
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(checkpoint, target)
    torch.save({"state": Payload(marker), "weights": torch.zeros(2)}, target / relative)
    return target


def run_stage(stage: int, out_dir: Path, marker: Path) -> tuple[dict, object]:
    from rltk.checkpoint import CheckpointManager
    from rltk.serialization import weights_only_everywhere
    from rltk.strategies.deepspeed_checkpoint import (
        DEEPSPEED_SUBDIR,
        convert_to_universal,
        deepspeed_checkpoint_globals,
        export_model_folder,
    )
    from rltk.strategies.deepspeed_strategy import DeepSpeedStrategy

    strategy = DeepSpeedStrategy(zero_stage=stage, **({"config": ZERO3_CONFIG} if stage == 3 else {}))
    strategy.setup(shared.tiny_qwen2(seed=0), **shared.SETUP)
    shared.train_steps(strategy, shared.global_batches()[:1], micro_batches=2)
    root = out_dir / f"zero{stage}"
    manager = CheckpointManager(root)
    checkpoint = manager.save(1, strategy, {"step": 1})
    files = sorted(p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*") if p.is_file())
    work = out_dir / f"work{stage}"

    # Every file in turn, through what a resumed run calls (verify, then strategy.load, then RNG).
    planted = {}
    for relative in files:
        copy = planted_copy(checkpoint, work, relative, marker)
        planted[relative] = outcome(lambda: CheckpointManager(copy.parent).load(copy, strategy))

    # Past rltk's file checks: DeepSpeed's readers themselves, inside the guard.
    allowed = deepspeed_checkpoint_globals()
    state_dir = checkpoint / DEEPSPEED_SUBDIR / "state"
    guard = {}
    for shard in sorted(p.name for p in state_dir.glob("*.pt")):
        copy = planted_copy(checkpoint, work, f"{DEEPSPEED_SUBDIR}/state/{shard}", marker)

        def engine_load():
            with weights_only_everywhere(allowed):
                strategy._engine.load_checkpoint(str(copy / DEEPSPEED_SUBDIR), tag="state")

        def zero_to_fp32():
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            with weights_only_everywhere(allowed):
                get_fp32_state_dict_from_zero_checkpoint(str(copy / DEEPSPEED_SUBDIR), tag="state")

        def universal_without_check():
            import argparse

            from deepspeed.checkpoint import ds_to_universal

            args = argparse.Namespace(
                input_folder=str(copy / DEEPSPEED_SUBDIR / "state"), output_folder=str(work / "universal"),
                num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                inject_missing_state=False)
            with weights_only_everywhere(allowed):
                ds_to_universal.main(args)

        def export_consolidating():
            shutil.rmtree(copy / "model")  # as saved with save_full_weights=False: zero_to_fp32 consolidates
            export_model_folder(copy, work / "exported")

        guard[shard] = {
            "strategy.load": outcome(lambda: strategy.load(copy)),
            "engine.load_checkpoint": outcome(engine_load),
            "zero_to_fp32": outcome(zero_to_fp32),
            "ds_to_universal": outcome(universal_without_check),
            "convert_to_universal": outcome(
                lambda: convert_to_universal(copy / DEEPSPEED_SUBDIR, work / "universal2")),
            "export_model_folder": outcome(export_consolidating),
        }
    # Control: the same planted file, read by DeepSpeed without the guard, does run its command (so the
    # missing marker above means refused, not a payload that could not have run).
    first_shard = sorted(p.name for p in state_dir.glob("*.pt"))[0]
    control_marker = out_dir / f"CONTROL_MARKER_zero{stage}"
    copy = planted_copy(checkpoint, work, f"{DEEPSPEED_SUBDIR}/state/{first_shard}", control_marker)
    control = outcome(lambda: strategy._engine.load_checkpoint(str(copy / DEEPSPEED_SUBDIR), tag="state"))
    # The intact checkpoint still loads after all that (nothing above left the engine half-loaded).
    resumed = outcome(lambda: manager.load(checkpoint, strategy))
    shutil.rmtree(work, ignore_errors=True)
    return {"files": files, "planted": planted, "guard": guard, "control": control, "resumed": resumed}, strategy


def main() -> None:
    out_dir = Path(sys.argv[1])
    marker = out_dir / "MARKER"
    results, strategies = {}, []
    try:
        for stage in (2, 3):
            results[f"zero{stage}"], strategy = run_stage(stage, out_dir, marker)
            strategies.append(strategy)
    except Exception:
        traceback.print_exc()
        raise
    finally:
        (out_dir / "results.json").write_text(json.dumps(results, indent=1))
        for strategy in reversed(strategies):  # the first one owns the process group: close it last
            strategy.close()


if __name__ == "__main__":
    main()
