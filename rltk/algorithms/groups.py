"""Group statistics over per-response values: the shared core of the group estimators.

Responses to one prompt share a ``group_ids`` entry (int64; ids need not be
contiguous, sorted or adjacent). :class:`Groups` numbers the groups once and
then gives segment reductions over them with no Python loop over groups::

    groups = Groups.of(group_ids)               # inverse [B], counts [G]
    centred = groups.centred(R)                 # R_i - mean_g(R), exactly 0 where a group carries no signal
    A = centred / (groups.expand(groups.std(centred)) + eps)

Statistics come back per group (``[G]``) and are brought to the responses with
:meth:`Groups.expand` once, at the end: at ``B = 8192`` every ``[B]`` kernel
costs 5-40 microseconds of fixed overhead on CPU, so the number of kernels, not
the arithmetic, sets the cost, and ``index_select`` is 3x cheaper than
``tensor[index]``. GRPO's statistics of 8192 responses take 0.25-0.55 ms of
CPU (warm / cold caches), against ~2 ms for writing one ``[B, T] = [8192,
512]`` output. Values may be ``[B]`` or ``[B, K]``
(``K`` statistics side by side, as ``gdpo``'s per-reward normalisation needs).

The equality rule of rltk's group estimators lives here too: a group whose
values are equal up to float32 rounding (:data:`EQUAL_WITHIN_ULPS`) carries no
signal, and its centred values are exactly 0, never rounding noise.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

__all__ = ["EQUAL_WITHIN_ULPS", "Groups", "group_index"]

# Returns are float32 sums over tokens, so equal rewards placed at different tokens can sum to
# values one or a few ulps apart (how many depends on the CPU's vectorised reduction order).
# std normalisation would blow that apart into advantages of +-0.7 for a group that is, in fact,
# all equal; a group whose spread is within this many float32 ulps of its magnitude counts as equal.
EQUAL_WITHIN_ULPS = 64


def group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense group index of every response and the size of each group.

    Groups are numbered ``0 .. G-1`` in increasing id order, exactly as
    ``torch.unique(group_ids, return_inverse=True, return_counts=True)``
    numbers them. Ids spanning at most ``4 B`` values (prompt indices of a
    step, the usual case) are ranked with a histogram: ``bincount`` counts the
    members of every id in the span, and the running count of present ids
    below an id is its rank (when every id of the span is present, the offset
    from the smallest id already is the rank). Anything else (hashes, huge
    ids) goes through ``torch.unique``'s sort. (Marking presence with
    ``present[ids] = 1`` instead takes a slow serial path on CPU for repeated
    indices: ~10 ms at ``B = 8192``, 100x this.)

    ``inverse`` may be ``group_ids`` itself (int64 ids ``0 .. G-1``, all
    present); nothing here writes into it, and callers must not either.

    Shape: (B,) int -> inverse (B,) int64, counts (G,) int64.
    """
    if group_ids.numel() == 0:
        return group_ids.to(torch.int64), group_ids.new_zeros(0, dtype=torch.int64)
    lowest, highest = torch.stack(torch.aminmax(group_ids)).tolist()  # one device sync, exact Python ints
    span = highest - lowest + 1
    if span > 4 * group_ids.numel():
        _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
        return inverse, counts
    offsets = group_ids.to(torch.int64)
    if lowest != 0:
        offsets = offsets - lowest
    per_offset = torch.bincount(offsets, minlength=span)  # [span] members of each id
    present = per_offset > 0
    if bool(present.all()):
        return offsets, per_offset
    rank = present.cumsum(0).sub_(1)  # [span] dense index of each present id
    return rank.index_select(0, offsets), per_offset[present]


@dataclass(frozen=True)
class Groups:
    """The groups of a batch: dense index and sizes, with segment reductions over them.

    Build it with :meth:`Groups.of`. Per-group results are ``[G]`` (or
    ``[G, K]``); :meth:`expand` gives each response its group's value. The
    numbering may contain empty groups (``counts == 0``): their statistics
    are meaningless (NaN, infinities) and no response reads them.
    """

    inverse: torch.Tensor  # [B] int64: the group of each response, 0 .. G-1
    counts: torch.Tensor  # [G] int64: members of each group (0 for an unused number)

    @classmethod
    def of(cls, group_ids: torch.Tensor) -> "Groups":
        """Number the groups of ``group_ids``. Shape: (B,) int.

        Ids spanning at most ``4 B`` values are numbered by their offset from
        the smallest id (ids absent from the batch become empty groups): one
        ``bincount``, no ranking. Anything else is numbered densely by
        :func:`group_index`.
        """
        if group_ids.numel() == 0:
            return cls(*group_index(group_ids))
        lowest, highest = torch.stack(torch.aminmax(group_ids)).tolist()  # one device sync, exact Python ints
        if highest - lowest + 1 > 4 * group_ids.numel():
            return cls(*group_index(group_ids))
        offsets = group_ids.to(torch.int64)
        if lowest != 0:
            offsets = offsets - lowest
        return cls(offsets, torch.bincount(offsets, minlength=highest - lowest + 1))

    @property
    def n_groups(self) -> int:
        return self.counts.numel()

    def sizes(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """``n_g``, the members of each group. Shape: (G,)."""
        return self.counts.to(dtype)

    @cached_property
    def _sizes64(self) -> torch.Tensor:
        # n_g in float64, converted once: mean and std each need it, and every [G] kernel counts.
        # (cached_property writes the instance __dict__, which a frozen dataclass allows.)
        return self.counts.to(torch.float64)

    def expand(self, per_group: torch.Tensor) -> torch.Tensor:
        """Each response's value of its group: ``out_i = per_group[g(i)]``. Shape: (G[, K]) -> (B[, K])."""
        return per_group.index_select(0, self.inverse)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """``S_g = sum_{i in g} x_i`` (per column for ``[B, K]``). Shape: (B[, K]) -> (G[, K])."""
        if x.dim() == 1 and x.dtype == torch.float64 and x.device.type == "cpu":
            # Same sequential float64 sum in index order as index_add_ (bit for bit), one kernel
            # instead of zeros + index_add_, and ~30% faster. Not on CUDA, where bincount syncs
            # to size its output; not for float32, which bincount would sum in float64.
            return torch.bincount(self.inverse, weights=x, minlength=self.n_groups)
        shape = (self.n_groups, *x.shape[1:])
        return torch.zeros(shape, dtype=x.dtype, device=x.device).index_add_(0, self.inverse, x)

    def max(self, x: torch.Tensor) -> torch.Tensor:
        """Largest value of each group (per column for ``[B, K]``); ``-inf`` only if every member is.

        Shape: (B[, K]) -> (G[, K]).
        """
        return self._extreme(x, "amax", -torch.inf)

    def min_max(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Smallest and largest value of each group (per column for ``[B, K]``). A NaN propagates.

        Shape: (B[, K]) -> (G[, K]), (G[, K]).
        """
        return self._extreme(x, "amin", torch.inf), self._extreme(x, "amax", -torch.inf)

    def _extreme(self, x: torch.Tensor, reduce: str, identity: float) -> torch.Tensor:
        # Starting from the reduction's identity (include_self=True) gives the same result as
        # include_self=False, every group having a member, and runs the CPU kernel 2.5x faster.
        index = self.inverse if x.dim() == 1 else self.inverse[:, None].expand_as(x)
        start = torch.full((self.n_groups, *x.shape[1:]), identity, dtype=x.dtype, device=x.device)
        return start.scatter_reduce_(0, index, x, reduce)

    def all_equal(self, x: torch.Tensor) -> torch.Tensor:
        """Per group: True if its members' values are equal up to float32 rounding.

        ``max_g(x) - min_g(x) <= EQUAL_WITHIN_ULPS * eps_float32 * max(|min_g(x)|, |max_g(x)|)``;
        always True for a group of one. (``max(|lo|, |hi|) = max(hi, -lo)`` for
        ``lo <= hi``, one kernel fewer.)

        Shape: (B[, K]) -> (G[, K]) bool.
        """
        lowest, highest = self.min_max(x)
        tolerance = EQUAL_WITHIN_ULPS * torch.finfo(torch.float32).eps * torch.maximum(highest, -lowest)
        return highest - lowest <= tolerance

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        """``mean_g(x) = S_g / n_g``. Shape: (B[, K]) -> (G[, K])."""
        return self.sum(x).div_(self._sizes_like(x))

    def centred(self, x: torch.Tensor, constant: torch.Tensor | None = None) -> torch.Tensor:
        """``x_i - mean_g(x)``, exactly 0 in groups of one and all-equal groups.

        Equality is tested on the values themselves (:meth:`all_equal`, or
        ``constant`` when the caller already has it), since a float mean of
        equal numbers need not equal them.

        Shape: (B[, K]), optional (G[, K]) bool -> (B[, K]).
        """
        if constant is None:
            constant = self.all_equal(x)
        return torch.sub(x, self.expand(self.mean(x))).masked_fill_(self.expand(constant), 0.0)

    def std(self, centred: torch.Tensor) -> torch.Tensor:
        """Unbiased (Bessel, ``1/(n-1)``) std of each group from centred values.

        ``std_g = sqrt(sum_{i in g} c_i^2 / (n_g - 1))``, 0 for a group of one
        (whose centred value is 0).

        Shape: (B[, K]) -> (G[, K]).
        """
        return self.sum(centred * centred).div_(self._sizes_like(centred).sub(1).clamp_(min=1)).sqrt_()

    def _sizes_like(self, x: torch.Tensor) -> torch.Tensor:
        """``n_g`` in ``x``'s dtype, shaped to broadcast against ``[G, K]``; callers must not write into it."""
        sizes = self._sizes64 if x.dtype == torch.float64 else self.counts.to(x.dtype)
        return sizes if x.dim() == 1 else sizes.reshape(-1, *([1] * (x.dim() - 1)))
