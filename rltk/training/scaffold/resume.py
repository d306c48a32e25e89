"""Where a run resumes from, whether it may, and the weights that outlive a stage.

A run is found by its folder (``output_dir``, by default ``runs/<name>``).
With ``checkpoint.resume=auto`` a folder that already holds a run is resumed
only when the new config is compatible with the one saved there
(``config.yaml``): equal except for :data:`RESUME_SAFE_KEYS`. Otherwise the
run stops before writing anything, naming the differing keys and the two ways
out (``name=...`` for a new folder, ``checkpoint.resume=never`` to start over).
``checkpoint.resume=never`` starts over in the same folder: the previous run's
checkpoints, stage weights and outputs are deleted first (and the run says
so), so no stale checkpoint can later be resumed and no curve mixes two runs.

``auto`` resumes from the newest *intact* checkpoint
(:meth:`rltk.checkpoint.CheckpointManager.latest_intact`): a damaged newer one
(a truncated ``model.safetensors``, a cut-off ``state.json``) is moved aside
with a warning naming the damaged files. A file that asks the unpickler for
code stops the run instead (:class:`rltk.serialization.UnsafeCheckpointError`).
A resumed run first prunes checkpoints beyond ``checkpoint.keep_last`` that a
run killed between a save and its prune left behind.
"""

from __future__ import annotations

import itertools
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

import rltk
from rltk.checkpoint import (
    RNG_DIR,
    STATE_FILE,
    CheckpointManager,
    damage_summary,
    read_state_file,
    restore_rng_state,
    strategy_checkpoint_globals,
)
from rltk.config.saved import config_to_record
from rltk.config.schema import RunConfig
from rltk.errors import ConfigError
from rltk.io import give_default_mode
from rltk.models.folders import load_full_state_into, load_model_folder
from rltk.serialization import check_safetensors, torch_load
from rltk.strategies.base import MODEL_SUBDIR


def resume_point(ckpt: CheckpointManager, mode: str, *, allowed_globals=(), main_process: bool = True
                 ) -> dict[str, Any] | None:
    """The checkpoint a run continues from: ``{"path", "global_step", **saved state}`` or None.

    ``mode`` is ``checkpoint.resume``: ``auto`` (the newest intact checkpoint,
    if any; damaged newer ones are moved aside with a warning, by the main
    process only), ``never`` (start over), or a checkpoint folder, which must
    be intact. ``allowed_globals`` are the classes the run's strategy pickles
    into its checkpoints (:meth:`TrainingStrategy.checkpoint_globals`).

    Raises:
        UnsafeCheckpointError: the checkpoint holds a file that asks for code.
        DamagedCheckpointError: ``auto`` and every checkpoint is damaged.
        ConfigError: an explicit folder is no checkpoint or a damaged one.
    """
    if mode == "never":
        return None
    if mode == "auto":
        path = ckpt.latest_intact(allowed_globals=allowed_globals, main_process=main_process)
        if path is None:
            return None
    else:
        path = Path(mode)
        if not (path / STATE_FILE).is_file():
            raise ConfigError(
                f"checkpoint.resume='{mode}' is not a complete rltk checkpoint (no {STATE_FILE} in it). "
                f"Valid: auto, never, or a step_XXXXXX folder under <output_dir>/checkpoints"
            )
        damage = ckpt.verify(path, allowed_globals=allowed_globals)
        if damage:
            raise ConfigError(
                f"checkpoint.resume='{mode}' is a damaged checkpoint: {damage_summary(damage, path)}. Choose another "
                "step_XXXXXX folder, or checkpoint.resume=auto (the newest intact one)"
            )
    payload = read_state_file(path)
    return {"path": path, "global_step": payload["step"], **payload["state"]}


def checkpoint_globals_of(name: str) -> list[Any]:
    """The classes training strategy ``name`` pickles into its checkpoints (its ``checkpoint_globals()``)."""
    return strategy_checkpoint_globals(rltk.get_component("training_strategy", name))


def load_model_weights(checkpoint: str | Path, model: torch.nn.Module) -> None:
    """Copy only the model weights of a checkpoint into ``model`` (a new stage starts from them)."""
    folder = Path(checkpoint) / MODEL_SUBDIR
    load_full_state_into(model, load_model_folder(folder), folder)


def load_rng_state(checkpoint: str | Path, rank: int) -> bool:
    """Restore this rank's global RNG (python, numpy, torch) as ``checkpoint`` saved it; False when it holds none.

    A run resumed at a stage boundary starts the next stage from here, so its draws (sampling, a sampled
    evaluation) are those of the uninterrupted run, whatever the stages before drew.
    """
    rng_file = Path(checkpoint) / RNG_DIR / f"rank_{rank:05d}.pt"
    if not rng_file.is_file():
        return False
    restore_rng_state(torch_load(rng_file))
    return True


def save_weights_atomically(state_dict: dict[str, torch.Tensor], path: str | Path) -> None:
    """Write ``state_dict`` as safetensors through a temporary file and a rename."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A temporary name of this process's own: every rank of a run may write the same file at once
    # (the same bytes), and a shared name let one rank's rename take the file from under another's.
    temp = str(path.with_name(f".tmp-{uuid.uuid4().hex}-{path.name}"))
    try:
        # safetensors refuses tensors sharing storage (tied embeddings): store copies.
        save_file({k: v.detach().cpu().contiguous().clone() for k, v in state_dict.items()}, temp)
        give_default_mode([temp])
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def load_weights(path: str | Path, model: torch.nn.Module) -> None:
    """Load a file written by :func:`save_weights_atomically` into ``model``.

    A missing, truncated or foreign file raises
    :class:`rltk.serialization.DamagedCheckpointError` naming it.
    """
    from safetensors.torch import load_file

    check_safetensors(path)
    load_full_state_into(model, load_file(str(path), device="cpu"), path)


#: What a previous run leaves in its folder that a run starting over there must not inherit: checkpoints
#: (a later auto-resume would pick a stale one), the frozen reference weights, and outputs that would
#: otherwise mix two runs (metrics.jsonl is appended to) or describe the old one (summary, plot).
RUN_STATE = ("checkpoints", "stage_weights", "metrics.jsonl", "summary.json", "curves.png")

CONFIG_FILE = "config.yaml"

#: Keys a resumed run may change without changing what its checkpoint means. Anything else (model,
#: data, algorithm, seed, schedules, stages ...) makes it a different run: resuming would mix two
#: experiments in one folder or crash on mismatched shapes. Entries ending in "." cover a section.
RESUME_SAFE_KEYS = (
    "name", "output_dir",  # where the run lives: the folder is how it was found
    "device",  # where it runs; weights and optimizer state move with it
    # Extend or shorten the run. Schedules follow the new length from the resumed step on; a run
    # that already finished has nothing left to train.
    "trainer.total_steps",
    "trainer.eval_every", "trainer.eval_size", "rollout.eval_max_new_tokens",  # evaluation only
    # How a step is computed, not what: micro-batches are normalised by global counts, the log-prob
    # kernels compute the same numbers, gradient checkpointing trades memory for time.
    "trainer.micro_batch_size", "trainer.max_tokens_per_micro_batch", "trainer.pack_sequences",
    "model.logprob_impl", "model.logprob_chunk_size", "model.gradient_checkpointing",
    "checkpoint.",  # how often to save and how many to keep; `resume` is how this run was chosen
    "logging.",  # where metrics go
    "guard.",  # when a diverged run stops: loosen it and resume, and the run trains as it would have
    "buffer.queue_resume",  # given for the resume that replaces a lost experience queue
    "algorithm.rollout_correction.log_metrics",  # only logs the mismatch; the update is the same
    # How the policy is split over the processes, not what it computes: the accelerate strategy's checkpoints
    # hold whole tensors by name and regroup the optimizer state (rltk.strategies.regroup), so any split resumes.
    "strategy_args.fsdp", "strategy_args.tensor_parallel_size", "strategy_args.sequence_parallel_size",
)

_UNSET = "(unset)"


def _is_safe(key: str) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in RESUME_SAFE_KEYS)


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """``{dotted.key: leaf}`` of a plain container; lists of mappings are indexed (``stages[1].type``)."""
    if isinstance(node, dict):
        if not node and prefix:
            return {prefix: {}}
        out = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(node, list) and node and all(isinstance(v, dict) for v in node):
        out = {f"{prefix}.length": len(node)}
        for i, v in enumerate(node):
            out.update(_flatten(v, f"{prefix}[{i}]"))
        return out
    return {prefix: node}


def config_differences(saved: dict, new: dict) -> list[tuple[str, Any, Any]]:
    """``(key, saved value, new value)`` for every key that differs and is not in :data:`RESUME_SAFE_KEYS`.

    Both are plain containers, resolved except that values read from the
    environment may be kept as their interpolation (see
    :mod:`rltk.config.saved`) and then compare as that: a changed environment
    variable is not a difference. A key one side lacks counts as its schema
    default (a run saved by an older rltk lacks keys added since), or as
    ``(unset)`` when the schema has none.
    """
    defaults = _flatten(OmegaConf.to_container(OmegaConf.structured(RunConfig), resolve=True))
    old, cur = _flatten(saved), _flatten(new)
    diffs = []
    for key in sorted(set(old) | set(cur)):
        if _is_safe(key):
            continue
        a, b = old.get(key, defaults.get(key, _UNSET)), cur.get(key, defaults.get(key, _UNSET))
        if a != b:
            diffs.append((key, a, b))
    return diffs


def _short(value: Any, width: int = 60) -> str:
    text = value if value == _UNSET else repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _saved_config(path: Path) -> dict:
    try:
        return OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}
    except Exception as exc:  # a file edited by hand into something that is not YAML
        raise ConfigError(
            f"cannot read the config saved with the previous run, {path}: {exc}. Use name=<new name> for a new "
            f"run folder, or checkpoint.resume=never to start over in this one"
        ) from exc


def check_compatible(cfg: DictConfig, saved_file: Path, what: str) -> None:
    """Raise ConfigError when ``cfg`` differs from the config saved in ``saved_file`` beyond the safe keys.

    ``what`` says what would be resumed (the run folder, a checkpoint), for
    the message, which lists each differing key as ``old -> new`` and the two
    ways out.
    """
    saved = _saved_config(saved_file)
    # config.yaml keeps values read from the environment as their ${oc.env:...} interpolation; a file
    # written before rltk did so holds the resolved value, which must not count as a change either.
    diffs = config_differences(saved, config_to_record(cfg))
    if diffs:
        changed = {key for key, _, _ in config_differences(saved, OmegaConf.to_container(cfg, resolve=True))}
        diffs = [d for d in diffs if d[0] in changed]
    if not diffs:
        return
    shown = "; ".join(f"{k}: {_short(a)} -> {_short(b)}" for k, a, b in diffs[:8])
    more = f"; and {len(diffs) - 8} more" if len(diffs) > 8 else ""
    raise ConfigError(
        f"{what} holds a run with a different config ({saved_file}), so this run cannot resume it: {shown}{more}. "
        f"Give this run its own folder with name=<new name> (or output_dir=<folder>), or start over there with "
        f"checkpoint.resume=never (deletes that run's checkpoints and metrics)"
    )


#: Checkpoint state: the global step each stage ended at, for the stages finished by then (this one
#: included when it ends its stage). The next stage's steps are numbered from the last of them.
STAGE_ENDS_KEY = "stage_ends"


def stage_ends(resume: dict[str, Any] | None, stage_steps: list[int]) -> list[int]:
    """The global step each stage finished before ``resume`` ended at (``[]`` for a run starting afresh).

    A stage's steps are numbered on from where the stage before it really ended: a warm-up that stops at
    step 1100 of its 6000-step cap is followed by steps 1101, 1102 ... A checkpoint written before rltk
    numbered so holds no :data:`STAGE_ENDS_KEY`; its run had reserved each finished stage its whole
    configured length (``stage_steps``), which its later steps keep, and a stage ending at the checkpoint
    ends at its step.
    """
    if resume is None:
        return []
    finished = resume["stage"] + int(bool(resume["stage_done"]))
    saved = resume.get(STAGE_ENDS_KEY)
    if isinstance(saved, list) and len(saved) == finished:
        return [int(end) for end in saved]
    ends = list(itertools.accumulate(stage_steps[: resume["stage"]]))
    return ends + [int(resume["global_step"])] if resume["stage_done"] else ends


def is_stage_end(state: dict[str, Any]) -> bool:
    """Whether a checkpoint's saved state ends its stage: the runs keep those whatever ``checkpoint.keep_last``."""
    return bool(state.get("stage_done"))


def start_point(cfg: DictConfig, stage_steps: list[int]) -> dict[str, Any]:
    """Where a new run that names ``checkpoint.start_from`` starts: after the stage that checkpoint ends.

    ``checkpoint.start_from`` is the last checkpoint of a stage of another run (each stage's last
    checkpoint is kept whatever ``checkpoint.keep_last``), e.g. the end of its warm-up. This run
    skips its own stages up to and including that one (their steps are still counted: later
    stages keep the step numbers they had in the other run), loads the checkpoint's model weights,
    and trains the stages after it with their own config: a fixed RL stage after a warm-up that
    went well, without training the warm-up again. Nothing else of the other run is taken (no
    optimizer, counters or logs); its architecture (``model.*``) must be this run's. ``stage_steps``
    are this run's stage lengths (a checkpoint of an older rltk, which holds no stage ends, counts
    them instead). ``ConfigError`` for a checkpoint that is damaged, ends no stage, or ends this
    run's last stage (nothing would be left to train).
    """
    from rltk.distributed import process_rank

    path = Path(cfg.checkpoint.start_from).expanduser()
    key = f"checkpoint.start_from='{cfg.checkpoint.start_from}'"
    if not (path / STATE_FILE).is_file():
        raise ConfigError(f"{key} is not a complete rltk checkpoint (no {STATE_FILE} in it); give the step_XXXXXX "
                          f"folder that ends a stage of another run")
    damage = CheckpointManager(path.parent).verify(path, allowed_globals=checkpoint_globals_of(cfg.strategy))
    if damage:
        raise ConfigError(f"{key} is a damaged checkpoint: {damage_summary(damage, path)}")
    state = read_state_file(path)["state"]
    stage, step = state.get("stage"), state.get("stage_step")
    if not is_stage_end(state) or not isinstance(stage, int):
        raise ConfigError(f"{key} was saved in the middle of its run's stage {stage} (step {step}); a run starts "
                          f"from a checkpoint that ends a stage (its last step, kept whatever keep_last). To go "
                          f"on from the middle of a stage, resume that run (checkpoint.resume)")
    if stage >= len(cfg.stages) - 1:
        raise ConfigError(f"{key} ends stage {stage}, and this run has {len(cfg.stages)} stage(s) "
                          f"({', '.join(s.name for s in cfg.stages)}): nothing would be left to train. Its stages "
                          f"after the one the checkpoint ends are the ones trained")
    if process_rank() == 0:
        print(f"rltk: starting after stage {stage} ('{cfg.stages[stage].name}') from the weights of {path}")
    ends = state.get(STAGE_ENDS_KEY)
    if not (isinstance(ends, list) and len(ends) == stage + 1):
        ends = list(itertools.accumulate(stage_steps[: stage + 1]))
    return {"path": path, "global_step": int(ends[-1]), "stage": stage, "stage_done": True, "stage_step": step,
            STAGE_ENDS_KEY: [int(end) for end in ends], "started_from": str(path)}


def run_is_finished(resume: dict[str, Any] | None, cfg: DictConfig) -> bool:
    """Whether the resume point is the end of the run's last stage: nothing is left to train."""
    return resume is not None and resume["stage"] == len(cfg.stages) - 1 and bool(resume["stage_done"])


def resume_or_start_over(cfg: DictConfig, ckpt: CheckpointManager, *, main_process: bool = True
                         ) -> dict[str, Any] | None:
    """The checkpoint this run continues from (see :func:`resume_point`), decided before anything is written.

    ``checkpoint.resume=auto`` resumes the run in ``output_dir`` only if its
    saved config is compatible (:func:`check_compatible`); when there is no
    checkpoint to resume, what an earlier attempt left is cleared. ``never``
    clears the folder's previous run and says so. An explicit checkpoint
    folder is checked against the config of the run that wrote it. Only the
    main process deletes files; every process gets the same answer.
    """
    run_dir = Path(cfg.output_dir)
    mode = cfg.checkpoint.resume
    saved = run_dir / CONFIG_FILE
    if mode != "never":
        if saved.is_file():
            check_compatible(cfg, saved, f"the run folder {run_dir}")
        if mode != "auto":
            owner = Path(mode).parent.parent / CONFIG_FILE  # <run>/checkpoints/step_XXXXXX
            if owner.is_file() and owner.resolve() != saved.resolve():
                check_compatible(cfg, owner, f"checkpoint.resume='{mode}'")
    resume = resume_point(ckpt, mode, allowed_globals=checkpoint_globals_of(cfg.strategy),
                          main_process=main_process)
    if resume is not None and main_process:
        # A run killed between a save and its prune left more than keep_last checkpoints.
        pruned = [p.name for p in ckpt.prune(keep=resume["path"]) if p.name.startswith("step_")]
        if pruned:
            print(f"rltk: removed {', '.join(pruned)} from {ckpt.root}: more than checkpoint.keep_last="
                  f"{ckpt.keep_last} checkpoints were left by an interrupted run")
    # Only a folder an rltk run wrote is cleared: output_dir may be a folder of the user's own.
    holds_run = saved.is_file() or (run_dir / "checkpoints").is_dir()
    if resume is None and mode == "auto" and holds_run and (run_dir / "summary.json").is_file():
        # It finished without keeping a checkpoint (checkpoint.every=0): starting over would
        # silently replace its results.
        raise ConfigError(
            f"the run folder {run_dir} holds a finished run that kept no checkpoint (checkpoint.every=0), so there "
            f"is nothing to resume; its results are in {run_dir / 'summary.json'}. Give this run its own folder "
            f"with name=<new name>, or run it again there with checkpoint.resume=never (replaces those results)"
        )
    if resume is None and main_process and holds_run:
        removed = remove_run_state(run_dir)
        if removed:
            why = "checkpoint.resume=never" if mode == "never" else "no complete checkpoint to resume"
            print(f"rltk: {why}: starting over in {run_dir} (removed the previous run's {', '.join(removed)})")
    return resume


def remove_run_state(run_dir: str | Path) -> list[str]:
    """Delete what a previous run left in ``run_dir`` (:data:`RUN_STATE`); returns the names removed.

    ``config.yaml`` and the tokenizer are rewritten by the new run, and files
    rltk does not own are left alone.
    """
    removed = []
    for name in RUN_STATE:
        path = Path(run_dir) / name
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            path.unlink(missing_ok=True)
        else:
            continue
        removed.append(name)
    return removed
