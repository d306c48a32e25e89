"""What a tensor-parallel size must divide, checked from a model config's numbers alone (no torch import, so
``rltk validate`` can run it before anything is built)."""

from __future__ import annotations

from typing import Any

from rltk.errors import ConfigError

TP_KEY = "strategy_args.tensor_parallel_size"
#: the config sizes a tensor-parallel size must divide (heads and features split over ranks, the head's rows)
DIVIDED_SIZES = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")


def check_tensor_parallel_sizes(sizes: dict[str, Any], tensor_parallel_size: int, described: str) -> None:
    """ConfigError naming ``strategy_args.tensor_parallel_size`` unless it divides each of :data:`DIVIDED_SIZES`
    present in ``sizes`` (a model config's values; ``described`` says which model, for the message)."""
    for name in DIVIDED_SIZES:
        value = sizes.get(name)
        if isinstance(value, int) and value % tensor_parallel_size:
            raise ConfigError(
                f"{TP_KEY}={tensor_parallel_size} does not divide {name}={value} of {described}: each of the "
                f"{tensor_parallel_size} ranks must hold an equal share of the heads, MLP features and vocabulary "
                f"rows. Choose a size that divides {', '.join(DIVIDED_SIZES)}")
