"""Micro-batches formed by a token budget, and the forwards that run them trimmed or packed.

RL responses are ragged (tens to thousands of tokens). Cutting a mini-batch
into micro-batches of ``trainer.micro_batch_size`` sequences, each padded to the
batch's longest row, spends most of the compute on padding. With
``trainer.max_tokens_per_micro_batch = M`` a micro-batch is instead a set of
rows whose *computed* tokens stay within ``M``:

* padded (``trainer.pack_sequences=false``): a micro-batch costs ``rows x
  (longest prompt + longest response)`` after :func:`rltk.models.packing.trim_padding`
  drops the columns no row of it needs. Rows are sorted by length and cut into
  contiguous runs, so rows of similar length share a micro-batch.
* packed (``trainer.pack_sequences=true``): a micro-batch costs the sum of its
  rows' real tokens, laid end to end in one row (:mod:`rltk.models.packing`).
  Rows are spread over the bins longest first, each into the least-filled bin
  (LPT, Graham 1969, "Bounds on multiprocessing timing anomalies").

**Balanced across ranks.** Every rank must run the same number of forwards
(sharded engines gather parameters in each; DDP reduces in the last backward).
Each rank finds the fewest micro-batches its rows fit in, the ranks take the
largest of those counts ``k``, and every rank spreads its rows over ``k``
micro-batches as evenly as the budget's cost allows (LPT for packed bins; for
padded runs the smallest per-micro-batch bound that still gives ``k`` runs).
A rank with fewer rows than ``k`` runs zero-weight padding micro-batches (one
row of its own, loss times 0), as the row-count micro-batches do.

A row longer than ``M`` on its own gets a micro-batch to itself: a sequence
cannot be split, and refusing it mid-run would end training on one long sample.

**Exactness.** Which rows share a micro-batch does not change the loss: every
aggregation is a sum over rows divided by the mini-batch's *global* token and
sequence counts (:mod:`rltk.algorithms.aggregation`), so the summed gradient is
that of one big batch under any plan, up to float rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import torch

from rltk.batch import slice_batch
from rltk.models.critic import response_values
from rltk.models.logprobs import response_logprobs
from rltk.models.packing import trim_padding
from rltk.models.vision.inputs import vision_inputs_of
from rltk.training.step.ranks import all_ranks_max

__all__ = [
    "MicroBatch",
    "micro_batch_count",
    "micro_batches",
    "plan_micro_batches",
    "row_lengths",
    "run_logprobs",
    "run_values",
]


@dataclass
class MicroBatch:
    """One forward/backward's share of a mini-batch.

    Attributes:
        data: the rows (every batch field, full widths ``[b, P + T]`` / ``[b, T]``).
        rows: their indices in the mini-batch the micro-batches were cut from. Shape: (b,).
        is_last: the last micro-batch of the mini-batch (DDP all-reduces in its backward).
        padding: a zero-weight repeat run only to keep ranks in lockstep: run it, multiply
            its loss by 0, discard its outputs.
    """

    data: dict[str, torch.Tensor]
    rows: torch.Tensor
    is_last: bool
    padding: bool


def row_lengths(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prompt tokens, response tokens)`` of each row: the real (attention-mask) tokens left and
    right of column ``P``. Shape: (B, S), (B, T) fields -> (B,), (B,) int64."""
    width = batch["response_mask"].shape[1]
    mask = batch["attention_mask"].long()
    prompt_len = mask.shape[1] - width
    return mask[:, :prompt_len].sum(-1).cpu(), mask[:, prompt_len:].sum(-1).cpu()


def _greedy_runs(order: list[int], prompts: list[int], responses: list[int], bound: int) -> list[list[int]]:
    """Cut ``order`` into contiguous runs, each as long as its padded cost stays within ``bound``
    (a row over ``bound`` alone forms a run). Greedy gives the fewest runs for a monotone cost."""
    runs: list[list[int]] = []
    run: list[int] = []
    longest_prompt = longest_response = 0
    for i in order:
        p, t = max(longest_prompt, prompts[i], 1), max(longest_response, responses[i])
        if run and (len(run) + 1) * (p + t) > bound:
            runs.append(run)
            run, p, t = [], max(prompts[i], 1), responses[i]
        run.append(i)
        longest_prompt, longest_response = p, t
    if run:
        runs.append(run)
    return runs


def _lpt_bins(sizes: list[int], k: int) -> list[list[int]]:
    """Longest first, each row into the least-filled of ``k`` bins (ties: the lowest bin)."""
    bins: list[list[int]] = [[] for _ in range(k)]
    loads = [0] * k
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        j = min(range(k), key=lambda j: (loads[j], j))
        bins[j].append(i)
        loads[j] += sizes[i]
    return bins


def _fits(bins: list[list[int]], sizes: list[int], max_tokens: int) -> bool:
    return all(len(b) <= 1 or sum(sizes[i] for i in b) <= max_tokens for b in bins)


def micro_batch_count(prompts: list[int], responses: list[int], max_tokens: int, *, packed: bool) -> int:
    """The fewest micro-batches these rows fit in under the budget (0 for no rows).

    ``prompts`` / ``responses``: real tokens of each row (:func:`row_lengths`).
    """
    return len(plan_micro_batches(prompts, responses, max_tokens, packed=packed))


def plan_micro_batches(prompts: list[int], responses: list[int], max_tokens: int, *, packed: bool,
                       count: int | None = None) -> list[list[int]]:
    """Row indices of each micro-batch under a budget of ``max_tokens`` computed tokens.

    Args:
        prompts, responses: real tokens of each row (:func:`row_lengths`).
        max_tokens: the budget (``trainer.max_tokens_per_micro_batch``); a row
            over it alone forms a micro-batch.
        packed: cost a micro-batch as packed (sum of its rows' tokens) or
            trimmed-padded (rows x (longest prompt + longest response)).
        count: spread the rows over this many micro-batches (at least the
            fewest they fit in, e.g. the largest count over ranks) as evenly as
            the budget allows; ``None`` gives the fewest.

    Returns:
        Non-empty lists of row indices, ascending within each micro-batch;
        every row in exactly one. At most ``count`` lists; fewer when there are
        fewer rows, or when the packed spread over ``count`` bins would break the
        budget (the fewest-bin plan is returned then, and the caller pads).
    """
    n = len(prompts)
    if len(responses) != n:
        raise ValueError(f"plan_micro_batches: {n} prompt lengths but {len(responses)} response lengths")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"plan_micro_batches: max_tokens={max_tokens!r} must be an integer >= 1")
    if n == 0:
        return []
    if packed:
        sizes = [prompts[i] + responses[i] for i in range(n)]
        # the fewest LPT bins within budget; the sum bound is where the search starts
        fewest = max(1, math.ceil(sum(sizes) / max_tokens))
        while not _fits(_lpt_bins(sizes, fewest), sizes, max_tokens):
            fewest += 1
        k = fewest if count is None else max(count, fewest)
        bins = _lpt_bins(sizes, k)
        if not _fits(bins, sizes, max_tokens):  # LPT over more bins can (rarely) be worse: keep the fewest
            bins = _lpt_bins(sizes, fewest)
        return [sorted(b) for b in bins if b]
    # padded: longest first, so rows of similar length share a micro-batch and little is trimmed away
    order = sorted(range(n), key=lambda i: (-(prompts[i] + responses[i]), i))
    runs = _greedy_runs(order, prompts, responses, max_tokens)
    if count is not None and count > len(runs):
        # the smallest bound that still gives at most `count` runs: the most even spread (runs only
        # shrink as the bound grows, so bisect on it)
        low, high = 1, max_tokens  # the budget itself gives the fewest runs, at most `count`
        while low < high:
            mid = (low + high) // 2
            if len(_greedy_runs(order, prompts, responses, mid)) <= count:
                high = mid
            else:
                low = mid + 1
        runs = _greedy_runs(order, prompts, responses, high)
    return [sorted(r) for r in runs]


def micro_batches(strategy, rows: dict[str, torch.Tensor], *, micro_batch_size: int,
                  max_tokens: int | None = None, packed: bool = False,
                  fallback: dict[str, torch.Tensor] | None = None) -> Iterator[MicroBatch]:
    """The micro-batches of ``rows``, the same number on every rank.

    ``max_tokens=None``: runs of ``micro_batch_size`` rows in order (the
    rows in order, as the supervised warm-up and the default RL update cut them).
    Otherwise the token-budget plan of :func:`plan_micro_batches`, balanced
    across ranks (module docstring). A rank with fewer micro-batches than the
    busiest yields padding ones; a rank with no rows takes them from
    ``fallback`` (the whole rollout batch around an empty mini-batch).
    """
    n_rows = rows["input_ids"].shape[0]
    if max_tokens is None:
        plan = [list(range(s, min(s + micro_batch_size, n_rows))) for s in range(0, n_rows, micro_batch_size)]
        total = all_ranks_max(strategy, len(plan))
        pad_rows = list(range(min(micro_batch_size, n_rows or fallback["input_ids"].shape[0])))
    else:
        prompts, responses = (x.tolist() for x in row_lengths(rows))
        fewest = micro_batch_count(prompts, responses, max_tokens, packed=packed)
        total = all_ranks_max(strategy, fewest)
        plan = plan_micro_batches(prompts, responses, max_tokens, packed=packed, count=total)
        pad_rows = [0]  # a zero-weight forward needs no more than one row
    source = rows if n_rows or fallback is None else fallback
    for i in range(total):
        padding = i >= len(plan)
        index = torch.tensor(pad_rows if padding else plan[i], dtype=torch.long)
        yield MicroBatch(slice_batch(source, index), index, i == total - 1, padding)


def run_logprobs(model: torch.nn.Module, data: dict[str, torch.Tensor], response_width: int, *,
                 trim: bool, pack: bool, strategy=None, **kwargs) -> tuple[torch.Tensor, ...]:
    """:func:`rltk.models.logprobs.response_logprobs` of one micro-batch, padded, trimmed or packed,
    with outputs ``[b, T]`` at the batch's response width ``T`` whichever way it ran.

    ``trim`` drops the columns that are padding in every row first
    (:func:`rltk.models.packing.trim_padding`); ``pack`` packs the rows into one
    (``response_logprobs(pack=True)``); ``kwargs`` go to ``response_logprobs``. With a ``strategy`` the
    pass is its :meth:`~rltk.strategies.base.TrainingStrategy.logprobs` (an engine that splits sequences
    or layers runs it its way).
    """
    input_ids, attention_mask, width, routed = _cut(data, response_width, kwargs.pop("routed_experts", None),
                                                    trim=trim or pack)
    forward = response_logprobs if strategy is None else strategy.logprobs
    # a VLM's rows carry their own images (rltk.models.vision.inputs): only these rows' reach the model
    vision = vision_inputs_of(data)
    if vision is not None:
        kwargs["vision_inputs"] = vision
    outputs = forward(model, input_ids, attention_mask, width, pack=pack, routed_experts=routed, **kwargs)
    return tuple(None if o is None else _pad_columns(o, response_width) for o in outputs)


def run_values(critic: torch.nn.Module, data: dict[str, torch.Tensor], response_width: int, *,
               trim: bool, pack: bool, routed_experts: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`rltk.models.critic.response_values` of one micro-batch (see :func:`run_logprobs`). Shape: (b, T)."""
    input_ids, attention_mask, width, routed = _cut(data, response_width, routed_experts, trim=trim or pack)
    values = response_values(critic, input_ids, attention_mask, width, pack=pack, routed_experts=routed)
    return _pad_columns(values, response_width)


def _cut(data: dict[str, torch.Tensor], response_width: int, routed: torch.Tensor | None, *, trim: bool):
    """The micro-batch's ids, mask, response width and routing ``[b, P + T, L, k]``, with the columns that are
    padding in every row dropped when ``trim`` (:func:`rltk.models.packing.trim_padding`)."""
    input_ids, attention_mask, width = data["input_ids"], data["attention_mask"], response_width
    if trim:
        input_ids, attention_mask, width = trim_padding(input_ids, attention_mask, response_width)
        if routed is not None:  # the kept columns: the last P' of the prompt and the first T' of the response
            prompt_len = data["input_ids"].shape[1] - response_width
            routed = routed[:, prompt_len - (input_ids.shape[1] - width): prompt_len + width]
    return input_ids, attention_mask, width, routed


def _pad_columns(values: torch.Tensor, width: int) -> torch.Tensor:
    """Right-pad ``[b, T']`` with zeros to ``[b, width]`` (differentiable)."""
    missing = width - values.shape[1]
    return torch.nn.functional.pad(values, (0, missing)) if missing else values
