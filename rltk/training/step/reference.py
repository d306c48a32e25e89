"""The frozen reference policy of a KL penalty: a copy of the policy, or, with LoRA, the policy itself.

Without LoRA the reference is the policy as the stage starts, copied and
frozen (a whole second model in memory); its weights are kept beside the
checkpoints so a resumed run compares against the same one. With LoRA
(``model.lora``) the reference is the same module with its adapters switched
off (:func:`rltk.models.lora.adapters_disabled`), i.e. the base model the
adapter was put on: no copy is held and nothing needs saving, since the base
weights never train.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rltk.models.lora import adapters_disabled, is_lora_model
from rltk.training.scaffold.resume import load_weights, save_weights_atomically
from rltk.training.step.forward import ForwardSettings, batched_logprobs


class FrozenReference:
    """Reference log-probs for a stage: build with :meth:`for_stage`, query with :meth:`logprobs`.

    Args:
        strategy: the policy's training strategy.
        copy: the frozen copy (no LoRA), or None to use the strategy's own
            module with its adapters off (LoRA).
    """

    def __init__(self, strategy, copy: torch.nn.Module | None):
        self.strategy = strategy
        self.copy = copy

    @classmethod
    def for_stage(cls, strategy, kl_coef: float) -> "FrozenReference | None":
        """The stage's reference (None when ``kl_coef`` is 0: no KL, no reference). Collective when the
        strategy shards parameters and the policy has no adapters (it gathers a whole copy then)."""
        if kl_coef <= 0:
            return None
        if is_lora_model(strategy.unwrap()):
            return cls(strategy, None)
        return cls(strategy, strategy.reference_model())

    @property
    def shares_policy(self) -> bool:
        """True under LoRA: the reference is the policy module with its adapters off."""
        return self.copy is None

    def logprobs(self, batch: dict[str, torch.Tensor], settings: ForwardSettings) -> torch.Tensor:
        """Reference log-probs ``[B, T]`` of the batch's responses, run as ``settings`` say (:func:`batched_logprobs`).

        Under LoRA the strategy's module runs with adapters off; a strategy that
        shards parameters makes that forward collective, so every rank runs it
        in lockstep (the strategy is passed on for that).
        """
        if self.copy is not None:
            return batched_logprobs(self.copy, batch, settings, strategy=self.strategy)[0]
        policy = self.strategy.unwrap()
        with adapters_disabled(policy):
            return batched_logprobs(policy, batch, settings, strategy=self.strategy)[0]

    def save(self, path: str | Path) -> None:
        """Keep the copy's weights at ``path`` (a safetensors file); nothing to keep under LoRA."""
        if self.copy is not None:
            save_weights_atomically(self.copy.state_dict(), path)

    def load(self, path: str | Path) -> None:
        """Restore the copy saved by :meth:`save` (a resumed stage); nothing to restore under LoRA."""
        if self.copy is not None:
            load_weights(path, self.copy)
