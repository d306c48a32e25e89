"""Training strategy ``accelerate``: one process, DDP, or FSDP2, on top of 🤗 Accelerate.

Accelerate owns what it does well: process-group start-up from any launcher
(``torchrun``, ``accelerate launch``, SLURM), device placement, DDP wrapping
and seeding. Two things are deliberately kept out of its hands:

* **Mixed precision.** Accelerate implements it by patching ``model.forward``
  and stores the precision in a process-wide singleton that cannot change
  afterwards, so an SFT stage in fp32 followed by an RL stage in bf16 (or a
  policy and a critic with different settings) would fail in one process. Here
  :meth:`AccelerateStrategy.autocast` is an explicit ``torch.autocast`` context
  and fp16 uses a ``torch.amp.GradScaler`` owned by the strategy.
* **FSDP.** Accelerate's FSDP plugin does not shard across CPU processes; we
  apply torch's FSDP2 (``torch.distributed.fsdp.fully_shard``) directly, one
  unit per transformer block (the model's ``_no_split_modules``) plus the root.

Launch, e.g. on CPU: ``torchrun --nproc_per_node 2 recipe.py`` (gloo). On CPU,
``accelerate launch --cpu --num_processes 2`` silently starts a single process;
use ``torchrun`` or ``accelerate launch --multi_gpu``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

import rltk
from rltk.distributed import start_loopback_process_group
from rltk.errors import ConfigError
from rltk.models.lora import adapter_live_names
from rltk.models.sharding import rebuild_module, weightless_copy
from rltk.strategies.base import (
    GRAD_SCALER_FILE, MODEL_SUBDIR, OPTIMIZER_FILE, SCHEDULER_FILE, STRATEGY_META_FILE, OptimizerSettings,
    TrainingStrategy, build_adamw, build_lr_scheduler, check_mixed_precision, load_optimizer_state_by_name,
    load_weights_only, optimizer_state_by_name, read_strategy_meta,
)
from rltk.models.folders import full_cpu_copy, load_full_state_into, load_model_folder, save_model_folder
from rltk.models.parallel.expert_parallel import unsharded_copy
from rltk.strategies.expert_parallel import ExpertParallelism, check_expert_parallel_size
from rltk.strategies.layout import ParallelLayout
from rltk.strategies.regroup import regroup_saved_state

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "rltk-accelerate-v1"


class AccelerateStrategy(TrainingStrategy):
    """Data-parallel training with 🤗 Accelerate: single process, DDP or FSDP2.

    Args:
        mixed_precision: ``"no"`` (fp32), ``"bf16"`` (CPU or Ampere+ GPU) or
            ``"fp16"`` (CUDA only, with dynamic loss scaling). Parameters and
            optimizer state stay fp32; only forward passes inside
            :meth:`autocast` run in the lower precision.
        cpu: force CPU (``True``) or accelerator (``False``); ``None`` picks CUDA
            when available.
        seed: if given, seeds python ``random``, numpy and torch (all devices)
            with the same value on every rank at construction. Leave ``None`` when
            the recipe seeds itself, or for a second strategy in one process
            (e.g. a critic), which would otherwise reset the RNG mid-run.
        fsdp: shard parameters, gradients and optimizer state with FSDP2 when
            more than one process runs (with one process there is nothing to
            shard and this is plain training).
        sequence_parallel_size: ranks that split every row's tokens (Ulysses: attention exchanges heads
            by all-to-all, :mod:`rltk.models.parallel.sequence`); not with tensor or expert parallelism yet.
        expert_parallel_size: split a mixture of experts' experts over this
            many consecutive ranks, tokens sent to them by all-to-all
            (:mod:`rltk.strategies.expert_parallel`; with DDP, not FSDP2).
        tensor_parallel_size: ranks that split every layer's weights (DTensor tensor parallelism,
            :mod:`rltk.models.parallel.tensor_parallel`), consecutive ranks forming a group; the
            ``world_size / tensor_parallel_size`` data-parallel ranks shard with FSDP2 over the other
            dimension of a 2-D mesh (``fsdp=True`` is then required). Not with expert parallelism.
        Each size must divide the process count (:class:`rltk.strategies.layout.ParallelLayout`).
    """

    built_parallel_sizes = frozenset({"sequence_parallel_size", "tensor_parallel_size", "expert_parallel_size"})

    def __init__(self, *, mixed_precision: str = "no", cpu: bool | None = None, seed: int | None = None,
                 fsdp: bool = False, sequence_parallel_size: int = 1, tensor_parallel_size: int = 1,
                 expert_parallel_size: int = 1):
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        if cpu is not None and not isinstance(cpu, bool):
            raise TypeError(f"AccelerateStrategy: cpu={cpu!r} must be True, False or None (auto).")
        if not isinstance(fsdp, bool):
            raise TypeError(f"AccelerateStrategy: fsdp={fsdp!r} must be True or False.")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"AccelerateStrategy: seed={seed!r} must be an integer or None.")
        if cpu is None:
            cpu = not torch.cuda.is_available()
        # mixed_precision="no": Accelerate must not patch forward (see module docstring).
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            start_loopback_process_group()  # before Accelerate starts one listening on every interface
        self.accelerator = accelerator = Accelerator(cpu=cpu, mixed_precision="no")
        self._device, self._rank = accelerator.device, accelerator.process_index
        self._world_size = accelerator.num_processes
        if check_expert_parallel_size(expert_parallel_size) > 1 and fsdp:  # before the sizes meet the world
            raise ConfigError(f"strategy_args.expert_parallel_size={expert_parallel_size} with "
                              "strategy_args.fsdp=true: expert parallelism runs with DDP here; set fsdp=false")
        self._init_layout(sequence_parallel_size=sequence_parallel_size, tensor_parallel_size=tensor_parallel_size,
                          expert_parallel_size=expert_parallel_size)
        self.mixed_precision = mixed_precision
        self._autocast_dtype = check_mixed_precision(mixed_precision, self.accelerator.device)
        self._grad_scaler = (
            torch.amp.GradScaler(self.accelerator.device.type) if self._autocast_dtype == torch.float16 else None
        )
        self.fsdp = fsdp
        _check_combinations(self.layout, fsdp)
        if tensor_parallel_size > 1 and expert_parallel_size > 1:
            raise ConfigError(f"strategy_args.tensor_parallel_size={tensor_parallel_size} with "
                              f"strategy_args.expert_parallel_size={expert_parallel_size}: the two do not combine "
                              "yet; set one of them to 1")
        self._experts = None  # ExpertParallelism when expert_parallel_size > 1
        if expert_parallel_size > 1:
            self._experts = ExpertParallelism(expert_parallel_size, self._world_size, self._rank)
        self.seed = seed
        if seed is not None:
            set_seed(seed)
        self._model: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self._sharded = False
        self._skeleton: nn.Module | None = None  # FSDP2: the model's structure, parameters on "meta"
        self._released = False
        self.skipped_steps = 0

    # ---------------------------------------------------------------- setup

    def _setup(self, model: nn.Module, settings: OptimizerSettings) -> None:
        if self.layout.sequence_parallel_size > 1:
            from rltk.models.parallel.sequence import check_heads_divide

            check_heads_divide(model, self.layout.sequence_parallel_size)
        if self.layout.tensor_parallel_size > 1:
            from rltk.models.lora import is_lora_model

            if is_lora_model(model):  # what the config check says (rltk.config.validation), for direct callers
                raise ConfigError(f"strategy_args.tensor_parallel_size={self.layout.tensor_parallel_size} with a "
                                  "LoRA model: LoRA adapters are not tensor-parallel; train them with "
                                  "strategy_args.tensor_parallel_size=1")
            self._skeleton = weightless_copy(model)
            model = self._shard_tensor_parallel(model)
            self._sharded = True
        elif self.fsdp and self.world_size > 1:
            # fully_shard swaps the module's class and parameters in place: keep its structure
            # (no memory) to build plain copies from (full_model_copy, release_model).
            self._skeleton = weightless_copy(model)
            model = self._shard(model)
            self._sharded = True
        else:
            if self._experts is not None:
                self._experts.shard(model.to(self.device))
            # Moves to the device and wraps in DDP when several processes run.
            model = self.accelerator.prepare_model(model)
        # The optimizer is built after wrapping: FSDP2 replaced the parameters by DTensors.
        self._model = model
        self._optimizer = build_adamw(model, settings)
        if self.layout.tensor_parallel_size > 1:
            split_groups_by_mesh(self._optimizer)
        self._scheduler = build_lr_scheduler(self._optimizer, settings)

    def _shard(self, model: nn.Module) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model.to(self.device)
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        block_classes = set(getattr(model, "_no_split_modules", None) or [])
        for module in model.modules():
            if module is not model and type(module).__name__ in block_classes:
                fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    def _shard_tensor_parallel(self, model: nn.Module) -> nn.Module:
        """Tensor parallel over the mesh's ``tp`` dimension, then FSDP2 over ``dp`` (2-D) when it has several ranks.
        A tied head is in the root unit with its embedding (one unit owns the shared matrix)."""
        from torch.distributed.fsdp import fully_shard

        from rltk.models.parallel.tensor_parallel import apply_tensor_parallel

        model.to(self.device)
        mesh = self.layout.device_mesh(self.device.type)
        apply_tensor_parallel(model, mesh["tp"])
        if self.layout.data_world_size > 1:
            block_classes = set(getattr(model, "_no_split_modules", None) or [])
            for module in model.modules():
                if module is not model and type(module).__name__ in block_classes:
                    fully_shard(module, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
        return model

    # ---------------------------------------------------------------- properties

    @property
    def model(self) -> nn.Module:
        self._require_setup("model")
        return self._model

    @property
    def loss_scale(self) -> float | None:
        """The current fp16 loss scale (``None`` unless ``mixed_precision="fp16"``)."""
        return float(self._grad_scaler.get_scale()) if self._grad_scaler is not None else None

    @property
    def sharded(self) -> bool:
        """True when FSDP2 shards the model (``fsdp=True`` and more than one process)."""
        return self._sharded

    @property
    def shards_parameters(self) -> bool:
        """True under FSDP2 with several processes (every forward all-gathers parameters) or expert
        parallelism (every forward exchanges tokens)."""
        return self._sharded or self._experts is not None

    # ---------------------------------------------------------------- training

    def autocast(self) -> contextlib.AbstractContextManager:
        """``torch.autocast`` in bf16/fp16 when configured, else a no-op context."""
        if self._autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self._autocast_dtype)

    @contextlib.contextmanager
    def accumulate(self, is_last_micro_batch: bool) -> Iterator[None]:
        """Skip the gradient all-reduce (DDP ``no_sync``) or reduce-scatter (FSDP2) before the last micro-batch.

        Gradients of earlier micro-batches accumulate locally and are synchronised
        once, together with the last one.
        """
        self._require_setup("accumulate()")
        if is_last_micro_batch or self.world_size == 1:
            yield
        elif hasattr(self._model, "set_requires_gradient_sync"):  # FSDP2 (tensor parallel alone has no sync)
            self._model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self._model.set_requires_gradient_sync(True)
        elif isinstance(self._model, nn.parallel.DistributedDataParallel):
            with self._model.no_sync():
                yield
        else:
            yield

    def backward(self, loss: torch.Tensor) -> None:
        """``(loss * world_size).backward()``, loss-scaled under fp16.

        ``loss`` is this rank's share of a globally normalised sum; DDP and FSDP
        average gradients over ranks, the factor ``world_size`` turns that average
        back into the sum, so the result equals one process on the global batch.
        """
        self._require_setup("backward()")
        # the factor is the number of ranks the gradient sync averages over: every rank under DDP/FSDP (a
        # sequence group's ranks each hold their tokens' share of one loss), the data-parallel ranks under
        # tensor parallelism (FSDP2 over the mesh's dp dimension; a tensor group shares its rows and gradients)
        scaled = loss * (self.layout.data_world_size if self.layout.tensor_parallel_size > 1 else self.world_size)
        if self._grad_scaler is not None:
            scaled = self._grad_scaler.scale(scaled)
        self.accelerator.backward(scaled)

    def step(self) -> dict[str, float]:
        """Clip to ``grad_clip``, AdamW step, schedule step, zero gradients.

        A non-finite gradient norm (an inf/NaN anywhere, e.g. an fp16 overflow)
        skips the update: gradients are dropped, the schedule does not advance,
        the fp16 loss scale shrinks, and ``skipped`` is 1. Under fp16 the result
        also holds ``loss_scale``, and ``grad_norm`` is of the unscaled gradients.
        """
        self._require_setup("step()")
        lr = self.current_lr
        if self._grad_scaler is not None:
            self._grad_scaler.unscale_(self._optimizer)
        if self._experts is not None:
            norm = self._experts.reduce_and_clip(list(self._model.parameters()), self.settings.clip_norm)
        elif self.layout.tensor_parallel_size > 1:
            norm = clip_mixed_grad_norm_(self._model.parameters(), self.settings.clip_norm)
        else:
            norm = torch.nn.utils.clip_grad_norm_(self._model.parameters(), self.settings.clip_norm)
        grad_norm = float(full_cpu_copy(norm))  # FSDP2 returns a DTensor norm
        skipped = not math.isfinite(grad_norm)
        if skipped:
            self.skipped_steps += 1
            logger.warning("optimizer step %d skipped: gradient norm is %s (%d skipped so far)",
                           self.optimizer_steps + 1, grad_norm, self.skipped_steps)
            if self._grad_scaler is not None:
                self._grad_scaler.update()  # an overflow: lower the loss scale for the next step
        else:
            if self._grad_scaler is not None:
                self._grad_scaler.step(self._optimizer)
                self._grad_scaler.update()
            else:
                self._optimizer.step()
            self._scheduler.step()
        self._optimizer.zero_grad(set_to_none=True)
        info = {"grad_norm": grad_norm, "lr": lr, "skipped": float(skipped)}
        if self._grad_scaler is not None:
            info["loss_scale"] = self.loss_scale
        return info

    # ---------------------------------------------------------------- weights

    def unwrap(self) -> nn.Module:
        """The model without DDP (FSDP2 modules stay sharded in place: use :meth:`full_state_dict`)."""
        self._require_setup("unwrap()")
        # Not accelerator.unwrap_model: it imports DeepSpeed when installed (~2 s) to check for its engine.
        module = self._model
        while True:
            if isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
                module = module.module
            elif isinstance(getattr(module, "_orig_mod", None), nn.Module):  # torch.compile wrapper
                module = module._orig_mod
            else:
                return module

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full CPU copies of all weights on every rank (FSDP2: all-gathers each shard)."""
        self._require_setup("full_state_dict()")
        return {name: full_cpu_copy(tensor) for name, tensor in self.unwrap().state_dict(keep_vars=True).items()}

    def full_model_copy(self) -> nn.Module:
        """A plain module with the current weights, on :attr:`device`. Collective under FSDP2.

        FSDP2 has made the module's parameters shards, so the copy is rebuilt
        from the structure taken at setup and :meth:`full_state_dict`; without
        FSDP2 it is a deep copy of :meth:`unwrap`.
        """
        if self._experts is not None:
            self._require_setup("full_model_copy()")
            return unsharded_copy(self.unwrap())
        if not self._sharded:
            return super().full_model_copy()
        self._require_setup("full_model_copy()")
        return rebuild_module(self._skeleton, self.full_state_dict(), buffers_from=self.unwrap(), device=self.device,
                              original_dtypes=True)

    def release_model(self) -> nn.Module:
        """The model as a plain module, for the next stage's strategy. Collective under FSDP2.

        Under FSDP2 a new module with the gathered weights (the sharded one
        cannot be sharded again); otherwise :meth:`unwrap`. The weights are
        fp32 either way (autocast keeps fp32 master weights).
        """
        if not self._sharded and self._experts is None:
            return super().release_model()
        module = self.full_model_copy()
        self._model = self._optimizer = self._scheduler = self._skeleton = None
        self._released = True
        return module

    def _require_setup(self, what: str) -> None:
        super()._require_setup(what)
        if self._released:
            raise RuntimeError(f"AccelerateStrategy.{what}: this strategy handed its model back with release_model(); "
                               "build a new strategy on the released module.")

    # ---------------------------------------------------------------- checkpoints

    def save(self, directory: str | Path) -> None:
        """Write ``model/`` (safetensors), ``optimizer.pt``, ``scheduler.pt`` and ``strategy.json``.

        With LoRA ``model/`` is a peft adapter folder and the optimizer state
        covers the adapter only (nothing else trains).

        Weights and optimizer state are full (unsharded) and keyed by parameter
        name, so a checkpoint resumes under any process count, with or without
        FSDP. The main rank writes; every rank must call (gathers are collective)
        and returns after a barrier.
        """
        self._require_setup("save()")
        directory = Path(directory)
        # LoRA: the adapter alone (the frozen base is rebuilt from the run's config); the same names on
        # every rank, so FSDP2's gathers stay collective.
        keep = adapter_live_names(self.unwrap())
        weights = {name: full_cpu_copy(tensor) for name, tensor in self.unwrap().state_dict(keep_vars=True).items()
                   if keep is None or name in keep}
        optimizer_state = optimizer_state_by_name(self._optimizer, self.unwrap())
        if self.is_main:
            directory.mkdir(parents=True, exist_ok=True)
            save_model_folder(self.unwrap(), weights, directory / MODEL_SUBDIR)
            torch.save(optimizer_state, directory / OPTIMIZER_FILE)
            torch.save(self._scheduler.state_dict(), directory / SCHEDULER_FILE)
            if self._grad_scaler is not None:
                torch.save(self._grad_scaler.state_dict(), directory / GRAD_SCALER_FILE)
            meta = {"format": CHECKPOINT_FORMAT, **self.describe()}
            (directory / STRATEGY_META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        self.barrier()

    def load(self, directory: str | Path) -> None:
        """Restore weights, optimizer, schedule (and fp16 loss scale) written by :meth:`save`.

        The optimizer's hyper-parameters and the schedule's position and base
        learning rate come from the checkpoint; the schedule's shape
        (warm-up, decay, total steps) from this strategy's ``setup``. Every rank
        reads the files (they must be on a file system all ranks see); nothing is
        unpickled beyond tensors and plain containers.
        """
        self._require_setup("load()")
        directory = Path(directory)
        read_strategy_meta(directory, "AccelerateStrategy", CHECKPOINT_FORMAT,
                           otherwise="export its model folder and start from that")
        load_full_state_into(self.unwrap(), load_model_folder(directory / MODEL_SUBDIR), directory / MODEL_SUBDIR)
        # a checkpoint of another layout groups the same parameters otherwise (tensor parallelism splits groups)
        saved, schedule = regroup_saved_state(
            self._optimizer, self.unwrap(), load_weights_only(directory / OPTIMIZER_FILE),
            load_weights_only(directory / SCHEDULER_FILE), directory / OPTIMIZER_FILE)
        load_optimizer_state_by_name(self._optimizer, self.unwrap(), saved, directory / OPTIMIZER_FILE)
        self._scheduler.load_state_dict(schedule)
        if self._grad_scaler is not None and (directory / GRAD_SCALER_FILE).exists():
            self._grad_scaler.load_state_dict(load_weights_only(directory / GRAD_SCALER_FILE))
        self.barrier()

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "mixed_precision": self.mixed_precision,
            "fsdp": self._sharded,
            "expert_parallel_size": self._experts.size if self._experts is not None else 1,
            # what wrote the checkpoint; any layout resumes it (tensors by name, groups by regroup_saved_state)
            "sequence_parallel_size": self.layout.sequence_parallel_size,
            "tensor_parallel_size": self.layout.tensor_parallel_size,
        }


def _check_combinations(layout: ParallelLayout, fsdp: bool) -> None:
    """ConfigError for the parallel sizes that do not combine here: sequence parallel with tensor or expert
    parallel (not built together), or tensor parallel over several data-parallel ranks without FSDP2 (DDP
    takes no DTensor parameters)."""
    sp, tp, ep = layout.sequence_parallel_size, layout.tensor_parallel_size, layout.expert_parallel_size
    for other, size in (("tensor_parallel_size", tp), ("expert_parallel_size", ep)):
        if sp > 1 and size > 1:
            raise ConfigError(f"strategy_args.sequence_parallel_size={sp} with strategy_args.{other}={size}: the "
                              "two do not combine yet; set one of them to 1")
    if tp > 1 and layout.data_world_size > 1 and not fsdp:
        raise ConfigError(
            f"strategy_args.tensor_parallel_size={tp} over {layout.world_size} processes leaves "
            f"{layout.data_world_size} data-parallel ranks, which shard with FSDP2 on the 2-D mesh: set "
            "strategy_args.fsdp=true (DDP takes no tensor-parallel parameters)")


def split_groups_by_mesh(optimizer: torch.optim.Optimizer) -> None:
    """Split each parameter group of a not yet stepped ``optimizer`` into one group per device mesh (plain
    tensors: one more), in place: a fused or foreach update takes tensors of one kind only, and tensor
    parallelism leaves DTensors on the tp mesh, FSDP2 shards on others and replicated plain tensors side by side."""
    groups = []
    for group in optimizer.param_groups:
        by_mesh: dict[Any, list[torch.Tensor]] = {}
        for param in group["params"]:
            by_mesh.setdefault(getattr(param, "device_mesh", None), []).append(param)
        groups.extend({**group, "params": params} for params in by_mesh.values())
    optimizer.param_groups[:] = groups


def clip_mixed_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` over parameters on different device meshes (tensor-parallel DTensors, FSDP2 shards on
    the data-parallel mesh, replicated plain tensors), whose norms torch's one foreach call cannot mix: each
    gradient's norm made whole (a DTensor's over its mesh), then one scale for all. Returns the total norm."""
    grads = [p.grad for p in parameters if p.grad is not None]
    squares = [full_cpu_copy(torch.linalg.vector_norm(g.detach(), dtype=torch.float32)).double() ** 2 for g in grads]
    total = torch.stack(squares).sum().sqrt() if squares else torch.zeros((), dtype=torch.float64)
    scale = max_norm / (float(total) + 1e-6)
    if scale < 1.0:
        for g in grads:
            g.detach().mul_(scale)
    return total.float()


@rltk.hookimpl
def rltk_training_strategies():
    return {"accelerate": AccelerateStrategy}
