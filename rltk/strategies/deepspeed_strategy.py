"""Training strategy ``deepspeed``: ZeRO stages 1, 2 and 3, with CPU offload.

ZeRO: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", SC 2020 (arXiv:1910.02054); offload: Ren et al.,
"ZeRO-Offload", USENIX ATC 2021 (arXiv:2101.06840).

DeepSpeed owns what it does well: partitioning optimizer state (ZeRO-1),
gradients (ZeRO-2) and parameters (ZeRO-3) across data-parallel ranks, the
optional CPU offload of optimizer state and parameters, bf16/fp16 training
with fp32 master weights, and its sharded checkpoints. rltk keeps the rest so
that a recipe sees the same :class:`~rltk.strategies.base.TrainingStrategy` as
under Accelerate:

* **The optimizer and schedule.** ``torch.optim.AdamW`` and the warm-up
  ``LambdaLR`` are built by :func:`~rltk.strategies.base.build_adamw` and
  :func:`~rltk.strategies.base.build_lr_scheduler` and handed to
  ``deepspeed.initialize``. A torch optimizer also avoids compiling
  DeepSpeed's fused/CPU Adam extensions (1-2 minutes).
* **Gradient accumulation.** rltk decides when a step ends (:meth:`step`), not
  DeepSpeed's micro-step counter: the config sets
  ``gradient_accumulation_steps=1`` and ``managed_gradient_accumulation=false``,
  so ``engine.backward`` only accumulates and ``engine.step`` is the
  accumulation boundary, however many micro-batches preceded it.

How rltk's settings map onto the DeepSpeed config (see :func:`rltk.strategies.deepspeed_config.derive_deepspeed_config`)::

    setup(grad_clip=c)            -> "gradient_clipping": c  (0 when None)
    zero_stage=s                  -> "zero_optimization": {"stage": s}
    offload_optimizer=True        -> "zero_optimization": {"offload_optimizer": {"device": "cpu"}},
                                     "zero_force_ds_cpu_optimizer": false   (keep the torch AdamW)
    offload_params=True (ZeRO-3)  -> "zero_optimization": {"offload_param": {"device": "cpu"}}
    mixed_precision="bf16"        -> "bf16": {"enabled": true}
    mixed_precision="fp16"        -> "fp16": {"enabled": true, "loss_scale": 0}  (dynamic loss scale)
    (accumulation owned by rltk)  -> "gradient_accumulation_steps": 1, "managed_gradient_accumulation": false
    (no DeepSpeed data loader)    -> "train_micro_batch_size_per_gpu": 1, "train_batch_size": world_size

A raw DeepSpeed config (``config=`` a dict or a JSON file) is merged over the
derived one, key by key; a value ``"auto"`` (as in Hugging Face examples)
keeps rltk's value. Sections that would contradict rltk (``optimizer``,
``scheduler``, accumulation) are refused with the reason
(:mod:`rltk.strategies.deepspeed_config`). Checkpoint conversion and export,
which need no process group, are :mod:`rltk.strategies.deepspeed_checkpoint`.

Launching: ``torchrun --nproc_per_node N recipe.py``, ``deepspeed
--num_gpus N recipe.py`` (or ``--hostfile`` for several nodes). The
``deepspeed`` launcher appends ``--local_rank=N`` to the script's arguments;
:func:`rltk.distributed.strip_local_rank_argument` removes it before argument parsing. A plain
``python recipe.py`` runs one process: the rendezvous variables are filled in
with a free local port.

Checkpoints (:meth:`DeepSpeedStrategy.save`) hold DeepSpeed's own sharded
checkpoint (``deepspeed/``, one optimizer shard per rank, read back by
DeepSpeed's loader) plus, by default, the full fp32 weights as a plain Hugging
Face folder (``model/``, safetensors) that :func:`~rltk.strategies.deepspeed_checkpoint.export_model_folder` copies and
``from_pretrained`` loads. The rollout engine gets full weights from
:meth:`DeepSpeedStrategy.full_state_dict`, which gathers ZeRO-3 partitions.

ZeRO-3 partitions the module it is given in place: outside a forward a rank
holds only its shard of each parameter, so the module is no model on its own
and a second ``deepspeed.initialize`` on it is not supported.
:attr:`~DeepSpeedStrategy.shards_parameters` says so to recipes;
:meth:`~DeepSpeedStrategy.full_model_copy` builds a plain module with the
gathered weights (a rollout engine's own copy, a frozen reference model), and
:meth:`~DeepSpeedStrategy.release_model` ends a stage: it hands back a plain
module with the fp32 master weights, on which the next stage builds its own
strategy, and frees the engine. Both rebuild the module from a weightless
(``meta``) copy taken in :meth:`~DeepSpeedStrategy.setup` before DeepSpeed
touched it, so they work for any ``nn.Module``, tied weights included.

Resuming with another number of processes (or from ZeRO-1 to ZeRO-2 and
back): DeepSpeed's shards are tied to the world size that wrote them, so
:meth:`load` converts them once into DeepSpeed's *universal checkpoint*
(``ds_to_universal``, written beside them as ``deepspeed_universal/``) and
loads that; weights, Adam moments and the schedule all carry over. Between
ZeRO-1/2 and ZeRO-3 DeepSpeed 0.19 cannot convert; start from ``model/``
then (see :func:`~rltk.strategies.deepspeed_checkpoint.check_resumable`).

Loading never unpickles freely. DeepSpeed's readers call ``torch.load(...,
weights_only=False)``, so every read of its files (resume, universal
conversion, export) runs inside
:func:`rltk.serialization.weights_only_everywhere` with
:func:`~rltk.strategies.deepspeed_checkpoint.deepspeed_checkpoint_globals` as the only classes allowed beyond
tensors and plain data, after :func:`rltk.serialization.check_torch_files`
has checked each file (memory-mapped) so that a refused one is named.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

import rltk
from rltk.distributed import ensure_single_process_environment, seed_everything, start_loopback_process_group
from rltk.models.folders import save_model_folder
from rltk.models.lora import adapter_live_names, is_lora_model
from rltk.models.sharding import rebuild_module, weightless_copy
from rltk.registry import unknown_name_message
from rltk.serialization import check_torch_files, weights_only_everywhere
from rltk.strategies.base import (
    MIXED_PRECISION_MODES, MODEL_SUBDIR, STRATEGY_META_FILE, OptimizerSettings, TrainingStrategy, build_adamw,
    build_lr_scheduler, check_mixed_precision,
)
from rltk.strategies.deepspeed_checkpoint import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_TAG,
    DEEPSPEED_SUBDIR,
    MODEL_CONFIG_SUBDIR,
    UNIVERSAL_SUBDIR,
    check_resumable,
    convert_to_universal,
    deepspeed_checkpoint_globals,
    read_checkpoint_meta,
    save_model_config,
)
from rltk.strategies.deepspeed_config import (
    ZERO_STAGES, read_deepspeed_config, resolve_deepspeed_config, summarize_deepspeed_config,
)

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------
# The strategy
# --------------------------------------------------------------------------


class DeepSpeedStrategy(TrainingStrategy):
    """Data-parallel training with DeepSpeed ZeRO stage 1, 2 or 3, optionally offloading to CPU.

    Args:
        zero_stage: 1 partitions optimizer state, 2 also gradients, 3 also
            parameters (gathered layer by layer for each forward/backward).
            For plain data parallelism use the ``accelerate`` strategy.
        offload_optimizer: keep optimizer state and fp32 master weights in CPU
            memory and run the AdamW step there (any stage).
        offload_params: keep parameters in CPU memory between uses (ZeRO-3 only).
        mixed_precision: ``"no"`` (fp32), ``"bf16"`` or ``"fp16"`` (CUDA only,
            dynamic loss scaling). In bf16/fp16 DeepSpeed holds the model in
            that precision with fp32 master weights inside the ZeRO optimizer,
            so :meth:`autocast` is a no-op and forward passes run fully in it.
        config: a raw DeepSpeed config (dict, OmegaConf node, or JSON file path)
            merged over what rltk derives; see the module docstring.
        seed: if given, seeds python ``random``, numpy and torch with the same
            value on every rank at construction (leave ``None`` for a second
            strategy in one process, e.g. a critic).
        save_full_weights: :meth:`save` also writes the full fp32 weights as a
            Hugging Face folder (``model/``). Gathering them costs one full
            model copy in CPU memory on the main rank at every checkpoint;
            turn it off for very large models: :func:`export_model_folder`
            consolidates the shards offline.

    The process group is started at construction (``deepspeed.init_distributed``,
    gloo on CPU, NCCL on CUDA). Call :meth:`close` at the end of the run.
    """

    def __init__(self, *, zero_stage: int = 2, offload_optimizer: bool = False, offload_params: bool = False,
                 mixed_precision: str = "no", config: str | Path | Mapping | None = None, seed: int | None = None,
                 save_full_weights: bool = True):
        if isinstance(zero_stage, bool) or zero_stage not in ZERO_STAGES:
            raise ValueError(
                f"DeepSpeedStrategy: zero_stage={zero_stage!r} is invalid; valid: 1 (optimizer state), "
                "2 (+ gradients) or 3 (+ parameters). For plain data parallelism use training_strategy=accelerate."
            )
        for name, value in (("offload_optimizer", offload_optimizer), ("offload_params", offload_params),
                            ("save_full_weights", save_full_weights)):
            if not isinstance(value, bool):
                raise TypeError(f"DeepSpeedStrategy: {name}={value!r} must be True or False.")
        if mixed_precision not in MIXED_PRECISION_MODES:
            raise ValueError("DeepSpeedStrategy: " + unknown_name_message(
                "mixed_precision", mixed_precision, list(MIXED_PRECISION_MODES)))
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"DeepSpeedStrategy: seed={seed!r} must be an integer or None.")
        self.user_config = read_deepspeed_config(config)
        # Fail before the (slow) process-group start on what can be checked without it.
        check_mixed_precision(mixed_precision, torch.device("cuda" if torch.cuda.is_available() else "cpu"))

        self._started_process_group = self._init_distributed()
        import deepspeed.comm

        self._rank = deepspeed.comm.get_rank()
        self._world_size = deepspeed.comm.get_world_size()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank)
            self._device = torch.device("cuda", local_rank)
        else:
            self._device = torch.device("cpu")

        self.config = resolve_deepspeed_config(
            zero_stage=zero_stage, offload_optimizer=offload_optimizer, offload_params=offload_params,
            mixed_precision=mixed_precision, user_config=self.user_config, world_size=self._world_size,
            device=self._device,
        )
        # The effective settings come from the merged config: a raw config may change them.
        summary = summarize_deepspeed_config(self.config)
        self.zero_stage = summary["zero_stage"]
        self.offload_optimizer = summary["offload_optimizer"]
        self.offload_params = summary["offload_params"]
        self.mixed_precision = summary["mixed_precision"]
        self.save_full_weights = save_full_weights
        self.seed = seed
        if seed is not None:
            seed_everything(seed)
        self._engine = None
        self._closed = False
        self._released = False
        self._skeleton: nn.Module | None = None  # the model's structure, parameters on "meta": see setup
        self._optimizer: torch.optim.Optimizer | None = None
        self._scheduler: torch.optim.lr_scheduler.LambdaLR | None = None

    # ---------------------------------------------------------------- construction helpers

    @staticmethod
    def _init_distributed() -> bool:
        """Start the process group unless one exists (a second strategy reuses it); True if started here."""
        import deepspeed

        if torch.distributed.is_available() and torch.distributed.is_initialized():
            deepspeed.init_distributed()  # adopts the existing group
            return False
        ensure_single_process_environment()
        start_loopback_process_group()  # deepspeed adopts it; its own would listen on every interface
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
        return True

    # ---------------------------------------------------------------- setup

    def _setup(self, model: nn.Module, settings: OptimizerSettings) -> None:
        import deepspeed

        if "gradient_clipping" not in self.user_config:
            self.config["gradient_clipping"] = float(settings.grad_clip) if settings.grad_clip else 0.0
        # Taken before DeepSpeed converts (ZeRO-3: partitions) the module, at no memory cost: the
        # structure full_model_copy() and release_model() rebuild a plain module from.
        self._skeleton = weightless_copy(model)
        optimizer = build_adamw(model, settings)
        scheduler = build_lr_scheduler(optimizer, settings)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                               config=copy.deepcopy(self.config), dist_init_required=False)
        self._engine = engine
        # DeepSpeed wraps `optimizer` in its ZeRO optimizer, which steps it on the flat fp32 partitions.
        self._optimizer = optimizer
        self._scheduler = scheduler

    def _require_setup(self, what: str) -> None:
        super()._require_setup(what)
        if self._released:
            raise RuntimeError(f"DeepSpeedStrategy.{what}: this strategy handed its model back with release_model() "
                               "and freed its engine; build a new strategy on the released module.")

    # ---------------------------------------------------------------- properties

    @property
    def engine(self):
        """The ``deepspeed.DeepSpeedEngine`` (for DeepSpeed features rltk does not wrap)."""
        self._require_setup("engine")
        return self._engine

    @property
    def model(self) -> nn.Module:
        """The DeepSpeed engine; call it like the model (ZeRO-3 gathers parameters in its hooks)."""
        self._require_setup("model")
        return self._engine

    @property
    def shards_parameters(self) -> bool:
        """True under ZeRO-3: parameters are partitioned across ranks outside the forward pass."""
        return self.zero_stage == 3

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because the gradient norm was not finite (or fp16 overflowed)."""
        return int(self._engine.skipped_steps) if self._engine is not None else 0

    # ---------------------------------------------------------------- training

    def autocast(self) -> contextlib.AbstractContextManager:
        """A no-op: under bf16/fp16 DeepSpeed already holds the model in that precision."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def accumulate(self, is_last_micro_batch: bool) -> Iterator[None]:
        """Nothing to switch: :meth:`step`, not the micro-batch, is DeepSpeed's accumulation boundary.

        ZeRO-1 reduces gradients once, in :meth:`step`. ZeRO-2 and ZeRO-3
        reduce-scatter every micro-batch's gradients as they are produced (that
        is how they avoid ever holding full gradients) and sum them into this
        rank's partition.
        """
        self._require_setup("accumulate()")
        yield

    def backward(self, loss: torch.Tensor) -> None:
        """``engine.backward(loss * world_size)``.

        ``loss`` is this rank's share of a globally normalised sum; ZeRO averages
        gradients over ranks, the factor ``world_size`` turns that average back
        into the sum, so the result equals one process on the global batch.
        Under fp16 the ZeRO optimizer applies the loss scale.
        """
        self._require_setup("backward()")
        self._engine.backward(loss * self.world_size)

    def step(self) -> dict[str, float]:
        """Reduce accumulated gradients, clip to ``grad_clip``, AdamW step, schedule step, zero gradients.

        A non-finite gradient norm (or an fp16 overflow) makes DeepSpeed skip the
        update: gradients are dropped, the schedule does not advance, and
        ``skipped`` is 1 (with ``grad_norm`` inf).
        """
        self._require_setup("step()")
        lr = self.current_lr
        self._engine.step()
        skipped = not self._engine.was_step_applied()
        norm = self._engine.get_global_grad_norm()
        if norm is None:  # only with "zero_optimization.compute_grad_norm": false in a raw config
            grad_norm = math.inf if skipped else math.nan
        else:
            grad_norm = float(norm)
        if skipped:
            logger.warning("optimizer step %d skipped: gradient norm is %s (%d skipped so far)",
                           self.optimizer_steps + 1, grad_norm, self.skipped_steps)
        return {"grad_norm": grad_norm, "lr": lr, "skipped": float(skipped)}

    # ---------------------------------------------------------------- weights

    def unwrap(self) -> nn.Module:
        """The model inside the engine. Under ZeRO-3 its parameters are partitioned: outside the engine's
        forward use :meth:`full_state_dict` (or ``deepspeed.zero.GatheredParameters``) to read them."""
        self._require_setup("unwrap()")
        return self._engine.module

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full CPU copies of the weights the model trains with, on every rank. Collective.

        In the model's own dtype (bf16 under ``mixed_precision="bf16"``: what
        the forward pass uses, which is what a rollout engine should get).
        ZeRO-3 gathers one parameter at a time, so the peak extra device memory
        is one full tensor, not the whole model.
        """
        self._require_setup("full_state_dict()")
        return self._gather_state_dict(master_weights=False)

    def full_model_copy(self) -> nn.Module:
        """A plain module with the weights the forward pass uses now, on :attr:`device`. Collective.

        Rebuilt from the weightless copy taken at :meth:`setup` and
        :meth:`full_state_dict` (so in the training dtype: bf16 under
        ``mixed_precision="bf16"``), with the live module's buffers; tied
        weights stay tied. Under ZeRO-3 this is the only way to a usable model
        outside the engine; every rank gets its own copy. Shares no storage
        with the training weights.
        """
        self._require_setup("full_model_copy()")
        return self._rebuild(self._gather_state_dict(master_weights=False), original_dtypes=False)

    def release_model(self) -> nn.Module:
        """Free the engine and hand back the model as a plain module with the fp32 master weights. Collective.

        Call it when a stage ends: the next stage builds its own strategy on
        the returned module (a ZeRO-3 engine leaves the module it trained
        partitioned, which ``deepspeed.initialize`` cannot take again). The
        module has the dtypes it had before :meth:`setup` (DeepSpeed casts it
        under bf16/fp16; the master weights are exact) and lives on
        :attr:`device`. The process group stays up for the next strategy; this
        strategy is unusable afterwards (``close()`` still ends the group).
        """
        self._require_setup("release_model()")
        module = self._rebuild(self._gather_state_dict(master_weights=True), original_dtypes=True)
        self.barrier()  # every rank has its copy before any rank frees the partitions
        self._engine.destroy()
        self._engine = self._optimizer = self._scheduler = None
        self._skeleton = None
        self._released = True
        return module

    def _rebuild(self, state: dict[str, torch.Tensor], *, original_dtypes: bool) -> nn.Module:
        return rebuild_module(self._skeleton, state, buffers_from=self.unwrap(), device=self._device,
                              original_dtypes=original_dtypes)

    def full_master_state_dict(self) -> dict[str, torch.Tensor]:
        """Full CPU copies of the fp32 master weights the optimizer updates, on every rank. Collective.

        Equal to :meth:`full_state_dict` in fp32 training; under bf16/fp16 these
        are the exact weights before rounding, which is what a checkpoint and an
        export keep.
        """
        self._require_setup("full_master_state_dict()")
        return self._gather_state_dict(master_weights=True)

    def _gather_state_dict(self, *, master_weights: bool, keep: bool = True,
                           only: set[str] | None = None) -> dict[str, torch.Tensor]:
        """Full CPU copies of every state-dict entry (or of the names in ``only``); with ``keep=False``
        this rank only takes part in the gathers and returns ``{}`` (no full copy in its memory)."""
        import deepspeed
        from deepspeed.utils import safe_get_full_fp32_param

        module = self.unwrap()
        live = module.state_dict(keep_vars=True)
        gathered: dict[int, torch.Tensor | None] = {}  # tied weights appear under two keys: gather once
        result: dict[str, torch.Tensor] = {}
        # Every rank walks the same keys in the same order and skips the same tied duplicates: the
        # gathers below are collectives.
        for name, tensor in live.items():
            if only is not None and name not in only:
                continue
            if id(tensor) in gathered:
                if keep:
                    result[name] = gathered[id(tensor)].clone()
                continue
            if master_weights and isinstance(tensor, nn.Parameter) and tensor.requires_grad:
                full = safe_get_full_fp32_param(tensor).detach().to("cpu", copy=True)
            elif hasattr(tensor, "ds_id"):  # a ZeRO-3 partitioned parameter (frozen or not)
                with deepspeed.zero.GatheredParameters([tensor]):
                    full = tensor.detach().to("cpu", copy=True)
            else:
                full = tensor.detach().to("cpu", copy=True)
            gathered[id(tensor)] = full if keep else None
            if keep:
                result[name] = full
            del full
        return result

    # ---------------------------------------------------------------- checkpoints

    def save(self, directory: str | Path) -> None:
        """Write DeepSpeed's sharded checkpoint, the full fp32 weights and ``strategy.json``. Collective.

        Layout::

            deepspeed/state/     engine.save_checkpoint: model states, one ZeRO optimizer shard per
                                 rank, the LR schedule (DeepSpeed's files; zero_to_fp32.py beside them)
            model/               full fp32 weights, a Hugging Face folder (safetensors), if save_full_weights;
                                 with LoRA always, and only the peft adapter folder (the engine's files then
                                 hold no frozen base weights either)
            model_config/        otherwise the model's config files, for export_model_folder
            strategy.json        format, ZeRO stage, world size, precision, optimizer settings

        Every rank writes its own shard, so ``directory`` must be on a file
        system all ranks see.
        """
        self._require_setup("save()")
        directory = Path(directory)
        if self.is_main:
            directory.mkdir(parents=True, exist_ok=True)
        self.barrier()
        from deepspeed.checkpoint.constants import (
            UNIVERSAL_CHECKPOINT_INFO,
            UNIVERSAL_CHECKPOINT_VERSION_KEY,
            UNIVERSAL_CHECKPOINT_VERSION_VALUE,
        )

        # ds_to_universal refuses ZeRO-1/2 shards without this entry; empty tensor-parallel patterns
        # describe a purely data-parallel model, which is what rltk trains.
        universal_info = {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}
        # LoRA: the frozen base weights are rebuilt from the run's config, so the engine's files hold the
        # adapter (and its optimizer state) only.
        self._engine.save_checkpoint(str(directory / DEEPSPEED_SUBDIR), tag=CHECKPOINT_TAG,
                                     client_state={"rltk_format": CHECKPOINT_FORMAT,
                                                   UNIVERSAL_CHECKPOINT_INFO: universal_info},
                                     exclude_frozen_parameters=is_lora_model(self.unwrap()))
        # Every rank takes part in the gathers; only the main rank, which writes, keeps the copy.
        # LoRA: the adapter is small and is all a resume or an export needs beside the run's config, so
        # it is always written (save_full_weights or not), and nothing of the frozen base is gathered.
        adapter = adapter_live_names(self.unwrap())
        write_weights = self.save_full_weights or adapter is not None
        weights = (self._gather_state_dict(master_weights=True, keep=self.is_main, only=adapter)
                   if write_weights else None)
        if self.is_main:
            if write_weights:
                save_model_folder(self.unwrap(), weights, directory / MODEL_SUBDIR)
            else:
                save_model_config(self.unwrap(), directory / MODEL_CONFIG_SUBDIR)
            meta = {"format": CHECKPOINT_FORMAT, "tag": CHECKPOINT_TAG, **self.describe(),
                    "param_groups": self._param_group_hyperparameters()}
            (directory / STRATEGY_META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        self.barrier()

    def load(self, directory: str | Path) -> None:
        """Restore weights, optimizer state and schedule written by :meth:`save`. Collective.

        With the world size and ZeRO stage that wrote it, DeepSpeed reads its
        shards directly. Otherwise the main rank converts them once into a
        universal checkpoint (``deepspeed_universal/`` beside them) that every
        rank then loads: any process count works, and ZeRO-1 and ZeRO-2
        checkpoints load into each other; between ZeRO-1/2 and ZeRO-3 DeepSpeed
        0.19 cannot convert (see :func:`check_resumable`). DeepSpeed's loader
        asks for full unpickling (``weights_only=False``); here it gets
        weights-only loads that allow :func:`deepspeed_checkpoint_globals` and
        nothing else, and each file is checked first, so a planted pickle
        raises :class:`rltk.serialization.UnsafeCheckpointError` naming it.
        """
        self._require_setup("load()")
        directory = Path(directory)
        meta = read_checkpoint_meta(directory)
        check_resumable(meta, self.zero_stage, directory)
        allowed = deepspeed_checkpoint_globals()
        check_torch_files(directory / DEEPSPEED_SUBDIR, allowed_globals=allowed)
        same_layout = meta.get("world_size") == self.world_size and meta.get("zero_stage") == self.zero_stage
        if same_layout:
            load_dir, universal = directory / DEEPSPEED_SUBDIR, False
        else:
            load_dir, universal = self._universal_checkpoint(directory, meta), True
            logger.info("resuming a checkpoint written by %s process(es) under ZeRO-%s with %d process(es) "
                        "under ZeRO-%d through DeepSpeed's universal checkpoint %s", meta.get("world_size"),
                        meta.get("zero_stage"), self.world_size, self.zero_stage, load_dir)
        checkpoint_config = self._engine._config
        previous = checkpoint_config.load_universal_checkpoint
        # DeepSpeed reads this switch from its config at load time; it is set only for this call.
        checkpoint_config.load_universal_checkpoint = universal
        try:
            if universal:  # converted by an earlier run maybe, and not part of the checkpoint's manifest
                check_torch_files(load_dir, allowed_globals=allowed)
            with weights_only_everywhere(allowed):
                path, _ = self._engine.load_checkpoint(str(load_dir), tag=meta["tag"],
                                                       load_optimizer_states=True, load_lr_scheduler_states=True,
                                                       load_module_strict=not is_lora_model(self.unwrap()))
        finally:
            checkpoint_config.load_universal_checkpoint = previous
        if path is None:
            raise FileNotFoundError(f"DeepSpeed found no checkpoint with tag '{meta['tag']}' "
                                    f"under '{load_dir}'; the checkpoint is incomplete.")
        if universal:
            self._repair_universal_load(meta.get("param_groups"), directory)
        self.barrier()

    def _param_group_hyperparameters(self) -> list[dict[str, Any]]:
        """Each optimizer group's hyper-parameters (lr, betas, weight decay, ...) as JSON-able values."""
        return [{key: list(value) if isinstance(value, tuple) else value for key, value in group.items()
                 if key != "params" and (value is None or isinstance(value, (bool, int, float, str, tuple, list)))}
                for group in self._optimizer.param_groups]

    def _repair_universal_load(self, saved: list[dict[str, Any]] | None, source: Path) -> None:
        """Undo two slips of DeepSpeed 0.19's ZeRO-3 universal loader (harmless for other stages).

        It hands one ``step`` tensor to every parameter group; AdamW increments it
        in place once per group, so from the second group on Adam's bias
        correction would use a wrong step count. And it copies group 0's
        hyper-parameters into every group, giving the no-decay group (biases,
        norms) group 0's weight decay; they are restored from ``strategy.json``.
        """
        for state in self._optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
        if saved is None:
            return
        groups = self._optimizer.param_groups
        if len(saved) != len(groups):
            raise ValueError(
                f"checkpoint '{source}' has {len(saved)} optimizer parameter groups, the optimizer has "
                f"{len(groups)}; was it saved for another model, or with other parameters frozen?"
            )
        for group, values in zip(groups, saved):
            for key, value in values.items():
                group[key] = tuple(value) if key == "betas" else value

    def _universal_checkpoint(self, directory: Path, meta: dict[str, Any]) -> Path:
        """``directory/deepspeed_universal``, converted from ``directory/deepspeed`` by the main rank if absent."""
        universal = directory / UNIVERSAL_SUBDIR
        error = None
        if self.is_main and not (universal / "latest_universal").is_file():
            try:
                convert_to_universal(directory / DEEPSPEED_SUBDIR, universal, tag=meta["tag"])
            except Exception as exc:  # reported on every rank below, so no rank waits forever
                error = f"{type(exc).__name__}: {exc}"
        error = self.broadcast_object(error)
        if error is not None:
            raise RuntimeError(
                f"could not convert the DeepSpeed checkpoint in '{directory / DEEPSPEED_SUBDIR}' (written by "
                f"{meta.get('world_size')} process(es), ZeRO-{meta.get('zero_stage')}) into a universal checkpoint "
                f"for {self.world_size} process(es): {error}. Resume with the original process count and ZeRO "
                f"stage, or start from the exported weights in '{directory / MODEL_SUBDIR}'."
            )
        return universal

    def close(self) -> None:
        """Release the engine and end the process group if this strategy started it. Collective.

        A barrier before ``destroy_process_group`` lets every rank finish its
        last collective first; exiting without it occasionally aborts a gloo
        peer. With several strategies in one process (policy and critic), close
        the one constructed first last: it owns the process group. The
        strategy is unusable afterwards; a second call does nothing.
        """
        if self._closed:
            return
        self._closed = True
        if self._engine is not None:
            self._engine.destroy()
        if self._started_process_group and torch.distributed.is_initialized():
            import deepspeed.comm

            torch.distributed.barrier()
            deepspeed.comm.destroy_process_group()

    @classmethod
    def checkpoint_globals(cls) -> list[Any]:
        """DeepSpeed's classes in its checkpoint files (:func:`deepspeed_checkpoint_globals`)."""
        return deepspeed_checkpoint_globals()

    def describe(self) -> dict[str, Any]:
        """The base summary plus ZeRO stage, offload and precision (in ``strategy.json``)."""
        return {
            **super().describe(),
            "zero_stage": self.zero_stage,
            "offload_optimizer": self.offload_optimizer,
            "offload_params": self.offload_params,
            "mixed_precision": self.mixed_precision,
        }


@rltk.hookimpl
def rltk_training_strategies():
    """Register :class:`DeepSpeedStrategy` as training strategy ``deepspeed``."""
    return {"deepspeed": DeepSpeedStrategy}
