"""The training-strategy contract every engine (Accelerate, DeepSpeed, ...) implements.

A training strategy owns the model's distributed wrapper, its optimizer and its
learning-rate schedule. A recipe only ever talks to this interface, so the same
update loop runs on one CPU, under DDP or FSDP, or under DeepSpeed ZeRO::

    strategy.setup(model, lr=3e-5, total_steps=1000, warmup_steps=20, lr_schedule="cosine")
    n_tokens = strategy.all_reduce_sum(local_token_count)      # global normaliser
    for i, micro in enumerate(micro_batches):
        with strategy.accumulate(i == len(micro_batches) - 1):   # covers backward (DDP no_sync)
            with strategy.autocast():                            # forward only
                loss = per_token_loss(strategy.model, micro).sum() / n_tokens
            strategy.backward(loss)
    metrics = strategy.step()                                   # grad_norm, lr, skipped

Gradient scaling convention
---------------------------
A loss handed to :meth:`TrainingStrategy.backward` is *this rank's share of a
globally normalised sum*: the caller divides by counts summed over every
micro-batch of the step and over every rank (use :meth:`all_reduce_sum`). Summing
these shares over ranks gives exactly the loss of one big batch. Data-parallel
engines *average* gradients over ranks, which would divide the result by
``world_size`` a second time, so ``backward`` multiplies the loss by
``world_size`` first. With this convention the gradient of N ranks x M
micro-batches equals the gradient of one process on the concatenated batch, for
every loss aggregation mode (token-mean, sequence-mean, ...).

Shared building blocks live here as functions so every strategy builds its
optimizer and schedule the same way: :func:`lr_multiplier`,
:func:`build_adamw`, :func:`build_lr_scheduler`, and the checkpoint-folder
helpers :func:`save_model_folder` / :func:`load_model_folder`.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch import nn

from rltk.distributed import set_ranks_per_data_share
from rltk.errors import ConfigError
from rltk.models.folders import full_cpu_copy, shard_like
from rltk.registry import unknown_name_message
from rltk.strategies.layout import SIZE_KEYS, ParallelLayout

LR_SCHEDULES = ("constant", "linear", "cosine")
MIXED_PRECISION_MODES = ("no", "bf16", "fp16")

MODEL_SUBDIR = "model"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
GRAD_SCALER_FILE = "grad_scaler.pt"
STRATEGY_META_FILE = "strategy.json"


# --------------------------------------------------------------------------
# Optimizer settings and learning-rate schedule
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class OptimizerSettings:
    """The arguments of :meth:`TrainingStrategy.setup`, validated.

    ``grad_clip`` of ``None`` or ``0`` disables clipping (the gradient norm is
    still measured and reported).
    """

    lr: float
    total_steps: int
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 0
    lr_schedule: str = "constant"
    min_lr_ratio: float = 0.0
    grad_clip: float | None = 1.0

    def __post_init__(self):
        def bad(name: str, value: Any, valid: str) -> ValueError:
            return ValueError(f"strategy.setup(): {name}={value!r} is invalid; {valid}.")

        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not (
            math.isfinite(self.lr) and self.lr > 0
        ):
            raise bad("lr", self.lr, "it must be a finite number > 0, e.g. 3e-5")
        if isinstance(self.total_steps, bool) or not isinstance(self.total_steps, int) or self.total_steps < 1:
            raise bad("total_steps", self.total_steps, "it must be an integer >= 1 (number of optimizer steps)")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or not (
            0 <= self.warmup_steps <= self.total_steps
        ):
            raise bad("warmup_steps", self.warmup_steps,
                      f"it must be an integer in [0, total_steps={self.total_steps}]")
        if not (isinstance(self.weight_decay, (int, float)) and self.weight_decay >= 0):
            raise bad("weight_decay", self.weight_decay, "it must be a number >= 0")
        betas = tuple(self.betas) if isinstance(self.betas, (list, tuple)) else None
        if betas is None or len(betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas):
            raise bad("betas", self.betas, "it must be two numbers in [0, 1), e.g. (0.9, 0.999)")
        object.__setattr__(self, "betas", (float(betas[0]), float(betas[1])))
        if not (isinstance(self.eps, (int, float)) and self.eps > 0):
            raise bad("eps", self.eps, "it must be a number > 0, e.g. 1e-8")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError("strategy.setup(): " + unknown_name_message("lr_schedule", self.lr_schedule,
                                                                         list(LR_SCHEDULES)))
        if not (isinstance(self.min_lr_ratio, (int, float)) and 0 <= self.min_lr_ratio <= 1):
            raise bad("min_lr_ratio", self.min_lr_ratio, "it must be a number in [0, 1] (fraction of lr)")
        if self.grad_clip is not None and not (
            isinstance(self.grad_clip, (int, float)) and math.isfinite(self.grad_clip) and self.grad_clip >= 0
        ):
            raise bad("grad_clip", self.grad_clip, "it must be a finite number >= 0, or None/0 to disable clipping")

    @property
    def clip_norm(self) -> float:
        """The max-norm handed to ``clip_grad_norm_``; ``inf`` measures without clipping."""
        return float(self.grad_clip) if self.grad_clip else math.inf


def lr_multiplier(step: int, *, total_steps: int, warmup_steps: int = 0, schedule: str = "constant",
                  min_lr_ratio: float = 0.0) -> float:
    """Factor applied to the peak learning rate for optimizer step ``step`` (0-based).

    Warm-up: ``(step + 1) / warmup_steps`` for ``step < warmup_steps``, so the
    first step already learns (no wasted step at lr 0) and the last warm-up step
    reaches the peak. After warm-up, with decay progress
    ``p = clamp((step - warmup_steps) / (total_steps - warmup_steps), 0, 1)``
    and ``m = min_lr_ratio``::

        constant:  1
        linear:    m + (1 - m) * (1 - p)
        cosine:    m + (1 - m) * (1 + cos(pi * p)) / 2      (Loshchilov & Hutter, 2017, SGDR)

    so the factor falls from 1 to ``m`` reaching it at ``step == total_steps``.
    ``min_lr_ratio`` is ignored by ``constant``.

    Example: ``total_steps=10, warmup_steps=2, schedule="linear"`` gives
    0.5, 1.0 for steps 0, 1 and 1.0, 0.875, ..., 0.125 for steps 2..9.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    progress = min(1.0, max(0.0, progress))
    if schedule == "linear":
        decay = 1.0 - progress
    elif schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(unknown_name_message("lr_schedule", schedule, list(LR_SCHEDULES)))
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay


def weight_decay_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Trainable parameters split into a decayed and a non-decayed AdamW group.

    Matrices (``ndim >= 2``: linear and embedding weights) are decayed; biases and
    normalisation gains are not, as in GPT-2/nanoGPT and HF Trainer: decaying a
    LayerNorm gain towards 0 only fights the normalisation. Frozen parameters
    (``requires_grad=False``) are left out.
    """
    decay, no_decay = [], []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        (decay if param.ndim >= 2 else no_decay).append(param)
    if not decay and not no_decay:
        raise ValueError(
            f"strategy.setup(): the model ({type(model).__name__}) has no trainable parameters "
            "(every requires_grad is False); unfreeze at least one before setup()."
        )
    groups = []
    if decay:
        groups.append({"params": decay, "weight_decay": float(weight_decay)})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def adamw_implementation(params: list[torch.Tensor]) -> dict[str, bool]:
    """torch AdamW's implementation switch for ``params``: ``{"fused": True}`` where torch has a fused
    kernel for every parameter's device and dtype, else ``{"foreach": True}``; ``{}`` (torch's own
    choice) for no parameters.

    torch's default on CPU is the per-parameter loop: a dozen small kernel launches per tensor, which
    on a small model costs more than the arithmetic (the fused kernel does the whole update in one
    pass over each parameter). The implementations agree only up to float rounding, so every strategy
    takes the same one: FSDP2's DTensor parameters (torch dispatches the fused op shard by shard, an
    element-wise update) get the fused kernel as DDP's and ZeRO's plain tensors do.
    """
    if not params:
        return {}
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
        fused_devices = set(_get_fused_kernels_supported_devices())
    except ImportError:  # a torch without the helper: CUDA, which every fused build supports
        fused_devices = {"cuda"}
    if all(p.is_floating_point() and p.device.type in fused_devices for p in params):
        return {"fused": True}
    return {"foreach": True}


def build_adamw(model: nn.Module, settings: OptimizerSettings) -> torch.optim.AdamW:
    """AdamW (Loshchilov & Hutter, 2019) over ``model``'s trainable parameters, in torch's fused
    implementation where it has one (see :func:`adamw_implementation`).

    Build it *after* the model is wrapped/sharded: FSDP2 replaces parameters by
    sharded DTensors and the optimizer must hold those.
    """
    groups = weight_decay_groups(model, settings.weight_decay)
    return torch.optim.AdamW(
        groups, lr=settings.lr, betas=settings.betas, eps=settings.eps,
        **adamw_implementation([p for group in groups for p in group["params"]]),
    )


def build_lr_scheduler(optimizer: torch.optim.Optimizer, settings: OptimizerSettings) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` applying :func:`lr_multiplier` to every parameter group.

    The schedule's shape comes from ``settings`` (not from a checkpoint) so a
    resumed run follows the schedule of its config.
    """
    multiplier = functools.partial(
        lr_multiplier, total_steps=settings.total_steps, warmup_steps=settings.warmup_steps,
        schedule=settings.lr_schedule, min_lr_ratio=settings.min_lr_ratio,
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)


# --------------------------------------------------------------------------
# Checkpoint folder helpers (weights: rltk.models.folders; the rest: weights_only torch.load)
# --------------------------------------------------------------------------


def _parameter_names(module: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in module.named_parameters(remove_duplicate=True)}


def optimizer_state_by_name(optimizer: torch.optim.Optimizer, module: nn.Module) -> dict[str, Any]:
    """The optimizer's full state keyed by parameter name instead of position. Collective if sharded.

    Layout (what ``torch.optim`` uses, with names for indices)::

        {"state": {"layers.0.w": {"step": t, "exp_avg": t, ...}, ...},
         "param_groups": [{"lr": ..., "betas": ..., "params": ["layers.0.w", ...]}, ...]}

    Names make a checkpoint independent of the sharding and of the number of
    ranks, so it loads under DDP, FSDP or one process alike. Tensors are full
    CPU copies. Unlike ``torch.distributed.checkpoint``'s helper this never takes
    a hidden zero-lr optimizer step to create missing state (that would set
    Adam's step counter to 1 before the first real step).
    """
    names = _parameter_names(module)
    state: dict[str, dict[str, Any]] = {}
    groups = []
    # Walk the groups, not optimizer.state, so every rank gathers in the same order.
    for group in optimizer.param_groups:
        group_names = []
        for param in group["params"]:
            if id(param) not in names:
                raise KeyError(
                    f"the optimizer holds a parameter of shape {tuple(param.shape)} that is not in "
                    f"{type(module).__name__}.named_parameters(); build the optimizer from this module."
                )
            name = names[id(param)]
            group_names.append(name)
            if param in optimizer.state:
                state[name] = {
                    k: full_cpu_copy(v, of=param) if isinstance(v, torch.Tensor) else v
                    for k, v in optimizer.state[param].items()
                }
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": group_names})
    return {"state": state, "param_groups": groups}


def load_optimizer_state_by_name(optimizer: torch.optim.Optimizer, module: nn.Module,
                                 saved: dict[str, Any], source: str | Path) -> None:
    """Inverse of :func:`optimizer_state_by_name`: restore state and hyper-parameters.

    Parameter groups must name the same parameters in the same order; a
    mismatch (different model or freezing) is an error naming the first
    differing group. Sharded parameters receive their local shard.
    """
    names = _parameter_names(module)
    saved_groups = saved.get("param_groups", [])
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"optimizer state in '{source}' has {len(saved_groups)} parameter groups, the optimizer has "
            f"{len(optimizer.param_groups)}; was it saved for another model, another optimizer, or with "
            "other parameters frozen?"
        )
    native_state: dict[int, dict[str, Any]] = {}
    native_groups = []
    index = 0
    for i, (group, saved_group) in enumerate(zip(optimizer.param_groups, saved_groups)):
        live_names = [names[id(p)] for p in group["params"]]
        saved_names = list(saved_group["params"])
        if live_names != saved_names:
            first = next(j for j in range(max(len(live_names), len(saved_names)))
                         if j >= min(len(live_names), len(saved_names)) or live_names[j] != saved_names[j])
            live_name = live_names[first] if first < len(live_names) else "(end of group)"
            saved_name = saved_names[first] if first < len(saved_names) else "(end of group)"
            raise ValueError(
                f"optimizer parameter group {i} in '{source}' does not match the model: parameter {first} is "
                f"{live_name!r} in the model but {saved_name!r} in the checkpoint. Was it saved for another "
                "model, or with other parameters frozen?"
            )
        indices = []
        for name, param in zip(live_names, group["params"]):
            if name in saved["state"]:
                native_state[index] = {
                    k: shard_like(v, param) if isinstance(v, torch.Tensor) and v.ndim > 0 else v
                    for k, v in saved["state"][name].items()
                }
            indices.append(index)
            index += 1
        native_groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": indices})
    optimizer.load_state_dict({"state": native_state, "param_groups": native_groups})


def read_strategy_meta(directory: str | Path, strategy: str, checkpoint_format: str, otherwise: str) -> dict[str, Any]:
    """The ``strategy.json`` of the checkpoint ``directory``, which ``strategy``'s ``save()`` wrote in
    ``checkpoint_format``: a FileNotFoundError when there is none, a ValueError ending with ``otherwise`` (what
    to do instead) when another strategy wrote it."""
    meta_path = Path(directory) / STRATEGY_META_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(f"'{directory}' has no {STRATEGY_META_FILE}: it is not a checkpoint written by "
                                f"{strategy}.save() (or it is incomplete).")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != checkpoint_format:
        raise ValueError(
            f"checkpoint '{directory}' has format {meta.get('format')!r} (strategy {meta.get('strategy')!r}); "
            f"{strategy} reads {checkpoint_format!r}. Resume with the strategy that wrote it, or {otherwise}."
        )
    return meta


def load_weights_only(path: Path) -> Any:
    """``torch.load`` restricted to tensors and plain containers: never unpickles arbitrary objects.

    A refused file raises :class:`rltk.serialization.UnsafeCheckpointError`, a
    truncated or unreadable one :class:`rltk.serialization.DamagedCheckpointError`,
    both naming the file.
    """
    from rltk.serialization import torch_load

    if not path.exists():
        raise FileNotFoundError(f"checkpoint file '{path}' is missing; the checkpoint is incomplete or not "
                                f"written by this strategy.")
    return torch_load(path)


def check_mixed_precision(mixed_precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for ``mixed_precision`` on ``device`` (``None`` for ``"no"``).

    Raises instead of silently training in another precision: ``fp16`` needs
    loss scaling tuned for GPUs and is refused on CPU; ``bf16`` needs a GPU that
    supports it (Ampere or newer) or a CPU.
    """
    if mixed_precision not in MIXED_PRECISION_MODES:
        raise ValueError(unknown_name_message("mixed_precision", mixed_precision, list(MIXED_PRECISION_MODES)))
    if mixed_precision == "no":
        return None
    if mixed_precision == "fp16":
        if device.type != "cuda":
            raise ValueError(
                f"mixed_precision='fp16' needs a CUDA device, but training runs on '{device}'. "
                "Use mixed_precision='bf16' (supported on CPU) or 'no'."
            )
        return torch.float16
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(
            f"mixed_precision='bf16' is not supported by this GPU ({torch.cuda.get_device_name(device)}); "
            "use mixed_precision='fp16' or 'no'."
        )
    return torch.bfloat16


# --------------------------------------------------------------------------
# The strategy interface
# --------------------------------------------------------------------------


class TrainingStrategy(abc.ABC):
    """Wraps model, optimizer and LR schedule; hides the distributed engine from recipes.

    Lifecycle: construct (engine options only) -> :meth:`setup` (model and
    optimizer settings) -> per step: :meth:`accumulate` + :meth:`autocast` +
    :meth:`backward` over micro-batches, then :meth:`step`. Collective methods
    (:meth:`all_reduce_sum`, :meth:`all_gather_object`, :meth:`broadcast_object`,
    :meth:`barrier`, :meth:`full_state_dict`, :meth:`save`, :meth:`load`) must be
    called by every rank; in a single process they are identities.

    Subclasses implement the abstract methods and, when they start, set
    ``_device``, ``_rank`` and ``_world_size`` (what :attr:`device`, :attr:`rank`
    and :attr:`world_size` answer); the collectives here use the default
    ``torch.distributed`` process group and work for any engine built on it.
    """

    settings: OptimizerSettings | None = None
    # Where this process stands, fixed when the engine starts (its constructor sets them).
    _device: torch.device = torch.device("cpu")
    _rank: int = 0
    _world_size: int = 1
    _layout: ParallelLayout | None = None
    # What :meth:`_setup` builds.
    _optimizer: torch.optim.Optimizer | None = None
    _scheduler: torch.optim.lr_scheduler.LRScheduler | None = None

    # ---------------------------------------------------------------- setup

    def setup(
        self,
        model: nn.Module,
        *,
        lr: float,
        total_steps: int,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        warmup_steps: int = 0,
        lr_schedule: str = "constant",
        min_lr_ratio: float = 0.0,
        grad_clip: float | None = 1.0,
    ) -> None:
        """Wrap ``model`` for the engine and build AdamW plus a warm-up LR schedule.

        See :func:`lr_multiplier` for the schedules (``constant``, ``linear``,
        ``cosine``) and :func:`weight_decay_groups` for which parameters decay.
        ``grad_clip`` is the max global L2 norm (``None``/``0``: no clipping).
        Every argument is validated first, with an error naming it.
        """
        if self.settings is not None:
            raise RuntimeError(
                f"{type(self).__name__}.setup() was already called; build one strategy per model "
                "(e.g. one for the policy and one for the critic)."
            )
        settings = OptimizerSettings(
            lr=lr, total_steps=total_steps, weight_decay=weight_decay, betas=betas, eps=eps,
            warmup_steps=warmup_steps, lr_schedule=lr_schedule, min_lr_ratio=min_lr_ratio,
            grad_clip=grad_clip,
        )
        self._setup(model, settings)
        self.settings = settings

    @abc.abstractmethod
    def _setup(self, model: nn.Module, settings: OptimizerSettings) -> None:
        """Engine-specific part of :meth:`setup`: wrap, then build optimizer and scheduler."""

    #: the ``strategy_args`` sizes beyond data parallelism this engine builds (others > 1 are refused by name)
    built_parallel_sizes: frozenset[str] = frozenset()

    def _init_layout(self, **sizes: int) -> None:
        """Place this process in the grid ``strategy_args``' sizes ask for (call once ``_world_size`` is known).

        A size that does not divide the process count, or one this engine does not build, is a
        :class:`~rltk.errors.ConfigError` naming its ``strategy_args`` key.
        """
        for key in SIZE_KEYS.values():  # what the engine cannot run is named before whether it fits the world
            size = sizes.get(key, 1)
            if isinstance(size, int) and not isinstance(size, bool) and size > 1 \
                    and key not in self.built_parallel_sizes:
                built = ", ".join(f"strategy_args.{k}" for k in sorted(self.built_parallel_sizes)) or "none"
                raise ConfigError(
                    f"strategy_args.{key}={size}: {type(self).__name__} does not run this kind of "
                    f"parallelism (sizes above 1 it runs: {built}); set strategy_args.{key}=1")
        layout = ParallelLayout.from_strategy_args(sizes, self.world_size)
        self._layout = layout
        set_ranks_per_data_share(layout.sequence_parallel_size * layout.tensor_parallel_size)

    def _require_setup(self, what: str) -> None:
        if self.settings is None:
            raise RuntimeError(f"{type(self).__name__}.{what} needs setup(model, lr=..., total_steps=...) first.")

    # ---------------------------------------------------------------- properties

    @property
    @abc.abstractmethod
    def model(self) -> nn.Module:
        """The wrapped module to call forward on (DDP/FSDP/engine); gradients sync through it."""

    @property
    def device(self) -> torch.device:
        """The device this rank computes on; move batches here."""
        return self._device

    @property
    def rank(self) -> int:
        """This process's global rank (0 in a single process)."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of processes of the run (1 in a single process)."""
        return self._world_size

    @property
    def layout(self) -> ParallelLayout:
        """How the processes split data, sequences and layers (:class:`rltk.strategies.layout.ParallelLayout`);
        data-parallel only unless the engine was built with other sizes (:meth:`_init_layout`)."""
        layout = self._layout
        return layout if layout is not None and layout.world_size == self.world_size else ParallelLayout(
            world_size=self.world_size)

    @property
    def data_rank(self) -> int:
        """Which share of the rows this process holds: what ``rows[data_rank::data_world_size]``, a data
        loader's seed or a group's gathers use (the same on every rank of a sequence/tensor group)."""
        return self.layout.data_rank(self.rank)

    @property
    def data_world_size(self) -> int:
        """How many distinct shares of the rows there are (``world_size`` when only data is split)."""
        return self.layout.data_world_size

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that writes files and prints."""
        return self.rank == 0

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer built by :meth:`setup` (:meth:`_setup` keeps it in ``self._optimizer``)."""
        self._require_setup("optimizer")
        return self._optimizer

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LRScheduler:
        """The LR scheduler built by :meth:`setup` (:meth:`_setup` keeps it in ``self._scheduler``)."""
        self._require_setup("scheduler")
        return self._scheduler

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps taken so far (skipped non-finite steps do not count)."""
        self._require_setup("optimizer_steps")
        return int(self.scheduler.last_epoch)

    @property
    def current_lr(self) -> float:
        """The learning rate the next optimizer step will use."""
        self._require_setup("current_lr")
        return float(self.scheduler.get_last_lr()[0])

    # ---------------------------------------------------------------- training

    @abc.abstractmethod
    def autocast(self) -> contextlib.AbstractContextManager:
        """Mixed-precision context for forward passes (``nullcontext`` in full precision)."""

    @abc.abstractmethod
    def accumulate(self, is_last_micro_batch: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-batch's forward+backward; skips gradient sync unless it is the last."""

    @abc.abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate this rank's share of a globally normalised loss.

        Multiplies by ``world_size`` to undo the engine's gradient averaging (see
        the module docstring), so gradients equal one process on the global batch.
        """

    @abc.abstractmethod
    def step(self) -> dict[str, float]:
        """Clip, optimizer step, scheduler step, zero grads.

        Returns ``{"grad_norm": global L2 norm before clipping, "lr": the rate this
        step used, "skipped": 1.0 if the norm was not finite and the update was
        skipped (gradients dropped, schedule not advanced) else 0.0}``.
        """

    def forward_backward(self, micro_batches: Iterable, micro_loss: Callable) -> dict[str, float]:
        """Run one optimizer step's micro-batches forward and backward; this rank's shares of the metrics.

        Each micro-batch (a :class:`rltk.training.step.micro_batches.MicroBatch`: ``data``, ``is_last``,
        ``padding``) is moved to :attr:`device` and handed to ``micro_loss(data, micro)``, which returns
        ``(loss, read_shares)``: the loss, a share of a globally normalised sum (see the module docstring),
        is backwarded inside :meth:`accumulate` and outside :meth:`autocast`; ``read_shares()``, read after
        the backward, gives its share of each logged number. A padding micro-batch (every rank runs as
        many as the busiest: sharded engines gather parameters in each forward) is backwarded times 0 and
        adds 0 under each of its names, so every rank holds the same names. Returns each name's shares
        summed over this rank's micro-batches; summed over data ranks they are the step's numbers.
        """
        totals: dict[str, float] = {}
        for micro in micro_batches:
            data = {k: v.to(self.device) for k, v in micro.data.items()}
            with self.accumulate(micro.is_last):
                split_before = self._split_forwards
                with self.autocast():
                    loss, read_shares = micro_loss(data, micro)
                self._check_split(split_before)
                # backward outside autocast (torch's advice) but inside accumulate, whose no-sync must cover it
                self.backward(loss * 0.0 if micro.padding else loss)
            for name, value in read_shares().items():
                totals[name] = totals.setdefault(name, 0.0) if micro.padding else totals.get(name, 0.0) + value
        return totals

    _split_forwards = 0  # sequence-split passes run so far (:meth:`logprobs`)

    def _check_split(self, split_before: int) -> None:
        """Refuse a loss whose forward ran whole on every rank of a sequence group: its gradient, summed over
        the group like a split one's, would count ``SP`` times (the PPO critic's values, a reward model)."""
        sp = self.layout.sequence_parallel_size
        if sp > 1 and self._split_forwards == split_before:
            raise ConfigError(
                f"strategy_args.sequence_parallel_size={sp}: this update's forward does not go through "
                "strategy.logprobs, so it cannot split sequences (the PPO critic, the reward model); run it "
                "with strategy_args.sequence_parallel_size=1")

    def logprobs(self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 response_width: int, **options: Any) -> tuple[torch.Tensor, ...]:
        """Response log-probs (and entropy, ...) of ``model``, a module this strategy trains or holds
        (:attr:`model`, :meth:`unwrap`, :meth:`reference_model`): every log-prob pass of training goes
        through here, so an engine that splits sequences or layers runs it its way. The default is
        :func:`rltk.models.logprobs.response_logprobs` (``options`` are its keywords, shapes its); with
        ``strategy_args.sequence_parallel_size > 1`` each rank of a sequence group runs its slice of every
        row (:func:`rltk.models.parallel.sequence.ulysses_response_logprobs`) and every rank of the group
        gets the whole ``[B, T]``."""
        if self.layout.tensor_parallel_size > 1 and _holds_a_tensor_parallel_head(model):
            return self._tensor_parallel_logprobs(model, input_ids, attention_mask, response_width, **options)
        sp = self.layout.sequence_parallel_size
        if sp == 1:
            from rltk.models.logprobs import response_logprobs

            return response_logprobs(model, input_ids, attention_mask, response_width, **options)
        from rltk.models.parallel.sequence import ulysses_response_logprobs

        for option, key in (("pack", "trainer.pack_sequences"), ("routed_experts", "algorithm.routing_replay"),
                            ("router_trace", "trainer.router_aux_loss_coef"), ("vision_inputs", "data.image_key")):
            if options.pop(option, None) not in (None, False):
                raise ConfigError(f"{key} does not combine with strategy_args.sequence_parallel_size={sp} yet; "
                                  f"turn it off or set strategy_args.sequence_parallel_size=1")
        self._split_forwards += 1
        return ulysses_response_logprobs(model, input_ids, attention_mask, response_width,
                                         group=self._axis_group("sp"), **options)

    def _tensor_parallel_logprobs(self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                  response_width: int, **options: Any) -> tuple[torch.Tensor, ...]:
        """The padded-rows pass of a tensor-parallel model through the vocabulary-parallel head
        (:func:`rltk.models.parallel.tensor_parallel.tensor_parallel_response_logprobs`): no rank holds the
        gathered logits. What that pass does not take yet is refused naming its key."""
        from rltk.models.parallel.tensor_parallel import tensor_parallel_response_logprobs

        tp = self.layout.tensor_parallel_size
        for option, key in (("pack", "trainer.pack_sequences"), ("routed_experts", "algorithm.routing_replay"),
                            ("router_trace", "trainer.router_aux_loss_coef"), ("vision_inputs", "data.image_key"),
                            ("with_sum_pi_squared", "algorithm.adv_estimator (one that reads sum_pi_squared)")):
            if options.get(option) not in (None, False):
                raise ConfigError(f"{key} does not combine with strategy_args.tensor_parallel_size={tp} yet; "
                                  f"turn it off or set strategy_args.tensor_parallel_size=1")
        logprobs, entropy = tensor_parallel_response_logprobs(
            model, input_ids, attention_mask, response_width, temperature=options.get("temperature", 1.0),
            impl=options.get("impl", "auto"), chunk_size=options.get("chunk_size"),
            with_entropy=options.get("with_entropy", False))
        return logprobs, entropy

    def reference_model(self, *, frozen: bool = True) -> nn.Module:
        """A second model with the weights as they are now, held the way this engine holds one. Collective.

        ``frozen``: in eval mode without gradients (a KL reference); ``False`` for a model that trains
        on its own (the PPO critic built from the policy). It shares no storage with the training
        weights, and its forwards go through :meth:`logprobs` like the policy's. The default is a whole
        copy on every rank (:meth:`full_model_copy`).
        """
        copy = self.full_model_copy()
        return copy.eval().requires_grad_(False) if frozen else copy

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's full weights under their Hugging Face names, as CPU copies, on every rank. Collective.

        What rollout engines load and exports write, whatever this engine splits or renames while it
        trains. The default is :meth:`full_state_dict`.
        """
        return self.full_state_dict()

    # ---------------------------------------------------------------- weights

    @abc.abstractmethod
    def unwrap(self) -> nn.Module:
        """The underlying module without the engine wrapper (for generate, export, hooks)."""

    @abc.abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) weights as CPU copies, on every rank. Collective.

        This is what the rollout engine loads after each update and what
        exports write; mutating it never touches the training weights.
        """

    @property
    def shards_parameters(self) -> bool:
        """True when a rank holds only a shard of the parameters outside the model's forward.

        Then every forward of :attr:`model` (and of :meth:`unwrap`) gathers
        parameters, a collective all ranks must run together, and
        :meth:`unwrap` is no usable model on its own: a rollout engine or a
        frozen reference model needs a whole copy (:meth:`full_model_copy`).
        False here; ZeRO-3 (and sharding engines generally) override it.
        """
        return False

    def full_model_copy(self) -> nn.Module:
        """A plain module (no engine, no sharding) with the weights as they are now. Collective.

        For a rollout engine's own copy or a frozen reference model: it shares
        no storage with the training weights, and is in the dtype the forward
        passes use. The default deep-copies :meth:`unwrap`.
        """
        import copy

        self._require_setup("full_model_copy()")
        return copy.deepcopy(self.unwrap())

    def release_model(self) -> nn.Module:
        """End training with this strategy and hand back the model as a plain module. Collective.

        What the next stage builds its own strategy on. Engines that change the
        module in place (ZeRO-3 partitions it) return a new module with the
        full weights, in its original dtype, and free their engine; the
        strategy is unusable afterwards. The default returns :meth:`unwrap`.
        """
        self._require_setup("release_model()")
        return self.unwrap()

    # ---------------------------------------------------------------- collectives

    @property
    def _distributed(self) -> bool:
        return self.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()

    def _axis_group(self, axis: str):
        """The process group of the ranks that differ from this one along ``axis`` of :attr:`layout` only
        (``None``, the default group, when that is every rank). Built on first use, by every rank
        together: one group for each place on the other axes."""
        layout = self.layout
        if len(layout.group_ranks(axis, self.rank)) == self.world_size:
            return None
        groups = self.__dict__.setdefault("_axis_groups", {})
        if axis not in groups:
            places = sorted({tuple(layout.group_ranks(axis, r)) for r in range(self.world_size)})
            groups[axis] = {ranks: torch.distributed.new_group(list(ranks)) for ranks in places}
        return groups[axis][tuple(layout.group_ranks(axis, self.rank))]

    def _data_group(self):
        """The process group of this rank's data-parallel peers (see :meth:`_axis_group`)."""
        return self._axis_group("dp")

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Element-wise sum of ``tensor`` over data ranks, as a new tensor on the input's device.

        Use it for global normalisers: ``n_tokens = strategy.all_reduce_sum(mask.sum())``. The ranks
        of one sequence- or tensor-parallel group hold the same rows, so each share counts once (over
        every rank when only data is split). The input is not modified. Single process: a copy.
        """
        return self._all_reduce(tensor, torch.distributed.ReduceOp.SUM)

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """Element-wise maximum of ``tensor`` over data ranks, as a new tensor on the input's device.

        Use it to keep ranks in lockstep: ``n = strategy.all_reduce_max(torch.tensor(local_n))``.
        """
        return self._all_reduce(tensor, torch.distributed.ReduceOp.MAX)

    def _all_reduce(self, tensor: torch.Tensor, op) -> torch.Tensor:
        if not self._distributed:
            return tensor.detach().clone()
        buffer = tensor.detach().to(self.device, copy=True)
        torch.distributed.all_reduce(buffer, op=op, group=self._data_group())
        return buffer.to(tensor.device)

    def gather_rows(self, tensor: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Every data rank's rows, concatenated in data-rank order, and each data rank's row count.

        Ranks may hold different numbers of rows and, for ``[B, T, ...]``
        tensors, different widths: every trailing dimension is right-padded
        with zeros to the widest rank's. Data rank ``r``'s own rows are
        ``out[sum(counts[:r]) : sum(counts[:r + 1]), :T_r]``. Single process:
        ``(tensor, [B])``.
        """
        if not self._distributed:
            return tensor, [tensor.shape[0]]
        group = self._data_group()
        shapes: list[Any] = [None] * self.data_world_size
        torch.distributed.all_gather_object(shapes, tuple(tensor.shape), group=group)
        counts = [shape[0] for shape in shapes]
        widest = [max(sizes) for sizes in zip(*shapes)]
        # gloo has no bool collectives
        wire_dtype = torch.uint8 if tensor.dtype == torch.bool else tensor.dtype
        padded = torch.zeros(widest, dtype=wire_dtype, device=self.device)
        padded[tuple(slice(0, n) for n in tensor.shape)] = tensor.to(self.device, wire_dtype)
        parts = [torch.empty_like(padded) for _ in range(self.data_world_size)]
        torch.distributed.all_gather(parts, padded, group=group)
        rows = torch.cat([part[:n] for part, n in zip(parts, counts)])
        return rows.to(tensor.device, tensor.dtype), counts

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order. Single process: ``[obj]``."""
        if not self._distributed:
            return [obj]
        gathered: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(gathered, obj)
        return gathered

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank (other ranks' argument is ignored)."""
        if not self._distributed:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self) -> None:
        """Wait until every rank reaches this point. Single process: returns at once."""
        if self._distributed:
            torch.distributed.barrier()

    # ---------------------------------------------------------------- checkpoints

    @abc.abstractmethod
    def save(self, directory: str | Path) -> None:
        """Write model (safetensors), optimizer and scheduler state into ``directory``. Collective."""

    @abc.abstractmethod
    def load(self, directory: str | Path) -> None:
        """Restore what :meth:`save` wrote (``weights_only`` loading). Collective; call after :meth:`setup`."""

    @classmethod
    def checkpoint_globals(cls) -> list[Any]:
        """Classes this strategy's checkpoint files pickle besides tensors, plain containers and numbers.

        Loading allows exactly these (and :class:`rltk.checkpoint.CheckpointManager`
        refuses any file that asks for more), so each must be harmless to
        construct from whatever arguments a file supplies: plain records, enums.
        None by default: rltk's own formats are safetensors, JSON and tensors.
        """
        return []

    def describe(self) -> dict[str, Any]:
        """A JSON-able summary of the engine and settings (written beside checkpoints)."""
        return {
            "strategy": type(self).__name__,
            "world_size": self.world_size,
            "settings": asdict(self.settings) if self.settings else None,
            "optimizer_steps": self.optimizer_steps if self.settings else 0,
        }


def _holds_a_tensor_parallel_head(model: nn.Module) -> bool:
    """Whether ``model``'s output head is split by vocabulary rows (a DTensor): the policy a tensor-parallel
    strategy trains, not a whole copy it holds beside it (the reference, the rollout engine's)."""
    from rltk.models.logprobs import _is_dtensor, output_head_module

    try:
        return _is_dtensor(output_head_module(model).weight)
    except NotImplementedError:  # no Linear head: not a causal LM this pass serves
        return False
