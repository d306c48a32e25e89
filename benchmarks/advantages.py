"""Time every advantage estimator against a straightforward per-group / per-step
Python-loop implementation. Prints a table of ratios and writes JSON.

The ``floor`` column is the time to materialise the two ``[B, T]`` float32
outputs the contract asks for (one broadcast multiply by the mask each, into
fresh memory): no implementation of an estimator can beat it, and ``rltk /
floor`` says how much of rltk's time is left to win. On CPU most of the floor
is the kernel faulting in the fresh pages of each new tensor. The loop
baseline pays the same floor, so ``loop / floor`` is the largest speed-up any
implementation could show here (``best possible``).

    python benchmarks/advantages.py [--sizes 1024x512,8192x2048] [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from rltk.algorithms import advantages as adv


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


CASES = {
    "gae": (adv.gae, loop_gae, {"whiten": False}),
    "grpo": (adv.grpo, loop_grpo, {}),
    "rloo": (adv.rloo, loop_rloo, {}),
    "reinforce_plus_plus": (adv.reinforce_plus_plus, loop_rpp, {}),
    "reinforce_plus_plus_baseline": (adv.reinforce_plus_plus_baseline, loop_rpp_baseline, {}),
    "remax": (adv.remax, loop_remax, {}),
    "opo": (adv.opo, loop_opo, {}),
}


def make_batch(B, T, group_size=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T) < lengths[:, None]).float()
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), lengths - 1] = torch.randint(0, 2, (B,), generator=g).float()
    return {
        "token_rewards": rewards,
        "response_mask": mask,
        "values": torch.randn(B, T, generator=g) * mask,
        "group_ids": torch.randperm(B, generator=g) // group_size,
        "baseline_scores": torch.rand(B, generator=g),
    }


def synchronize():
    """Wait for queued GPU work, so a timing covers the kernels and not just their launch."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def best_time(fn, batch, kwargs, repeats):
    import inspect

    params = inspect.signature(fn).parameters
    fields = {k: v for k, v in batch.items() if k in params}
    best = float("inf")
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        fn(**fields, **kwargs)
        synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def output_floor(batch):
    """Two fresh [B, T] outputs, each a broadcast multiply of the mask: the
    least any estimator under the ``(advantages, returns)`` contract must do."""
    mask = batch["response_mask"]
    per_row = batch["baseline_scores"][:, None]
    return torch.mul(mask, per_row), torch.mul(mask, per_row)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1024x512,1024x2048,8192x512,8192x2048")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/advantages.json")
    parser.add_argument("--device", default="cpu", help="e.g. cuda: where the per-group loop pays a kernel "
                        "launch per operation and the outputs are cheap to write")
    args = parser.parse_args()
    rows = []
    print(f"{'estimator':30s} {'B':>5s} {'T':>5s} {'rltk s':>9s} {'loop s':>9s} {'speed-up':>9s}"
          f" {'floor s':>9s} {'rltk/floor':>10s} {'best possible':>13s}")
    for size in args.sizes.split(","):
        B, T = (int(x) for x in size.split("x"))
        batch = {k: v.to(args.device) for k, v in make_batch(B, T).items()}
        for name, (ours, loop, kwargs) in CASES.items():
            t_floor = best_time(lambda **_: output_floor(batch), {}, {}, args.repeats)
            t_ours = best_time(ours, batch, kwargs, args.repeats)
            t_loop = best_time(loop, batch, {}, args.repeats)
            rows.append({"estimator": name, "B": B, "T": T, "rltk_s": t_ours, "loop_s": t_loop,
                         "speedup": t_loop / t_ours, "floor_s": t_floor, "rltk_over_floor": t_ours / t_floor,
                         "best_possible_speedup": t_loop / t_floor})
            print(f"{name:30s} {B:5d} {T:5d} {t_ours:9.4f} {t_loop:9.4f} {t_loop / t_ours:8.1f}x"
                  f" {t_floor:9.4f} {t_ours / t_floor:9.1f}x {t_loop / t_floor:12.1f}x")
    import os

    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(), "device": args.device,
                   "results": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
