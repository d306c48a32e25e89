"""What a user of MoE RL reads each step: how often the trainer's router disagrees with the rollout's, how
balanced the experts are, and how far the trainer's log-probs sit from the engine's with and without
routing replay (:mod:`rltk.models.moe`).

Computed on a batch that carries ``routed_experts`` (an MoE policy sampled by an engine that records
routing), before the update, with the policy that sampled it (two no-grad passes over the batch, one with
the trainer's own routing, one replaying the rollout's):

* ``moe/topk_mismatch`` and ``moe/topk_mismatch/layer_<l>``: fraction of the real tokens whose trainer-side
  top-k set differs from the rollout's;
* ``moe/load_entropy`` (+ ``/layer_<l>``) and ``moe/load_max_share``: the experts' shares of the trainer's
  own top-k assignments (entropy over ``log E``: 1 is perfectly balanced; largest share: ``1/E`` balanced);
* ``moe/mismatch_kl_own_routing`` and ``moe/mismatch_kl_replay``: the k3 estimate of
  KL(pi_rollout || pi_trainer) over the response tokens, ``mean(r - 1 - log r)`` with
  ``r = pi_trainer / pi_rollout`` (Schulman 2020, "Approximating KL divergence"), with the trainer's own
  routing and with the rollout's replayed; ``moe/logprob_gap_own_routing`` / ``moe/logprob_gap_replay``:
  the mean ``|log pi_trainer - log pi_rollout|``.

Means are over this rank's tokens.
"""

from __future__ import annotations

import dataclasses

import torch

from rltk.models.moe import RouterTrace, routing_metrics, routing_shape
from rltk.training.step.forward import ForwardSettings


@torch.no_grad()
def moe_step_metrics(policy: torch.nn.Module, batch: dict[str, torch.Tensor], settings: ForwardSettings, *,
                     strategy=None) -> dict[str, float]:
    """The MoE metrics of ``batch`` (module docstring); ``{}`` for a batch without ``routed_experts``."""
    if "routed_experts" not in batch:
        return {}
    num_experts = routing_shape(policy)[2]
    aligned = dataclasses.replace(settings, routing_replay=True)  # hands routed_experts to every forward
    was_training = policy.training
    policy.eval()
    width = batch["response_mask"].shape[1]
    own_lp = torch.zeros(batch["response_mask"].shape)
    replay_lp = torch.zeros(batch["response_mask"].shape)
    parts: dict[str, list[torch.Tensor]] = {"own": [], "rollout": [], "valid": []}
    device = next(policy.parameters()).device
    try:
        for mb in aligned.micro_batches(strategy, batch):
            data = {k: v.to(device) for k, v in mb.data.items()}
            trace = RouterTrace(replay=False)
            own = aligned.logprobs(policy, data, width, router_trace=trace, strategy=strategy)[0]
            replayed = aligned.logprobs(policy, data, width, strategy=strategy)[0]
            if mb.padding:
                continue
            own_lp[mb.rows], replay_lp[mb.rows] = own.float().cpu(), replayed.float().cpu()
            parts["own"].append(trace.stacked("own").cpu())
            parts["rollout"].append(trace.rollout.cpu())
            parts["valid"].append(trace.valid.cpu())
    finally:
        policy.train(was_training)
    own_routing, valid = torch.cat(parts["own"]), torch.cat(parts["valid"])
    metrics = routing_metrics(own_routing, valid, num_experts, own=own_routing, rollout=torch.cat(parts["rollout"]))
    mask = batch["response_mask"].bool().cpu() & batch["has_rollout_logprobs"].cpu()[:, None]
    rollout_lp = batch["rollout_logprobs"].cpu()
    for name, trainer_lp in (("own_routing", own_lp), ("replay", replay_lp)):
        delta = (trainer_lp - rollout_lp)[mask]
        metrics[f"moe/mismatch_kl_{name}"] = float((delta.exp() - 1 - delta).mean()) if delta.numel() else 0.0
        metrics[f"moe/logprob_gap_{name}"] = float(delta.abs().mean()) if delta.numel() else 0.0
    return metrics
