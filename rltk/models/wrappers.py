"""The model inside the wrappers training puts around it (DDP, Accelerate, a DeepSpeed engine, peft).

One walk for every layer that needs the module itself: the log-prob and
critic forwards, the rollout engines, the divergence guard.
"""

from __future__ import annotations

from torch import nn


def _is_peft_model(model: nn.Module) -> bool:
    # the class may be FSDP2's subclass of PeftModel, hence the walk over the bases
    return (any(c.__module__.startswith("peft.") for c in type(model).__mro__)
            and callable(getattr(model, "get_base_model", None)))


def unwrap_model(model: nn.Module, *, through_peft: bool = True) -> nn.Module:
    """The module inside DDP / Accelerate / DeepSpeed-engine style wrappers (those holding it in ``.module``)
    and, with ``through_peft`` (the default), inside peft's ``PeftModel`` too (its base model).

    peft injects its adapter layers into the base model's own modules, so the base model's forward
    runs them: seen through, a LoRA policy is an ordinary causal LM, which is what the log-prob and
    critic forwards need. ``through_peft=False`` stops at the ``PeftModel``: the rollout engines keep
    it, so that what they sample from and copy weights between is the module the trainer holds, with
    peft's state-dict names (:mod:`rltk.rollout.vllm_engine` maps those to the plain architecture).
    """
    while True:
        if _is_peft_model(model):
            if not through_peft:
                return model
            model = model.get_base_model()
        # Ask the class, not the instance: DeepSpeed's engine forwards unknown attributes to its
        # module, so hasattr(engine, "get_output_embeddings") is True; a causal LM's class has it.
        elif not hasattr(type(model), "get_output_embeddings") and isinstance(getattr(model, "module", None),
                                                                                nn.Module):
            model = model.module
        else:
            return model
