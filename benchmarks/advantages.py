"""Outcome advantage estimators against verl's vectorized GRPO and against the output floor
(issue #13, item 3), plus every estimator against a per-group / per-step Python loop.

One run, one batch (default B = 8192, T = 512, groups of 8, group ids shuffled):
each round times every contender once, in a fresh random order, and the table
reports medians over rounds and ratios of those medians. The estimators are
called the way the trainer calls them (:func:`rltk.training.step.estimator.compute_advantages`):
with the batch fields their signatures name, which include the ``[B]`` row sums
``sequence_rewards`` and ``policy_lengths`` that :func:`rltk.batch.collate`
takes once per batch. Those sums are built with the batch, outside the timing,
as in the trainer, where they cost one ``[B, T]`` pass each inside collate
(and the row sum is taken again in ``compute_advantages`` when the rewards
change after collate, e.g. a KL penalty folded into them). The rows
``<estimator>, summing`` time the same estimators without them, each summing
its ``[B, T]`` inputs itself, as a caller without the fields would (and as
under KL-in-reward, where the retaken sum costs the same). Contenders:

* ``verl``: verl's ``compute_grpo_vectorized_outcome_advantage`` transcribed
  below (its math, not its code path: a row sum, float32 segment sums with
  ``index_add_``, one ``[B, T]`` multiply returned twice). verl's trainer hands
  its estimators only ``[B, T]`` rewards, so its row sum is part of its time.
* ``floor``: writing an outcome estimator's output, one fresh ``[B, T]`` float32
  tensor ``A_i * mask`` (the broadcast multiply that reads the mask). Since the
  outcome estimators return ``returns`` as a broadcast view, that is all they
  must write, given ``R_i`` (and ``l_i``) as ``[B]`` inputs.
* ``row sum + floor``: the floor plus ``token_rewards.sum(-1)``, the one pass
  over the rewards that ``R_i`` needs when it is not given: the least an
  outcome estimator summing its own rewards can do (``opo`` and
  ``reinforce_plus_plus_baseline`` also sum the mask for the lengths ``l_i``,
  one more ``[B, T]`` read).
* ``stats``: the ``[B]`` group statistics alone (rltk's ``Groups`` vs
  verl's ``group_mean_std`` vs ``torch.unique``).

Ratios are of CPU time of the timing thread (wall time beside them): on a
shared machine wall time also counts other processes' time slices. Threads
default to 1: a 2-thread kernel waits for whichever thread the scheduler
parked, which swings timings 2-8x, and CPU time then covers all the work.

    python benchmarks/advantages.py                           # issue table (~1 min)
    python benchmarks/advantages.py --loops --sizes 1024x512  # plus the loop table
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import resource
import statistics
import time

import torch

from rltk.algorithms import advantages as adv
from rltk.algorithms.groups import Groups


# ---- verl's vectorized GRPO, transcribed as the baseline ----
# Math of verl (volcengine/verl) verl/utils/groupwise.py::group_mean_std and
# verl/trainer/ppo/core_algos.py::compute_grpo_vectorized_outcome_advantage, rewritten here
# (verl is not a dependency). Integer group ids pass through as the group index (verl's
# as_torch_index casts them to long), G = max id + 1; statistics in float32 from
# sum / sum of squares; a group of one gets mean 0 and std 1; the variance is floored at eps.


def verl_group_mean_std(scores: torch.Tensor, index: torch.Tensor, eps: float = 1e-6):
    scores = scores.reshape(-1).to(torch.float32)
    index = index.reshape(-1).to(torch.long)
    G = int(index.max().item()) + 1
    count = torch.zeros(G).index_add_(0, index, torch.ones_like(scores))
    s1 = torch.zeros(G).index_add_(0, index, scores)
    s2 = torch.zeros(G).index_add_(0, index, scores * scores)
    mean = s1 / count.clamp_min(1.0)
    var = (s2 - s1 * s1 / count.clamp_min(1.0)) / (count - 1.0).clamp_min(1.0)
    std = var.clamp(min=eps).sqrt()
    single = count <= 1.0
    if bool(single.any()):
        mean, std = mean.clone(), std.clone()
        mean[single], std[single] = 0.0, 1.0
    return mean, std, count


def verl_vectorized_grpo(token_rewards, response_mask, group_ids, epsilon=1e-6, norm_adv_by_std_in_grpo=True):
    with torch.no_grad():
        scores = token_rewards.sum(dim=-1)
        mean, std, _ = verl_group_mean_std(scores, group_ids, eps=epsilon)
        if norm_adv_by_std_in_grpo:
            scalars = (scores - mean[group_ids]) / (std[group_ids] + epsilon)
        else:
            scalars = scores - mean[group_ids]
        advantages = scalars.unsqueeze(-1) * response_mask
        return advantages, advantages


# ---- loop baselines: what one writes without thinking about vectorisation ----


def loop_group_stats(scores, group_ids):
    out = {}
    for g in group_ids.unique().tolist():
        idx = (group_ids == g).nonzero().squeeze(1)
        out[g] = idx
    return out


def loop_grpo(token_rewards, response_mask, group_ids, norm_by_std=True, eps=1e-6):
    scores = token_rewards.sum(-1)
    advantages = torch.zeros_like(scores)
    for g, idx in loop_group_stats(scores, group_ids).items():
        s = scores[idx]
        if len(s) > 1:
            a = s - s.mean()
            advantages[idx] = a / (s.std() + eps) if norm_by_std else a
    return advantages[:, None] * response_mask, scores[:, None] * response_mask


def loop_rloo(token_rewards, response_mask, group_ids):
    scores = token_rewards.sum(-1)
    advantages = torch.zeros_like(scores)
    for g, idx in loop_group_stats(scores, group_ids).items():
        s = scores[idx]
        n = len(s)
        if n > 1:
            advantages[idx] = s - (s.sum() - s) / (n - 1)
    return advantages[:, None] * response_mask, scores[:, None] * response_mask


def loop_opo(token_rewards, response_mask, group_ids):
    scores = token_rewards.sum(-1)
    lengths = response_mask.sum(-1)
    advantages = torch.zeros_like(scores)
    for g, idx in loop_group_stats(scores, group_ids).items():
        s, l = scores[idx], lengths[idx]
        advantages[idx] = s - (s * l).sum() / l.sum().clamp(min=1)
    return advantages[:, None] * response_mask, scores[:, None] * response_mask


def loop_rpp_baseline(token_rewards, response_mask, group_ids):
    scores = token_rewards.sum(-1)
    centred = torch.zeros_like(scores)
    for g, idx in loop_group_stats(scores, group_ids).items():
        centred[idx] = scores[idx] - scores[idx].mean()
    a = centred[:, None] * response_mask
    on = a[response_mask > 0]
    return (a - on.mean()) / (on.std() + 1e-8) * response_mask, scores[:, None] * response_mask


def loop_remax(token_rewards, response_mask, baseline_scores):
    scores = token_rewards.sum(-1)
    return (scores - baseline_scores)[:, None] * response_mask, scores[:, None] * response_mask


def loop_gae(token_rewards, values, response_mask, gamma=1.0, lam=0.95):
    B, T = token_rewards.shape
    advantages = torch.zeros(B, T, device=values.device)
    last = torch.zeros(B, device=values.device)
    next_value = torch.zeros(B, device=values.device)
    for t in reversed(range(T)):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        last = delta + gamma * lam * last
        advantages[:, t] = last
        next_value = values[:, t]
    return advantages * response_mask, (advantages + values) * response_mask


def loop_rpp(token_rewards, response_mask, gamma=1.0):
    B, T = token_rewards.shape
    returns = torch.zeros(B, T, device=token_rewards.device)
    running = torch.zeros(B, device=token_rewards.device)
    for t in reversed(range(T)):
        running = token_rewards[:, t] + gamma * running
        returns[:, t] = running
    returns = returns * response_mask
    on = returns[response_mask > 0]
    return (returns - on.mean()) / (on.std() + 1e-8) * response_mask, returns


LOOP_CASES = {
    "gae": (adv.gae, loop_gae, {"whiten": False}),
    "grpo": (adv.grpo, loop_grpo, {}),
    "rloo": (adv.rloo, loop_rloo, {}),
    "reinforce_plus_plus": (adv.reinforce_plus_plus, loop_rpp, {}),
    "reinforce_plus_plus_baseline": (adv.reinforce_plus_plus_baseline, loop_rpp_baseline, {}),
    "remax": (adv.remax, loop_remax, {}),
    "opo": (adv.opo, loop_opo, {}),
}

# The five estimators of the target, then the newer outcome estimators.
OUTCOME = ["grpo", "rloo", "opo", "reinforce_plus_plus_baseline", "remax", "grpo_passk", "gpg", "gdpo"]
# The [B] row sums collate adds to a batch: without them an estimator sums its [B, T] inputs itself.
PRECOMPUTED = ("sequence_rewards", "policy_lengths")


def make_batch(B, T, group_size=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T) < lengths[:, None]).float()
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), lengths - 1] = torch.randint(0, 2, (B,), generator=g).float()
    return {
        "token_rewards": rewards,
        "response_mask": mask,
        # what rltk.batch.collate adds beside them, once per batch
        "sequence_rewards": rewards.sum(-1),
        "policy_lengths": mask.sum(-1).to(torch.long),
        "values": torch.randn(B, T, generator=g) * mask,
        "group_ids": torch.randperm(B, generator=g) // group_size,
        "baseline_scores": torch.rand(B, generator=g),
        "reward_components": torch.randint(0, 2, (B, 2), generator=g).float(),
    }


def synchronize():
    """Wait for queued GPU work, so a timing covers the kernels and not just their launch."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bind(fn, batch, kwargs=None):
    """``fn`` called with the batch fields its signature names."""
    params = inspect.signature(fn).parameters
    fields = {k: v for k, v in batch.items() if k in params}
    return lambda: fn(**fields, **(kwargs or {}))


def minor_faults() -> int:
    """Page faults served without I/O so far: on CPU, mostly first touches of fresh memory."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def interleaved_medians(contenders: dict, rounds: int, faults: dict | None = None, cpu: dict | None = None) -> dict:
    """Median wall seconds of each contender over ``rounds``; every round runs each once, in a new order.

    ``faults``, if given, receives each contender's mean page faults per call;
    ``cpu`` its median CPU seconds of this thread (with one torch thread, all
    of the work): unlike wall time, it does not count the time the scheduler
    gave the core to another process, which on a shared machine is most of
    the noise.
    """
    times = {name: [] for name in contenders}
    cpu_times = {name: [] for name in contenders}
    faulted = dict.fromkeys(contenders, 0)
    order = list(contenders)
    rng = random.Random(0)
    for fn in contenders.values():  # warm-up: first-call allocations and lazy init
        fn()
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            synchronize()
            before = minor_faults()
            start, start_cpu = time.perf_counter(), time.thread_time()
            contenders[name]()
            synchronize()
            times[name].append(time.perf_counter() - start)
            cpu_times[name].append(time.thread_time() - start_cpu)
            faulted[name] += minor_faults() - before
    if faults is not None:
        faults.update({name: n / rounds for name, n in faulted.items()})
    if cpu is not None:
        cpu.update({name: statistics.median(ts) for name, ts in cpu_times.items()})
    return {name: statistics.median(ts) for name, ts in times.items()}


def outcome_table(batch, rounds):
    mask, ids = batch["response_mask"], batch["group_ids"]
    scores = batch["token_rewards"].sum(-1)
    per_row = batch["baseline_scores"]
    contenders = {name: bind(getattr(adv, name), batch) for name in OUTCOME}
    unsummed = {k: v for k, v in batch.items() if k not in PRECOMPUTED}
    summing = [f"{name}, summing" for name in OUTCOME[:5]]
    contenders.update({f"{name}, summing": bind(getattr(adv, name), unsummed) for name in OUTCOME[:5]})
    contenders["verl"] = bind(verl_vectorized_grpo, batch)
    contenders["floor"] = lambda: torch.mul(mask, per_row[:, None])
    rewards = batch["token_rewards"]
    contenders["row sum + floor"] = lambda: (rewards.sum(-1), torch.mul(mask, per_row[:, None]))
    contenders["stats rltk"] = lambda: _rltk_grpo_stats(scores.double(), ids)
    contenders["stats verl"] = lambda: verl_group_mean_std(scores, ids)
    contenders["torch.unique"] = lambda: torch.unique(ids, return_inverse=True, return_counts=True)
    faults, c = {}, {}
    t = interleaved_medians(contenders, rounds, faults, c)
    names = OUTCOME + summing + ["verl", "row sum + floor", "floor"]
    rows = [{"estimator": "verl_vectorized_grpo" if name == "verl" else name,
             "cpu_s": c[name], "over_verl": c[name] / c["verl"], "over_floor": c[name] / c["floor"],
             "wall_s": t[name], "wall_over_verl": t[name] / t["verl"], "wall_over_floor": t[name] / t["floor"],
             "faults": faults[name]} for name in names]
    stats = {k: c[k] for k in ("stats rltk", "stats verl", "torch.unique")}
    return rows, stats


def _rltk_grpo_stats(returns, group_ids):
    """What grpo computes on [B] between its row sum and its output."""
    groups = Groups.of(group_ids)
    centred = groups.centred(returns)
    return centred / (groups.expand(groups.std(centred)) + 1e-6)


def loop_table(batch, rounds):
    mask, per_row = batch["response_mask"], batch["baseline_scores"]

    def two_outputs():  # the loops write advantages and returns, both dense
        return torch.mul(mask, per_row[:, None]), torch.mul(mask, per_row[:, None])

    rows = []
    for name, (ours, loop, kwargs) in LOOP_CASES.items():
        t = interleaved_medians({"rltk": bind(ours, batch, kwargs), "loop": bind(loop, batch), "floor": two_outputs},
                                rounds)
        rows.append({"estimator": name, "rltk_s": t["rltk"], "loop_s": t["loop"], "speedup": t["loop"] / t["rltk"],
                     "floor2_s": t["floor"], "best_possible_speedup": t["loop"] / t["floor"]})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8192x512", help="BxT,... (the issue's target is 8192x512)")
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--loops", action="store_true", help="also time every estimator against a Python loop")
    parser.add_argument("--out", default="benchmarks/results/advantages.json")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = {"torch": torch.__version__, "threads": torch.get_num_threads(), "device": args.device,
               "rounds": args.rounds, "group_size": 8, "outcome": [], "stats": [], "loops": []}
    for size in args.sizes.split(","):
        B, T = (int(x) for x in size.split("x"))
        batch = {k: v.to(args.device) for k, v in make_batch(B, T).items()}
        rows, stats = outcome_table(batch, args.rounds)
        print("estimators get sequence_rewards / policy_lengths as the trainer passes them "
              "(rltk.batch.collate sums once per batch); ', summing': without them")
        print(f"B={B} T={T}, groups of 8, {args.threads} thread(s), median of {args.rounds} interleaved rounds")
        print(f"{'':38s} {'------ CPU time ------':>26s}  {'------ wall time -----':>26s}")
        print(f"{'estimator':38s} {'ms':>8s} {'/ verl':>8s} {'/ floor':>8s}  {'ms':>8s} {'/ verl':>8s} {'/ floor':>8s}"
              f" {'faults/call':>12s}")
        for row in rows:
            print(f"{row['estimator']:38s} {row['cpu_s'] * 1e3:8.3f} {row['over_verl']:8.2f} {row['over_floor']:8.2f}"
                  f"  {row['wall_s'] * 1e3:8.3f} {row['wall_over_verl']:8.2f} {row['wall_over_floor']:8.2f}"
                  f" {row['faults']:12.0f}")
            results["outcome"].append({"B": B, "T": T, **row})
        print("group statistics on [B] alone (CPU ms): " + ", ".join(f"{k} {v * 1e3:.3f}" for k, v in stats.items()))
        results["stats"].append({"B": B, **{k.replace(" ", "_").replace(".", "_") + "_s": v for k, v in stats.items()}})
        if args.loops:
            print(f"{'estimator':30s} {'rltk s':>9s} {'loop s':>9s} {'speed-up':>9s} {'best possible':>13s}")
            for row in loop_table(batch, max(3, args.rounds // 10)):
                print(f"{row['estimator']:30s} {row['rltk_s']:9.4f} {row['loop_s']:9.4f} {row['speedup']:8.1f}x"
                      f" {row['best_possible_speedup']:12.1f}x")
                results["loops"].append({"B": B, "T": T, **row})
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
