"""How the fused log-prob op's ``chunk_size`` reads, for both backends (torch and Triton)."""

from __future__ import annotations


def parse_chunk_size(chunk_size, default_vocab: int) -> tuple[int, int]:
    """``(tokens, vocab)`` tile sizes from ``chunk_size``: an int (tokens; the vocab tile ``default_vocab``) or
    a pair; ``ValueError`` for anything else."""
    if isinstance(chunk_size, bool):
        raise ValueError(f"chunk_size must be an int or a (tokens, vocab) pair; got {chunk_size!r}")
    if isinstance(chunk_size, int):
        sizes = (chunk_size, default_vocab)
    else:
        try:
            sizes = tuple(chunk_size)
        except TypeError:
            sizes = ()
        if len(sizes) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) for s in sizes):
            raise ValueError(f"chunk_size must be an int or a (tokens, vocab) pair of ints; got {chunk_size!r}")
    if sizes[0] < 1 or sizes[1] < 1:
        raise ValueError(f"chunk_size entries must be >= 1; got {chunk_size!r}")
    return sizes
