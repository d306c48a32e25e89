"""How the training loop runs the policy forward: one frozen settings object for every pass.

The old-policy pass, the reference pass and the update's training forward must
run the same way (same micro-batching, temperature, kernel, prompt sharing):
at equal weights their log-probs then match bitwise, and the KL gradient at a
stage's first step is exactly 0 on every strategy. :class:`ForwardSettings` is
built once per stage from the config and handed to each pass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from omegaconf import DictConfig


@dataclass(frozen=True)
class ForwardSettings:
    """The settings of a response log-prob forward, shared by every pass of a stage.

    Attributes:
        micro_batch_size: sequences per forward (``trainer.micro_batch_size``).
        temperature: the sampling temperature the log-probs are taken at (``rollout.temperature``).
        impl: the log-prob kernel (``model.logprob_impl``).
        chunk_size: rows per chunk of the log-prob kernel (``model.logprob_chunk_size``).
        max_tokens_per_micro_batch: micro-batches by a token budget instead of rows
            (``trainer.max_tokens_per_micro_batch``; see :mod:`rltk.training.micro_batches`).
        pack_sequences: each micro-batch packed into one row (``trainer.pack_sequences``).
        share_prompts: one prompt pass per group (see :func:`rltk.models.logprobs.response_logprobs`);
            :meth:`from_config` sets it as the policy's training forward runs.
    """

    micro_batch_size: int
    temperature: float = 1.0
    impl: str = "auto"
    chunk_size: int | None = None
    max_tokens_per_micro_batch: int | None = None
    pack_sequences: bool = False
    share_prompts: bool = True

    @classmethod
    def from_config(cls, cfg: DictConfig, strategy) -> "ForwardSettings":
        """A stage config's settings; prompts are shared only where ``strategy.model`` is a plain module,
        as the training forward shares them (so every pass runs the way the update does)."""
        from rltk.models.logprobs import prompt_sharing_applies

        t = cfg.trainer
        return cls(micro_batch_size=t.micro_batch_size, temperature=cfg.rollout.temperature,
                   impl=cfg.model.logprob_impl, chunk_size=cfg.model.logprob_chunk_size,
                   max_tokens_per_micro_batch=t.max_tokens_per_micro_batch, pack_sequences=t.pack_sequences,
                   share_prompts=prompt_sharing_applies(strategy.model))

    def kwargs(self) -> dict:
        """The settings as the keyword arguments of the passes (:func:`rltk.training.rl.batched_logprobs`,
        :func:`rltk.training.rl.policy_update`)."""
        return dataclasses.asdict(self)

    @property
    def batching(self) -> dict:
        """Only how rows are cut into micro-batches: the keywords of a pass that takes no log-probs
        (the critic's :func:`rltk.training.ppo.batched_values` and :func:`rltk.training.ppo.critic_update`)."""
        return {"micro_batch_size": self.micro_batch_size,
                "max_tokens_per_micro_batch": self.max_tokens_per_micro_batch,
                "pack_sequences": self.pack_sequences}
