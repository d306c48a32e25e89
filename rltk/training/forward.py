"""How the training loop runs the policy forward without gradients: the settings every pass shares,
and the old-policy pass (the reference's is :mod:`rltk.training.reference`, the update's own
training forward is :func:`rltk.training.rl.policy_update`).

The old-policy pass, the reference pass and the update's training forward must
run the same way (same micro-batching, temperature, kernel, prompt sharing):
at equal weights their log-probs then match bitwise, and the KL gradient at a
stage's first step is exactly 0 on every strategy. :class:`ForwardSettings` is
built once per stage from the config and handed to each pass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from rltk.training.micro_batches import micro_batches, run_logprobs


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
        """The settings as the keyword arguments of the passes (:func:`batched_logprobs`,
        :func:`rltk.training.rl.policy_update`)."""
        return dataclasses.asdict(self)

    @property
    def batching(self) -> dict:
        """Only how rows are cut into micro-batches: the keywords of a pass that takes no log-probs
        (the critic's :func:`rltk.training.ppo.batched_values` and :func:`rltk.training.ppo.critic_update`)."""
        return {"micro_batch_size": self.micro_batch_size,
                "max_tokens_per_micro_batch": self.max_tokens_per_micro_batch,
                "pack_sequences": self.pack_sequences}


@torch.no_grad()
def batched_logprobs(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    *,
    micro_batch_size: int,
    temperature: float,
    impl: str = "auto",
    chunk_size: int | None = None,
    with_entropy: bool = False,
    with_sum_pi_squared: bool = False,
    strategy=None,
    max_tokens_per_micro_batch: int | None = None,
    pack_sequences: bool = False,
    share_prompts: bool = True,
) -> tuple[torch.Tensor, ...]:
    """Response log-probs (and entropy) of ``model`` for a whole batch, without gradients.

    Pass the ``strategy`` that shards ``model`` (ZeRO-3, FSDP): every forward
    then gathers parameters collectively, so each rank runs as many forwards
    as the rank with the most micro-batches, repeating its first micro-batch
    and discarding the result.

    ``max_tokens_per_micro_batch`` forms micro-batches by a token budget and
    ``pack_sequences`` packs each into one row (:mod:`rltk.training.micro_batches`);
    the rows come back in the batch's order either way.

    ``share_prompts`` (see :func:`rltk.models.logprobs.response_logprobs`): pass
    ``prompt_sharing_applies(strategy.model)`` so that this pass runs the way
    the policy's training forward does, whichever module ``model`` is.

    Shape: returns ``(logprobs, entropy or None)``, ``[B, T]`` tensors on the
    batch's device, and ``sum_pi_squared`` ``[B, T]`` third when
    ``with_sum_pi_squared`` (see :func:`rltk.models.logprobs.response_logprobs`).
    """
    was_training = model.training
    model.eval()  # no dropout: old and reference log-probs must be deterministic
    B, T = batch["response_mask"].shape
    # logprobs, entropy, sum_pi_squared; a token-budget plan reorders rows, so each lands at its index
    outputs: list[torch.Tensor | None] = [None, None, None]
    for mb in micro_batches(strategy, batch, micro_batch_size=micro_batch_size,
                            max_tokens=max_tokens_per_micro_batch, packed=pack_sequences):
        parts = run_logprobs(
            model, mb.data, T, trim=max_tokens_per_micro_batch is not None, pack=pack_sequences,
            temperature=temperature, impl=impl, with_entropy=with_entropy, chunk_size=chunk_size,
            with_sum_pi_squared=with_sum_pi_squared, share_prompts=share_prompts,
        )
        if mb.padding:
            continue
        for i, part in enumerate(parts):
            if part is not None:
                if outputs[i] is None:
                    outputs[i] = torch.zeros(B, T, dtype=torch.float32, device=part.device)
                outputs[i][mb.rows.to(part.device)] = part.float()
    model.train(was_training)
    logprobs = outputs[0] if outputs[0] is not None else torch.zeros(B, T)
    entropy = outputs[1] if with_entropy else None
    if with_sum_pi_squared:
        return logprobs, entropy, outputs[2]
    return logprobs, entropy


def old_logprobs_pass(policy: torch.nn.Module, batch: dict[str, torch.Tensor], *, use_rollout_logprobs: bool,
                      with_sum_pi_squared: bool = False, micro_batch_size: int, temperature: float,
                      impl: str = "auto", chunk_size: int | None = None, strategy=None,
                      max_tokens_per_micro_batch: int | None = None, pack_sequences: bool = False,
                      share_prompts: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(old_logprobs, sum_pi_squared)``: the behaviour policy's log-probs of the sampled tokens, and
    (``with_sum_pi_squared``, for an estimator that names it) ``sum_v pi_old(v)^2`` per token, else None.

    ``use_rollout_logprobs`` (``algorithm.use_rollout_logprobs``) takes the rollout engine's
    log-probs instead of a forward pass of ``policy``. The engine reports no distribution, so
    ``sum_pi_squared`` then still comes from one pass of ``policy``: the trainer's copy of the
    weights that sampled the batch. The other keywords: see :func:`batched_logprobs`
    (:class:`rltk.training.forward.ForwardSettings` holds them).

    Shape: ``[B, T]`` each. Nothing is written into ``batch``.
    """
    if use_rollout_logprobs and not with_sum_pi_squared:
        return batch["rollout_logprobs"], None
    outputs = batched_logprobs(policy, batch, micro_batch_size=micro_batch_size, temperature=temperature,
                               impl=impl, chunk_size=chunk_size, with_sum_pi_squared=with_sum_pi_squared,
                               strategy=strategy, max_tokens_per_micro_batch=max_tokens_per_micro_batch,
                               pack_sequences=pack_sequences, share_prompts=share_prompts)
    old = batch["rollout_logprobs"] if use_rollout_logprobs else outputs[0]
    return old, outputs[2] if with_sum_pi_squared else None
