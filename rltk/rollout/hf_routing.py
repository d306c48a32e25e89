"""The ``hf`` engine's record of an MoE policy's routing: which experts each token went through while sampling.

``model.generate`` runs the policy once over the prompts (prefill; with the engine's shared prompt cache,
the distinct prompts but their last token, then the last token on every row) and then once per sampled
token on every row. :func:`record_generation_routing` hooks every router (:func:`rltk.models.moe.route`
with a trace) and the base model (for each forward's ``[rows, columns]``), and
:meth:`GenerationRouting.rows` lays the calls end to end: ``[N, W + steps, L, k]``, column ``c`` the
experts of the token at column ``c`` of the left-padded prompt followed by the generated tokens. A
completion's own slice (:meth:`GenerationRouting.completion`) covers its real prompt tokens and its
response tokens, the last one ``-1``: the engine never ran the last sampled token (it predicts nothing).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn

from rltk.models.logprobs import base_model
from rltk.models.moe import RouterTrace, route
from rltk.models.wrappers import unwrap_model
from rltk.rollout.hf_sampling import shared_prompts


@dataclass
class GenerationRouting:
    """The routers' choices over one batched generation (see the module docstring)."""

    trace: RouterTrace = field(default_factory=RouterTrace)
    shapes: list[tuple[int, int]] = field(default_factory=list)  # [rows, columns] of each forward

    def rows(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``[N, W + steps, L, k]`` int64 for the ``[N, W]`` left-padded prompts generation ran on."""
        n_rows = input_ids.shape[0]
        prompt_of_row = None
        layers = []
        for calls in self.trace.used:
            if len(calls) != len(self.shapes):
                raise RuntimeError(f"internal error: a router ran {len(calls)} times in {len(self.shapes)} forwards")
            pieces = [indices.reshape(rows, columns, -1) for indices, (rows, columns) in zip(calls, self.shapes)]
            if pieces and pieces[0].shape[0] != n_rows:
                # the shared prompt cache's prefill over the distinct prompts: out to every row of each prompt
                if prompt_of_row is None:
                    prompt_of_row, _ = shared_prompts(input_ids, attention_mask)
                pieces[0] = pieces[0][prompt_of_row]
            layers.append(torch.cat(pieces, dim=1))  # [N, columns, k]
        return torch.stack(layers, dim=2).cpu()

    @staticmethod
    def completion(rows: torch.Tensor, row: int, width: int, prompt_length: int, response_length: int) -> list:
        """Row ``row``'s routing (of :meth:`rows`, prompts ``width`` columns wide) as nested lists
        ``[prompt_length + response_length][L][k]``: its real prompt tokens and response tokens, the last
        response token ``-1`` (never run)."""
        start, stop = width - prompt_length, width + max(response_length - 1, 0)
        routing = rows[row, start:stop]
        if response_length:
            routing = torch.cat([routing, torch.full_like(routing[:1], -1)])
        return routing.tolist()


@contextlib.contextmanager
def record_generation_routing(model: nn.Module) -> Iterator[GenerationRouting]:
    """Record every router's top-k over the forwards run inside the block (see the module docstring)."""
    record = GenerationRouting()
    decoder = base_model(unwrap_model(model))

    def note_shape(module, args, kwargs):
        tokens = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
        if tokens is None and args:
            tokens = args[0]
        record.shapes.append((int(tokens.shape[0]), int(tokens.shape[1])))

    handle = decoder.register_forward_pre_hook(note_shape, with_kwargs=True)
    try:
        with route(model, trace=record.trace):
            yield record
    finally:
        handle.remove()
