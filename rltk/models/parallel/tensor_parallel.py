"""Tensor parallelism of a Hugging Face decoder through DTensor (``torch.distributed.tensor.parallel``).

Megatron's split of a transformer block (Shoeybi et al. 2019, https://arxiv.org/abs/1909.08053): attention's
q/k/v and the MLP's gate/up projections are column-parallel (each of the ``TP`` ranks computes ``1/TP`` of the
heads or of the intermediate features), o/down are row-parallel (each rank's partial product, summed by one
all-reduce), so a block costs two all-reduces forward and two backward. The plan is the model's own
``base_model_tp_plan`` (the config's, as ``from_pretrained(tp_plan="auto")`` reads it) where it has one,
else the Llama/Qwen names (:data:`DEFAULT_PLAN`). The LM head is column-parallel too, by vocabulary rows: its
output is gathered for callers of ``model(...).logits``, while the log-prob pass reads the shard and never
gathers (:func:`vocab_parallel_head_outputs`); the input embedding is sharded by the same rows (row-parallel
embedding: each rank looks up its rows, one all-reduce sums them), and a tied head stays tied to it. Norms and
anything else outside the plan stay replicated: every rank of a group computes them on the same inputs, so their
gradients agree without communication.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from rltk.kernels import IGNORE_INDEX
from rltk.models.parallel.sizes import DIVIDED_SIZES, check_tensor_parallel_sizes

#: the plan of Llama-like decoders (Llama, Qwen2/3, Mistral), for a model whose config names none
DEFAULT_PLAN = {
    "layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise",
}


def model_sizes(model: nn.Module) -> dict[str, Any]:
    """The sizes of ``model``'s config that a tensor-parallel size must divide (:data:`DIVIDED_SIZES`)."""
    config = getattr(model, "config", None)
    return {name: getattr(config, name, None) for name in DIVIDED_SIZES}


def tensor_parallel_plan(model: nn.Module) -> dict[str, Any]:
    """Module path (with ``*``) -> ParallelStyle for :func:`apply_tensor_parallel`."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
              # token ids in, the vocabulary rows split, the partial lookups summed
              "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
              "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate())}
    base_plan = dict(getattr(getattr(model, "config", None), "base_model_tp_plan", None) or DEFAULT_PLAN)
    prefix = getattr(model, "base_model_prefix", "model")
    plan = {}
    for path, style in base_plan.items():
        if style not in styles:
            raise NotImplementedError(
                f"{type(model).__name__}'s base_model_tp_plan asks for '{style}' at {path}; rltk's tensor "
                f"parallelism builds {', '.join(styles)} only (per-head norms and packed experts are not "
                f"built yet): train it with strategy_args.tensor_parallel_size=1")
        plan[f"{prefix}.{path}"] = styles[style]()
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    head_path = _module_path(model, head)
    # whole logits for callers of model(...).logits; the log-prob pass reads the vocabulary shard instead
    plan[head_path] = ColwiseParallel(output_layouts=Replicate())
    # the input embedding by the same rows (a tied head shares them): replicated, an untied one would keep
    # V x D per rank, 0.63x the state of one process instead of 0.50x (benchmarks/parallel.py tp-memory)
    plan.setdefault(_module_path(model, embedding), RowwiseParallel(input_layouts=Replicate()))
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh) -> nn.Module:
    """Shard ``model`` in place over the 1-D device mesh ``tp_mesh`` (:func:`tensor_parallel_plan`)."""
    from torch.distributed.tensor.parallel import parallelize_module

    check_tensor_parallel_sizes(model_sizes(model), tp_mesh.size(), f"the {type(model).__name__} being sharded")
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head.weight is embedding.weight
    parallelize_module(model, tp_mesh, tensor_parallel_plan(model))
    if tied:  # each style distributed its own copy of the shared matrix: share the embedding's again
        head.weight = embedding.weight
    return model


def _module_path(model: nn.Module, target: nn.Module) -> str:
    for name, module in model.named_modules():
        if module is target:
            return name
    raise ValueError(f"{type(target).__name__} is not a submodule of {type(model).__name__}")


def vocab_sharded_head(weight: torch.Tensor):
    """``(local rows, process group)`` of a head weight sharded by vocabulary rows over one mesh dimension
    (a DTensor with ``Shard(0)`` there and ``Replicate`` elsewhere, as inside an FSDP2 unit's forward), or None."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(weight, DTensor):
        return None
    row_dims = [dim for dim, placement in enumerate(weight.placements) if placement == Shard(0)]
    if len(row_dims) != 1 or any(not p.is_replicate() for d, p in enumerate(weight.placements) if d != row_dims[0]):
        return None
    return weight.to_local(), weight.device_mesh.get_group(row_dims[0])


def vocab_parallel_head_outputs(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, *,
                                temperature: float = 1.0, impl: str = "auto",
                                chunk_size: int | Sequence[int] | None = None, ignore_index: int = IGNORE_INDEX,
                                with_sum_pi_squared: bool = False) -> tuple[torch.Tensor, ...]:
    """The fused log-prob op's outputs for a head whose weight is vocabulary-sharded (:func:`vocab_sharded_head`):
    this rank's rows and the group's partial statistics, never the logits. ``hidden`` (N, D), ``labels`` (N,)
    -> ``(logprobs, entropy[, sum_pi_squared])`` (N,) each, as :func:`rltk.kernels.token_logprobs_and_entropy`.

    The hook a log-prob pass calls where the head's weight is such a DTensor (after the forward that unsharded it).
    """
    from rltk.models.parallel.vocab_parallel import vocab_parallel_logprobs_and_entropy

    sharded = vocab_sharded_head(head.weight)
    if sharded is None:
        raise ValueError(f"the head weight ({type(head.weight).__name__}) is not sharded by vocabulary rows over "
                         "one mesh dimension")
    weight, group = sharded
    bias = getattr(head, "bias", None)
    if bias is not None:
        bias = bias.to_local() if hasattr(bias, "to_local") else bias
    dtype = torch.promote_types(hidden.dtype, weight.dtype)
    return vocab_parallel_logprobs_and_entropy(
        hidden.to(dtype), weight.to(dtype), labels, group=group, bias_shard=None if bias is None else bias.to(dtype),
        temperature=temperature, impl=impl, chunk_size=chunk_size, ignore_index=ignore_index,
        with_sum_pi_squared=with_sum_pi_squared)


def tensor_parallel_response_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                      response_width: int, *, temperature: float = 1.0, impl: str = "auto",
                                      chunk_size: int | Sequence[int] | None = None,
                                      with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`rltk.models.logprobs.response_logprobs` (padded rows) of a tensor-parallel model: the model's own
    forward up to its last hidden states, then the vocabulary-parallel head op. Shapes: ``input_ids`` and
    ``attention_mask`` (B, S) -> ``(logprobs, entropy or None)`` (B, T), 0 on response padding."""
    from rltk.models.logprobs import last_hidden_states, logit_temperature_factor, output_head_module

    batch_size, total = input_ids.shape
    prompt_len = total - response_width
    hidden = last_hidden_states(model, input_ids[:, :-1], attention_mask[:, :-1])[:, prompt_len - 1:]
    valid = attention_mask[:, prompt_len:].bool()
    labels = input_ids[:, prompt_len:].masked_fill(~valid, IGNORE_INDEX).reshape(-1)
    logprobs, entropy = vocab_parallel_head_outputs(
        output_head_module(model), hidden.reshape(batch_size * response_width, -1), labels,
        temperature=temperature * logit_temperature_factor(model), impl=impl, chunk_size=chunk_size)
    entropy = torch.where(valid, entropy.view(batch_size, response_width), 0.0) if with_entropy else None
    return logprobs.view(batch_size, response_width), entropy
