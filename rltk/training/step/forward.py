"""How the training loop runs the policy forward without gradients: the settings every pass shares,
and the old-policy pass (the reference's is :mod:`rltk.training.step.reference`, the update's own
training forward is :func:`rltk.training.updates.rl.policy_update`).

The old-policy pass, the reference pass and the update's training forward must
run the same way (same micro-batching, temperature, kernel, prompt sharing):
at equal weights their log-probs then match bitwise, and the KL gradient at a
stage's first step is exactly 0 on every strategy. :class:`ForwardSettings` is
built once per stage from the config and handed to each pass as one object.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from rltk.training.step.micro_batches import micro_batches, run_logprobs, run_values


@dataclass(frozen=True)
class ForwardSettings:
    """The settings of a response log-prob forward, shared by every pass of a stage.

    Attributes:
        micro_batch_size: sequences per forward (``trainer.micro_batch_size``).
        temperature: the sampling temperature the log-probs are taken at (``rollout.temperature``).
        impl: the log-prob kernel (``model.logprob_impl``).
        chunk_size: rows per chunk of the log-prob kernel (``model.logprob_chunk_size``).
        max_tokens_per_micro_batch: micro-batches by a token budget instead of rows
            (``trainer.max_tokens_per_micro_batch``; see :mod:`rltk.training.step.micro_batches`).
        pack_sequences: each micro-batch packed into one row (``trainer.pack_sequences``).
        share_prompts: one prompt pass per group (see :func:`rltk.models.logprobs.response_logprobs`);
            :meth:`from_config` sets it as the policy's training forward runs.
        routing_replay: an MoE policy's forwards route each token to the experts the rollout engine
            used (the batch's ``routed_experts``; ``algorithm.routing_replay=rollout``, :mod:`rltk.models.moe`).
    """

    micro_batch_size: int
    temperature: float = 1.0
    impl: str = "auto"
    chunk_size: int | None = None
    max_tokens_per_micro_batch: int | None = None
    pack_sequences: bool = False
    share_prompts: bool = True
    routing_replay: bool = False

    @classmethod
    def from_config(cls, cfg: DictConfig, strategy) -> "ForwardSettings":
        """A stage config's settings; prompts are shared only where ``strategy.model`` is a plain module,
        as the training forward shares them (so every pass runs the way the update does)."""
        from rltk.models.logprobs import prompt_sharing_applies

        from rltk.models.moe import is_moe

        t = cfg.trainer
        # an MoE policy runs every pass in one forward (no prompt sharing), the forward its routing aligns with
        moe = is_moe(strategy.model)
        return cls(micro_batch_size=t.micro_batch_size, temperature=cfg.rollout.temperature,
                   impl=cfg.model.logprob_impl, chunk_size=cfg.model.logprob_chunk_size,
                   max_tokens_per_micro_batch=t.max_tokens_per_micro_batch, pack_sequences=t.pack_sequences,
                   share_prompts=not moe and prompt_sharing_applies(strategy.model),
                   routing_replay=moe and cfg.algorithm.get("routing_replay", "none") in ("rollout", "r3"))

    @property
    def trim(self) -> bool:
        """Whether each micro-batch drops its all-padding columns first (a token budget groups rows by length)."""
        return self.max_tokens_per_micro_batch is not None

    def micro_batches(self, strategy, batch: dict[str, torch.Tensor], *,
                      fallback: dict[str, torch.Tensor] | None = None):
        """The micro-batches of ``batch`` these settings cut (see :func:`rltk.training.step.micro_batches.micro_batches`)."""
        return micro_batches(strategy, batch, micro_batch_size=self.micro_batch_size,
                             max_tokens=self.max_tokens_per_micro_batch, packed=self.pack_sequences, fallback=fallback)

    def logprobs(self, model: torch.nn.Module, data: dict[str, torch.Tensor], response_width: int, *,
                 with_entropy: bool = False, with_sum_pi_squared: bool = False,
                 router_trace=None, strategy=None) -> tuple[torch.Tensor, ...]:
        """One micro-batch's response log-probs (see :func:`rltk.training.step.micro_batches.run_logprobs`), run
        these settings' way; with gradients unless the caller turned them off. With ``routing_replay`` the
        rows' ``routed_experts`` are replayed; ``router_trace`` (:class:`rltk.models.moe.RouterTrace`)
        records an MoE policy's routers. With the ``strategy`` that trains or holds ``model`` the pass is
        its :meth:`~rltk.strategies.base.TrainingStrategy.logprobs`."""
        routed = data.get("routed_experts") if self.routing_replay else None
        return run_logprobs(model, data, response_width, trim=self.trim, pack=self.pack_sequences, strategy=strategy,
                            temperature=self.temperature, impl=self.impl, chunk_size=self.chunk_size,
                            share_prompts=self.share_prompts, with_entropy=with_entropy,
                            with_sum_pi_squared=with_sum_pi_squared, routed_experts=routed,
                            router_trace=router_trace)

    def values(self, critic: torch.nn.Module, data: dict[str, torch.Tensor], response_width: int) -> torch.Tensor:
        """One micro-batch's critic values (see :func:`rltk.training.step.micro_batches.run_values`), cut the same way.
        With ``routing_replay`` an MoE critic replays the rows' ``routed_experts`` too (a dense one has nothing to
        replay)."""
        from rltk.models.moe import is_moe

        routed = data.get("routed_experts") if self.routing_replay and is_moe(critic) else None
        return run_values(critic, data, response_width, trim=self.trim, pack=self.pack_sequences, routed_experts=routed)


@torch.no_grad()
def batched_logprobs(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    settings: ForwardSettings,
    *,
    with_entropy: bool = False,
    with_sum_pi_squared: bool = False,
    strategy=None,
) -> tuple[torch.Tensor, ...]:
    """Response log-probs (and entropy) of ``model`` for a whole batch, without gradients.

    Pass the ``strategy`` that trains or holds ``model`` (its policy, its
    :meth:`~rltk.strategies.base.TrainingStrategy.reference_model`): each pass
    is its ``logprobs``, and each rank runs as many forwards as the rank with
    the most micro-batches, repeating its first micro-batch and discarding the
    result (a sharded engine gathers parameters in every forward, a collective).

    ``settings`` (:class:`ForwardSettings`): micro-batching (a token budget and
    packed rows reorder micro-batches, the rows come back in the batch's order
    either way), temperature, kernel and prompt sharing, as the policy's
    training forward runs them, whichever module ``model`` is.

    Shape: returns ``(logprobs, entropy or None)``, ``[B, T]`` tensors on the
    batch's device, and ``sum_pi_squared`` ``[B, T]`` third when
    ``with_sum_pi_squared`` (see :func:`rltk.models.logprobs.response_logprobs`).
    """
    was_training = model.training
    model.eval()  # no dropout: old and reference log-probs must be deterministic
    B, T = batch["response_mask"].shape
    # the batch stays where the trainer keeps it (the CPU on a GPU machine); each micro-batch goes to the model
    batch_device, model_device = batch["response_mask"].device, _device_of(model)
    # logprobs, entropy, sum_pi_squared; a token-budget plan reorders rows, so each lands at its index
    outputs: list[torch.Tensor | None] = [None, None, None]
    for mb in settings.micro_batches(strategy, batch):
        data = {k: v.to(model_device) for k, v in mb.data.items()}
        parts = settings.logprobs(model, data, T, with_entropy=with_entropy, with_sum_pi_squared=with_sum_pi_squared,
                                  strategy=strategy)
        if mb.padding:
            continue
        for i, part in enumerate(parts):
            if part is not None:
                if outputs[i] is None:
                    outputs[i] = torch.zeros(B, T, dtype=torch.float32, device=batch_device)
                outputs[i][mb.rows] = part.float().to(batch_device)
    model.train(was_training)
    logprobs = outputs[0] if outputs[0] is not None else torch.zeros(B, T, device=batch_device)
    entropy = outputs[1] if with_entropy else None
    if with_sum_pi_squared:
        return logprobs, entropy, outputs[2]
    return logprobs, entropy


def _device_of(model: torch.nn.Module) -> torch.device:
    """Where ``model``'s parameters live (the CPU for a module without any)."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def old_logprobs_pass(policy: torch.nn.Module, batch: dict[str, torch.Tensor], settings: ForwardSettings, *,
                      use_rollout_logprobs: bool, with_sum_pi_squared: bool = False,
                      strategy=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(old_logprobs, sum_pi_squared)``: the behaviour policy's log-probs of the sampled tokens, and
    (``with_sum_pi_squared``, for an estimator that names it) ``sum_v pi_old(v)^2`` per token, else None.

    ``use_rollout_logprobs`` (``algorithm.use_rollout_logprobs``) takes the rollout engine's
    log-probs instead of a forward pass of ``policy``. The engine reports no distribution, so
    ``sum_pi_squared`` then still comes from one pass of ``policy``: the trainer's copy of the
    weights that sampled the batch. ``settings`` and ``strategy``: see :func:`batched_logprobs`.

    Shape: ``[B, T]`` each. Nothing is written into ``batch``.
    """
    if use_rollout_logprobs and not with_sum_pi_squared:
        return batch["rollout_logprobs"], None
    outputs = batched_logprobs(policy, batch, settings, with_sum_pi_squared=with_sum_pi_squared, strategy=strategy)
    old = batch["rollout_logprobs"] if use_rollout_logprobs else outputs[0]
    return old, outputs[2] if with_sum_pi_squared else None
