"""Padding-free packing: the real tokens of a padded batch laid end to end in one row.

A collated batch (:mod:`rltk.batch`) pads every prompt on the left to ``P`` and
every response on the right to ``T``; a forward over it spends compute on every
padding column. :func:`pack_rows` keeps only the real tokens (``attention_mask
== 1``), row after row, in a single row ``[1, L]`` with ``L = sum of real
tokens``, and gives each sequence position ids that restart at 0.

Attention stays inside each sequence through what transformers itself offers
for packed rows: called with ``attention_mask=None`` and such position ids, a
transformers model (the mask utilities of transformers >= 4.5x) finds the
sequence boundaries where the position ids stop increasing by one and

* with ``attn_implementation="flash_attention_2"`` / ``"flash_attention_3"``
  (GPU) runs variable-length attention (``cu_seqlens`` from the position ids):
  no padding and no wasted attention;
* with ``"sdpa"``, ``"eager"`` or ``"flex_attention"`` (CPU and GPU) builds a
  block-diagonal causal mask: exact, but the attention scores of the ``[L, L]``
  square are computed (and masked) whole, so on those backends packing pays
  in the linear layers and the LM head while attention costs grow with ``L^2``.

A model whose attention ignores ``position_ids`` for masking (hand-written
modules, old remote code) would let sequences see each other: compare such a
model's packed log-probs with unpacked ones before using packing.

The position ids are those the padded layout gives (``cumsum(mask) - 1``), so
the packed forward computes the same function as the padded one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PackedRows", "pack_rows", "trim_padding"]


@dataclass
class PackedRows:
    """A padded ``[B, S]`` batch packed into one row, and where its response tokens went.

    Attributes:
        input_ids: the real tokens of every row, row after row. Shape: (1, L).
        position_ids: 0, 1, ... within each row's tokens. Shape: (1, L).
        predictors: for each response position ``(b, t)`` of the padded
            layout with a real token, the packed index of the hidden state that
            predicts it (the real token just before it). Shape: (N,).
        rows, cols: ``b`` and ``t`` of those ``N`` response positions, to
            scatter per-token results back into ``[B, T]``. Shape: (N,) each.
        labels: the response tokens themselves. Shape: (N,).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    predictors: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    labels: torch.Tensor

    def scatter(self, values: torch.Tensor, batch_size: int, response_width: int) -> torch.Tensor:
        """``values`` ``[N]`` (one per response token) laid out as ``[B, T]``, 0 on padding.

        Differentiable with respect to ``values``.
        """
        out = values.new_zeros(batch_size, response_width)
        return out.index_put((self.rows, self.cols), values)


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_width: int) -> PackedRows:
    """Pack the real tokens of a collated batch into one row (see the module docstring).

    Every real token is kept, including each row's last one (which predicts
    nothing): the row is then the whole sequence, as transformers expects of a
    packed row. The prompt of a row with a response must hold at least one
    real token, the one that predicts the first response token.

    Shape: (B, S), (B, S), int T -> :class:`PackedRows` with ``L`` = real tokens.
    """
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"pack_rows: input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} "
            "must be the same [B, S]"
        )
    batch_size, seq_len = input_ids.shape
    prompt_len = seq_len - response_width
    real = attention_mask.bool()
    # row-major boolean indexing keeps each row's tokens in order, row after row
    flat_index = real.reshape(-1).long().cumsum(0).reshape(batch_size, seq_len) - 1  # [B, S]
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # the padded layout's position ids
    response_real = real[:, prompt_len:]  # [B, T]
    rows, cols = response_real.nonzero(as_tuple=True)
    predictor_real = real[rows, prompt_len + cols - 1]
    if not bool(predictor_real.all()):
        bad = int(rows[~predictor_real][0])
        raise ValueError(
            f"pack_rows: row {bad} has a response token with no real token before it (an empty prompt); "
            "nothing in the row predicts it"
        )
    return PackedRows(
        input_ids=input_ids[real].unsqueeze(0),
        position_ids=positions[real].unsqueeze(0),
        predictors=flat_index[rows, prompt_len + cols - 1],
        rows=rows,
        cols=cols,
        labels=input_ids[rows, prompt_len + cols],
    )


def trim_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 response_width: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Drop the columns that are padding in every row: prompt columns left of the longest
    prompt, response columns right of the longest response.

    A micro-batch cut from a larger batch keeps the whole batch's width; after
    sorting rows by length, most of it is padding no row of the micro-batch
    needs. At least one prompt column is kept (it predicts the first response
    token).

    Shape: (B, S), (B, S), int T -> (B, P' + T'), (B, P' + T'), int T'.
    """
    prompt_len = input_ids.shape[1] - response_width
    real = attention_mask.bool()
    longest_prompt = max(int(real[:, :prompt_len].sum(-1).max()) if real.numel() else 0, 1)
    longest_response = int(real[:, prompt_len:].sum(-1).max()) if real.numel() and response_width else 0
    columns = slice(prompt_len - longest_prompt, prompt_len + longest_response)
    return input_ids[:, columns], attention_mask[:, columns], longest_response
