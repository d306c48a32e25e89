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

How rltk's settings map onto the DeepSpeed config (see :func:`derive_deepspeed_config`)::

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
``scheduler``, accumulation) are refused with the reason.

Launching: ``torchrun --nproc_per_node N recipe.py``, ``deepspeed
--num_gpus N recipe.py`` (or ``--hostfile`` for several nodes). The
``deepspeed`` launcher appends ``--local_rank=N`` to the script's arguments;
:func:`strip_local_rank_argument` removes it before argument parsing. A plain
``python recipe.py`` runs one process: the rendezvous variables are filled in
with a free local port.

Checkpoints (:meth:`DeepSpeedStrategy.save`) hold DeepSpeed's own sharded
checkpoint (``deepspeed/``, one optimizer shard per rank, read back by
DeepSpeed's loader) plus, by default, the full fp32 weights as a plain Hugging
Face folder (``model/``, safetensors) that :func:`export_model_folder` copies and
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
then (see :func:`check_resumable`).

Loading never unpickles freely. DeepSpeed's readers call ``torch.load(...,
weights_only=False)``, so every read of its files (resume, universal
conversion, export) runs inside
:func:`rltk.serialization.weights_only_everywhere` with
:func:`deepspeed_checkpoint_globals` as the only classes allowed beyond
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
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

import rltk
from rltk.distributed import free_local_port, seed_everything
from rltk.models.lora import adapter_live_names, is_lora_model
from rltk.models.sharding import rebuild_module, weightless_copy
from rltk.registry import unknown_name_message
from rltk.serialization import check_torch_files, weights_only_everywhere
from rltk.strategies.base import (
    MIXED_PRECISION_MODES,
    MODEL_SUBDIR,
    STRATEGY_META_FILE,
    OptimizerSettings,
    TrainingStrategy,
    build_adamw,
    build_lr_scheduler,
    check_mixed_precision,
)
from rltk.models.folders import load_model_folder, save_model_folder

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "rltk-deepspeed-v1"
DEEPSPEED_SUBDIR = "deepspeed"
UNIVERSAL_SUBDIR = "deepspeed_universal"
MODEL_CONFIG_SUBDIR = "model_config"  # config.json etc. when save_full_weights=False
CHECKPOINT_TAG = "state"
ZERO_STAGES = (1, 2, 3)

# Keys rltk owns: a raw DeepSpeed config may not set them (other than to "auto" or rltk's own value).
_RLTK_OWNED_KEYS = {
    "optimizer": "rltk passes its own torch AdamW, built from setup(lr=..., betas=..., eps=..., weight_decay=...)",
    "scheduler": "rltk passes its own LambdaLR, built from setup(warmup_steps=..., lr_schedule=..., min_lr_ratio=...)",
}
_FIXED_KEYS = {
    "gradient_accumulation_steps": (1, "rltk accumulates micro-batches itself: every backward() before step() "
                                       "accumulates, step() ends the accumulation"),
    "managed_gradient_accumulation": (False, "rltk, not DeepSpeed's micro-step counter, decides when a step ends"),
}


# --------------------------------------------------------------------------
# Launch environment
# --------------------------------------------------------------------------


def ensure_single_process_environment() -> None:
    """Fill in the rendezvous variables for a process started without a launcher.

    ``torchrun`` and the ``deepspeed`` launcher export ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``;
    ``deepspeed.init_distributed`` needs them even for one process. When none of
    ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` is set (and no MPI launcher is
    detected), this sets a one-process world on ``127.0.0.1`` with a free port.
    A partly set environment is an error naming what is missing.
    """
    rank_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    present = [name for name in rank_vars if name in os.environ]
    if not present:
        if "OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ:
            return  # MPI launch: deepspeed.init_distributed discovers ranks itself
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_local_port()))
        return
    missing = [name for name in (*rank_vars, "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if "LOCAL_RANK" in missing and os.environ.get("WORLD_SIZE") == "1":
        os.environ["LOCAL_RANK"] = "0"
        missing.remove("LOCAL_RANK")
    if os.environ.get("WORLD_SIZE") == "1":
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_ADDR" in missing:
            missing.remove("MASTER_ADDR")
        if "MASTER_PORT" in missing:
            os.environ["MASTER_PORT"] = str(free_local_port())
            missing.remove("MASTER_PORT")
    if missing:
        raise RuntimeError(
            f"DeepSpeedStrategy: the distributed environment is incomplete: {', '.join(present)} "
            f"{'is' if len(present) == 1 else 'are'} set but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not. Start the script with a launcher "
            "(`torchrun --nproc_per_node N script.py` or `deepspeed --num_gpus N script.py`), or unset "
            "RANK/WORLD_SIZE/LOCAL_RANK to run a single process."
        )


# --------------------------------------------------------------------------
# The DeepSpeed config
# --------------------------------------------------------------------------


def derive_deepspeed_config(*, zero_stage: int, offload_optimizer: bool, offload_params: bool,
                            mixed_precision: str, grad_clip: float | None, world_size: int,
                            pin_memory: bool = False) -> dict[str, Any]:
    """The DeepSpeed config rltk derives from its own settings (mapping in the module docstring).

    ``pin_memory`` pins offloaded CPU buffers for faster host-device copies;
    it only helps (and is only allowed) with a GPU.
    """
    zero: dict[str, Any] = {"stage": zero_stage}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin_memory}
    if offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin_memory}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "train_batch_size": world_size,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": float(grad_clip) if grad_clip else 0.0,
        "zero_optimization": zero,
        "bf16": {"enabled": mixed_precision == "bf16"},
        # loss_scale 0 = dynamic loss scaling; an overflow skips the step and halves the scale.
        "fp16": {"enabled": mixed_precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        "wall_clock_breakdown": False,
    }
    if offload_optimizer or offload_params:
        # Without this DeepSpeed replaces the torch AdamW by its CPU Adam (a 1-2 minute compile).
        config["zero_force_ds_cpu_optimizer"] = False
    return config


def read_deepspeed_config(config: str | Path | Mapping | None) -> dict[str, Any]:
    """A raw DeepSpeed config as a plain dict: from a JSON file path, a mapping (or OmegaConf node), or ``{}``."""
    if config is None:
        return {}
    if isinstance(config, (str, Path)):
        path = Path(config)
        if not path.is_file():
            raise FileNotFoundError(f"DeepSpeedStrategy: config='{path}' is not a file; pass the path of a "
                                    "DeepSpeed JSON config, a dict, or None.")
        try:
            loaded = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"DeepSpeedStrategy: config file '{path}' is not valid JSON: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ValueError(f"DeepSpeedStrategy: config file '{path}' must hold a JSON object, "
                             f"got {type(loaded).__name__}.")
        return loaded
    if hasattr(config, "_metadata") and hasattr(config, "_content"):  # an OmegaConf DictConfig
        from omegaconf import OmegaConf

        return OmegaConf.to_container(config, resolve=True)
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    raise TypeError(f"DeepSpeedStrategy: config={config!r} must be a path to a DeepSpeed JSON file, a dict, "
                    "or None.")


def merge_deepspeed_config(derived: dict[str, Any], user: dict[str, Any], path: str = "") -> dict[str, Any]:
    """``user`` merged over ``derived``, recursively; a user value ``"auto"`` keeps the derived one.

    Raises for a key rltk owns (``optimizer``, ``scheduler``, accumulation
    settings other than rltk's), and for ``"auto"`` where rltk has nothing to
    fill in, naming the key path.
    """
    merged = copy.deepcopy(derived)
    for key, value in user.items():
        where = f"{path}{key}"
        if not path and key in _RLTK_OWNED_KEYS:
            raise ValueError(f"DeepSpeed config key '{where}' is not allowed: {_RLTK_OWNED_KEYS[key]}. "
                             f"Remove '{where}' from the DeepSpeed config.")
        if not path and key in _FIXED_KEYS and value != "auto" and value != _FIXED_KEYS[key][0]:
            required, reason = _FIXED_KEYS[key]
            raise ValueError(f"DeepSpeed config key '{where}'={value!r} is not supported: {reason}. "
                             f"Remove it or set it to {json.dumps(required)}.")
        if value == "auto":
            if key not in derived:
                raise ValueError(f"DeepSpeed config key '{where}' is \"auto\" but rltk derives no value for it; "
                                 f"set it explicitly. rltk fills in: {', '.join(sorted(derived))}.")
            continue
        if isinstance(value, Mapping) and isinstance(derived.get(key), Mapping):
            merged[key] = merge_deepspeed_config(dict(derived[key]), dict(value), f"{where}.")
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def summarize_deepspeed_config(config: dict[str, Any]) -> dict[str, Any]:
    """The settings rltk reads back from a merged DeepSpeed config: ZeRO stage, offload, precision."""
    zero = config.get("zero_optimization") or {}

    def offloaded(section: str) -> bool:
        return (zero.get(section) or {}).get("device", "none") not in (None, "none")

    bf16 = bool((config.get("bf16") or {}).get("enabled"))
    fp16 = bool((config.get("fp16") or {}).get("enabled"))
    return {
        "zero_stage": zero.get("stage"),
        "offload_optimizer": offloaded("offload_optimizer"),
        "offload_params": offloaded("offload_param"),
        "mixed_precision": "bf16" if bf16 else "fp16" if fp16 else "no",
        "both_precisions": bf16 and fp16,
    }


def resolve_deepspeed_config(*, zero_stage: int, offload_optimizer: bool, offload_params: bool,
                             mixed_precision: str, user_config: dict[str, Any], world_size: int,
                             device: torch.device) -> dict[str, Any]:
    """Derive rltk's DeepSpeed config, merge ``user_config`` over it and check the result.

    The ``gradient_clipping`` placeholder is filled in by ``setup(grad_clip=...)``
    unless ``user_config`` sets it. Raises ``ValueError`` naming the DeepSpeed key
    and what is valid for: a ZeRO stage other than 1-3, parameter offload below
    ZeRO-3, bf16 and fp16 together, a precision the device cannot run, and a
    ``train_batch_size`` that DeepSpeed would reject.
    """
    config = merge_deepspeed_config(
        derive_deepspeed_config(zero_stage=zero_stage, offload_optimizer=offload_optimizer,
                                offload_params=offload_params, mixed_precision=mixed_precision, grad_clip=None,
                                world_size=world_size, pin_memory=device.type == "cuda"),
        user_config,
    )
    summary = summarize_deepspeed_config(config)
    stage = summary["zero_stage"]
    if isinstance(stage, bool) or stage not in ZERO_STAGES:
        raise ValueError(f"DeepSpeed config key 'zero_optimization.stage'={stage!r} is invalid; valid: 1, 2, 3 "
                         "(for plain data parallelism use training_strategy=accelerate).")
    if summary["offload_params"] and stage != 3:
        raise ValueError(
            f"offload_params=True (DeepSpeed key 'zero_optimization.offload_param.device') needs zero_stage=3, "
            f"got zero_stage={stage}: only ZeRO-3 partitions parameters. Use offload_optimizer=True with "
            "ZeRO-1/2, or zero_stage=3."
        )
    if summary["both_precisions"]:
        raise ValueError("DeepSpeed config enables both 'bf16.enabled' and 'fp16.enabled'; choose one "
                         "(mixed_precision='bf16' or 'fp16').")
    check_mixed_precision(summary["mixed_precision"], device)
    micro = config.get("train_micro_batch_size_per_gpu")
    if isinstance(micro, bool) or not isinstance(micro, int) or micro < 1:
        raise ValueError(f"DeepSpeed config key 'train_micro_batch_size_per_gpu'={micro!r} must be an integer >= 1.")
    expected = micro * world_size  # gradient_accumulation_steps is always 1
    if "train_batch_size" in user_config and user_config["train_batch_size"] != "auto":
        if config["train_batch_size"] != expected:
            raise ValueError(
                f"DeepSpeed config key 'train_batch_size'={config['train_batch_size']!r} must equal "
                f"train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size = {micro} x 1 x "
                f"{world_size} = {expected}; rltk does not use DeepSpeed's data loader, so remove it or set it "
                "to \"auto\"."
            )
    config["train_batch_size"] = expected
    return config


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
    def device(self) -> torch.device:
        return self._device

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch AdamW; under ZeRO its parameters are DeepSpeed's flat fp32 partitions of this rank."""
        self._require_setup("optimizer")
        return self._optimizer

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LambdaLR:
        self._require_setup("scheduler")
        return self._scheduler

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
        """The base summary plus ZeRO stage, offload, precision and optimizer steps (in ``strategy.json``)."""
        return {
            **super().describe(),
            "zero_stage": self.zero_stage,
            "offload_optimizer": self.offload_optimizer,
            "offload_params": self.offload_params,
            "mixed_precision": self.mixed_precision,
            "optimizer_steps": self.optimizer_steps if self.settings else 0,
        }


# --------------------------------------------------------------------------
# Checkpoint conversion and export (no process group needed)
# --------------------------------------------------------------------------


def read_checkpoint_meta(directory: str | Path) -> dict[str, Any]:
    """``strategy.json`` of a checkpoint written by :meth:`DeepSpeedStrategy.save`, checked."""
    directory = Path(directory)
    meta_path = directory / STRATEGY_META_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(f"'{directory}' has no {STRATEGY_META_FILE}: it is not a checkpoint written by "
                                "DeepSpeedStrategy.save() (or it is incomplete).")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(
            f"checkpoint '{directory}' has format {meta.get('format')!r} (strategy {meta.get('strategy')!r}); "
            f"DeepSpeedStrategy reads {CHECKPOINT_FORMAT!r}. Resume with the strategy that wrote it, or start "
            f"from its exported model folder '{directory / MODEL_SUBDIR}'."
        )
    tag = meta.setdefault("tag", CHECKPOINT_TAG)
    # DeepSpeed joins the tag to the checkpoint folder: a path in it would read files from elsewhere.
    if not isinstance(tag, str) or not tag or tag in (".", "..") or "/" in tag or "\\" in tag:
        raise ValueError(f"checkpoint '{directory}' names DeepSpeed tag {tag!r} in {STRATEGY_META_FILE}; a tag is "
                         f"a plain folder name under '{DEEPSPEED_SUBDIR}/' (rltk writes {CHECKPOINT_TAG!r}).")
    return meta


def deepspeed_checkpoint_globals() -> list[Any]:
    """The classes DeepSpeed 0.19 pickles into its checkpoint files besides tensors and plain data.

    Measured on ZeRO-1/2/3 checkpoints (fp32, bf16, CPU offload) and their
    universal conversions: the loss scaler (static, or dynamic under fp16), the
    ZeRO stage enum, and ZeRO-1/2's fragment addresses. Each only stores the
    values it is built with, so constructing one from a file runs no code of
    the file's choosing. A newer DeepSpeed that pickles another class fails to
    resume with an error naming that class, never by loading it unchecked.
    """
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def save_model_config(module: nn.Module, directory: Path) -> None:
    """Write a Hugging Face model's ``config.json`` (and generation config) without its weights.

    Modules without a Hugging Face config leave ``directory`` empty.
    """
    directory.mkdir(parents=True, exist_ok=True)
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return
    config = copy.deepcopy(config)
    config.architectures = [type(module).__name__]  # what save_pretrained records, so AutoModel finds it
    config.save_pretrained(directory)
    generation_config = getattr(module, "generation_config", None)
    if generation_config is not None and hasattr(generation_config, "save_pretrained"):
        generation_config.save_pretrained(directory)


def check_resumable(meta: dict[str, Any], zero_stage: int, directory: str | Path) -> None:
    """Raise unless a checkpoint described by ``meta`` can resume under ``zero_stage``.

    Measured with DeepSpeed 0.19 (universal checkpoints, any process counts):
    ZeRO-1 <-> ZeRO-2 and ZeRO-3 -> ZeRO-3 resume with weights, Adam moments
    and schedule; between ZeRO-1/2 and ZeRO-3 (either way) the converted
    checkpoint does not load, because ZeRO-3 keeps one model-state file per
    rank and ZeRO-1/2 a single one.
    """
    saved = meta.get("zero_stage")
    if saved is not None and (saved == 3) != (zero_stage == 3):
        raise ValueError(
            f"checkpoint '{directory}' was written under ZeRO-{saved} and cannot resume under ZeRO-{zero_stage}: "
            "DeepSpeed converts checkpoints between process counts and between ZeRO-1 and ZeRO-2, but not "
            f"between ZeRO-1/2 and ZeRO-3. Resume with zero_stage={saved}"
            f"{' (or the other of 1 and 2)' if saved != 3 else ''}, or start a new run from the full weights in "
            f"'{Path(directory) / MODEL_SUBDIR}' (the optimizer state starts fresh then)."
        )


def convert_to_universal(deepspeed_dir: str | Path, output_dir: str | Path, *, tag: str = CHECKPOINT_TAG) -> Path:
    """Convert DeepSpeed's sharded checkpoint into a universal checkpoint (``ds_to_universal``).

    A universal checkpoint stores every parameter's fp32 weight and Adam moments
    whole, so it loads under any number of processes and any ZeRO stage. Runs
    in this process only (no process group); returns ``output_dir``.
    """
    import argparse

    from deepspeed.checkpoint import ds_to_universal

    deepspeed_dir, output_dir = Path(deepspeed_dir), Path(output_dir)
    if not (deepspeed_dir / tag).is_dir():
        raise FileNotFoundError(f"no DeepSpeed checkpoint '{deepspeed_dir / tag}' to convert.")
    allowed = deepspeed_checkpoint_globals()
    check_torch_files(deepspeed_dir / tag, allowed_globals=allowed)
    # Convert beside the target and rename at the end: a conversion killed half-way is never mistaken
    # for a finished one.
    staging = output_dir.with_name(output_dir.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    args = argparse.Namespace(
        input_folder=str(deepspeed_dir / tag), output_folder=str(staging / tag), num_extract_workers=1,
        num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=False,
    )
    with weights_only_everywhere(allowed):  # ds_to_universal reads the shards with weights_only=False
        ds_to_universal.main(args)
    (staging / "latest_universal").write_text(tag)
    shutil.rmtree(output_dir, ignore_errors=True)
    os.replace(staging, output_dir)
    return output_dir


def export_model_folder(checkpoint: str | Path, output_dir: str | Path) -> Path:
    """Write a plain Hugging Face model folder (safetensors) from a :class:`DeepSpeedStrategy` checkpoint.

    Copies the checkpoint's ``model/`` folder when it was saved with
    ``save_full_weights=True``. Otherwise consolidates the fp32 weights from
    DeepSpeed's shards (``zero_to_fp32``: any ZeRO stage and process count, one
    process, no GPU) into ``model.safetensors`` beside the model config that
    :meth:`DeepSpeedStrategy.save` kept in ``model_config/``. Returns ``output_dir``.
    """
    from safetensors.torch import save_file

    checkpoint, output_dir = Path(checkpoint), Path(output_dir)
    meta = read_checkpoint_meta(checkpoint)
    full_weights = checkpoint / MODEL_SUBDIR
    if full_weights.is_dir():
        load_model_folder(full_weights)  # fails with a clear message if the folder holds no weights
        shutil.copytree(full_weights, output_dir, dirs_exist_ok=True)
        return output_dir
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    allowed = deepspeed_checkpoint_globals()
    check_torch_files(checkpoint / DEEPSPEED_SUBDIR / meta["tag"], allowed_globals=allowed)
    with weights_only_everywhere(allowed):  # zero_to_fp32 reads the shards with weights_only=False
        state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint / DEEPSPEED_SUBDIR), tag=meta["tag"])
    output_dir.mkdir(parents=True, exist_ok=True)
    # safetensors refuses tensors sharing storage (tied weights): store each key's own copy.
    save_file({name: tensor.contiguous().clone() for name, tensor in state.items()},
              str(output_dir / "model.safetensors"), metadata={"format": "pt"})
    config_dir = checkpoint / MODEL_CONFIG_SUBDIR
    if config_dir.is_dir():
        for item in config_dir.iterdir():
            shutil.copy2(item, output_dir / item.name)
    return output_dir


@rltk.hookimpl
def rltk_training_strategies():
    """Register :class:`DeepSpeedStrategy` as training strategy ``deepspeed``."""
    return {"deepspeed": DeepSpeedStrategy}
