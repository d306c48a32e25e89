"""Where a rank stands when data is not the only thing split across ranks.

A run's ``world_size`` processes form a grid of three axes, innermost first:

- ``tp`` (``strategy_args.tensor_parallel_size``): ranks that each hold a slice of every layer's weights;
- ``sp`` (``strategy_args.sequence_parallel_size``): ranks that each hold a slice of every sequence's tokens;
- ``dp``: the rest, each with its own share of the batch's rows.

Rank ``r`` sits at ``tp = r % TP``, ``sp = (r // TP) % SP``, ``dp = r // (TP * SP)``: the ranks of one
tensor- or sequence-parallel group are consecutive, so on several machines they share one (their
collectives are the chatty ones), as Megatron and verl order them. Every rank of a ``(sp, tp)`` group sees
the same rows: the *data* coordinates (:attr:`ParallelLayout.data_world_size`, :meth:`data_rank`) are what
splitting rows, gathering a group's advantages or seeding a data loader must use, never ``rank``/``world``.

Expert parallelism (``strategy_args.expert_parallel_size``) shards a MoE's experts over ``EP`` consecutive
*data* ranks, which keep their own rows (tokens travel to their experts and back by all-to-all), so it
does not change the data coordinates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rltk.errors import ConfigError

AXES = ("dp", "sp", "tp")
SIZE_KEYS = {"sp": "sequence_parallel_size", "tp": "tensor_parallel_size", "ep": "expert_parallel_size"}

PIPELINE_REFUSAL = ("pipeline parallelism is not built in rltk (the strategy would have to own a micro-batch "
                    "schedule across ranks, torch.distributed.pipelining's); to fit a model bigger than one device, "
                    "split its layers with strategy_args.tensor_parallel_size or shard its parameters with "
                    "strategy_args.fsdp=true or strategy=deepspeed strategy_args.zero_stage=3")
CONTEXT_REFUSAL = ("context parallelism (ring attention) is not built in rltk; strategy_args.sequence_parallel_size "
                   "splits every sequence over ranks by Ulysses all-to-all instead")

#: The names peers give these sizes, each with rltk's key (or why there is none) and whose name it is. rltk takes
#: one name for each thing: a peer's name is refused naming rltk's, never read as an alias.
PEER_SIZE_NAMES: dict[str, tuple[str, str]] = {
    "ulysses_sequence_parallel_size": ("strategy_args.sequence_parallel_size", "verl's and Trinity-RFT's"),
    "ulysses_size": ("strategy_args.sequence_parallel_size", "ROLL's"),
    "sp_size": ("strategy_args.sequence_parallel_size", "a common short"),
    "tensor_model_parallel_size": ("strategy_args.tensor_parallel_size", "Megatron's"),
    "tp_size": ("strategy_args.tensor_parallel_size", "Accelerate's ParallelismConfig"),
    "expert_model_parallel_size": ("strategy_args.expert_parallel_size", "Megatron's"),
    "ep_size": ("strategy_args.expert_parallel_size", "DeepSpeed-MoE's"),
    "context_parallel_size": ("", CONTEXT_REFUSAL),
    "cp_size": ("", CONTEXT_REFUSAL),
    "pipeline_parallel_size": ("", PIPELINE_REFUSAL),
    "pipeline_model_parallel_size": ("", PIPELINE_REFUSAL),
    "pp_size": ("", PIPELINE_REFUSAL),
}


def check_peer_size_names(strategy_args: dict[str, Any] | None) -> None:
    """ConfigError for a parallel size given under a peer's name (or one rltk does not build), naming rltk's key."""
    for name in strategy_args or {}:
        if name not in PEER_SIZE_NAMES:
            continue
        key, whose = PEER_SIZE_NAMES[name]
        if key:
            raise ConfigError(f"strategy_args.{name} is {whose} name; rltk's is {key} (the same meaning)")
        raise ConfigError(f"strategy_args.{name}: {whose}")


@dataclass(frozen=True)
class ParallelLayout:
    world_size: int = 1
    sequence_parallel_size: int = 1
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1

    def __post_init__(self) -> None:
        for axis, key in SIZE_KEYS.items():
            size = getattr(self, key)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ConfigError(f"strategy_args.{key}: {size!r} is not a whole number of ranks >= 1")
        model_parallel = self.sequence_parallel_size * self.tensor_parallel_size
        if self.world_size % model_parallel:
            raise ConfigError(
                f"strategy_args.sequence_parallel_size={self.sequence_parallel_size} x "
                f"strategy_args.tensor_parallel_size={self.tensor_parallel_size} = {model_parallel} does not divide "
                f"the {self.world_size} processes of the run: launch a multiple of {model_parallel} processes "
                "or choose sizes whose product divides the process count")
        if self.data_world_size % self.expert_parallel_size:
            raise ConfigError(
                f"strategy_args.expert_parallel_size={self.expert_parallel_size} does not divide the "
                f"{self.data_world_size} data-parallel ranks ({self.world_size} processes / "
                f"{model_parallel} per sequence- and tensor-parallel group)")

    @classmethod
    def from_strategy_args(cls, strategy_args: dict[str, Any] | None, world_size: int) -> "ParallelLayout":
        args = dict(strategy_args or {})
        return cls(world_size=world_size, **{key: args.get(key, 1) for key in SIZE_KEYS.values()})

    @property
    def data_world_size(self) -> int:
        """How many distinct shares of the rows there are."""
        return self.world_size // (self.sequence_parallel_size * self.tensor_parallel_size)

    @property
    def is_data_parallel_only(self) -> bool:
        return self.sequence_parallel_size == self.tensor_parallel_size == self.expert_parallel_size == 1

    def coordinates(self, rank: int) -> dict[str, int]:
        """``{"dp": ..., "sp": ..., "tp": ...}`` of ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        tp, sp = self.tensor_parallel_size, self.sequence_parallel_size
        return {"dp": rank // (tp * sp), "sp": (rank // tp) % sp, "tp": rank % tp}

    def data_rank(self, rank: int) -> int:
        """Which share of the rows ``rank`` holds (the same for every rank of its sequence/tensor group)."""
        return self.coordinates(rank)["dp"]

    def group_ranks(self, axis: str, rank: int) -> list[int]:
        """The ranks that differ from ``rank`` along ``axis`` only (its process group on that axis), in order."""
        if axis not in AXES:
            raise ValueError(f"axis {axis!r} is not one of {AXES}")
        here = self.coordinates(rank)
        sizes = {"dp": self.data_world_size, "sp": self.sequence_parallel_size, "tp": self.tensor_parallel_size}
        return [self.rank_at(**{**here, axis: i}) for i in range(sizes[axis])]

    def rank_at(self, dp: int, sp: int, tp: int) -> int:
        return (dp * self.sequence_parallel_size + sp) * self.tensor_parallel_size + tp

    def expert_group_ranks(self, rank: int) -> list[int]:
        """The ranks that share ``rank``'s experts out between them: ``EP`` consecutive data ranks, same sp/tp."""
        here = self.coordinates(rank)
        first = here["dp"] - here["dp"] % self.expert_parallel_size
        return [self.rank_at(first + i, here["sp"], here["tp"]) for i in range(self.expert_parallel_size)]

    def device_mesh(self, device_type: str):
        """A ``torch.distributed`` device mesh over the world with dims ``("dp", "sp", "tp")`` (needs the group)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.data_world_size, self.sequence_parallel_size,
                                              self.tensor_parallel_size), mesh_dim_names=AXES)
