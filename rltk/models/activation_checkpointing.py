"""Gradient (activation) checkpointing of a Hugging Face model: ``model.gradient_checkpointing``.

Each decoder layer keeps only its input in the forward pass and runs again in
the backward pass to rebuild what its gradient needs, so activation memory
drops from ``layers x (everything a layer saves)`` to ``layers x [B, S, D]``
plus one layer's worth, for about one more forward pass of compute
(Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost",
arXiv:1604.06174).

What rltk relies on, each tested in ``tests/models/test_activation_checkpointing.py``:

* Gradients are those of the plain backward. torch's non-reentrant checkpoint
  restores the RNG state for the recompute, so dropout (a LoRA adapter's too)
  draws the same masks twice; on CPU the gradients come out bit for bit equal.
* Transformers checkpoints a layer only while the model is in train mode, and
  then drops any KV cache passed to it (``use_cache`` off). So a policy must
  train in train mode (:func:`rltk.training.scaffold.setup.build_tokenizer_and_policy`
  puts it there: ``from_pretrained`` returns eval mode), and every pass that
  runs on a cache (generation, a prompt shared by a group's rows) runs in eval
  mode or outside checkpointing.
"""

from __future__ import annotations

from torch import nn

# Non-reentrant: torch's recommended variant. It needs no input that requires grad (a frozen base
# under LoRA has none at the first layer), supports keyword tensors, and honours torch.no_grad.
CHECKPOINT_KWARGS = {"use_reentrant": False}


def enable_activation_checkpointing(model: nn.Module, config_key: str = "model.gradient_checkpointing") -> None:
    """Turn on activation checkpointing of every decoder layer of ``model`` (non-reentrant).

    Takes transformers' ``activation_checkpointing_enable`` (5.x) or its older
    name ``gradient_checkpointing_enable`` (4.x, deprecated in 5.x), on the model
    itself or through a wrapper that forwards attributes (a peft model). Raises
    ValueError naming ``config_key`` when the model offers neither.
    """
    enable = getattr(model, "activation_checkpointing_enable", None)
    if callable(enable):
        enable(activation_checkpointing_kwargs=dict(CHECKPOINT_KWARGS))
        return
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if callable(enable):
        enable(gradient_checkpointing_kwargs=dict(CHECKPOINT_KWARGS))
        return
    raise ValueError(
        f"{config_key}=true, but {type(model).__name__} offers no activation_checkpointing_enable() or "
        f"gradient_checkpointing_enable() (a Hugging Face PreTrainedModel does); set {config_key}=false"
    )

