"""Two gloo ranks through AsyncRollouts.take's hand-over (run by test_async_handoff.py under torchrun).

Phase ``share``: rank 0's lease is split, each rank gets its groups. Phase ``error``: rank 0's wait on the
queue ran out; every rank stops with its message. Phase ``stuck``: rank 0 takes longer than the hand-over's
timeout; rank 1 stops naming what it waited for instead of hanging. Each rank writes what it saw to
OUT/rank<r>.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
import types
from datetime import timedelta

import torch.distributed as dist

from rltk.batch import Experience
from rltk.strategies.layout import ParallelLayout
from rltk.training.rollouts.asynchronous.queue import Lease
from rltk.training.rollouts.asynchronous.async_rollout import AsyncRollouts, HandoffTimeout, TrainerWaitTimeout

GROUP_TIMEOUT_S = 3.0


def lease() -> Lease:
    experiences = [Experience(prompt_ids=[1], response_ids=[2], score=float(g), group_id=g)
                   for g in range(3) for _ in range(2)]
    ids = [f"p-b0-{i}" for i in range(6)]
    return Lease(1, 5, 4, experiences, ids, [[4]] * 6, ["k"] * 6, {"staleness/max": 0.0}, [4] * 6)


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rollouts = AsyncRollouts.__new__(AsyncRollouts)
    rollouts.strategy = types.SimpleNamespace(world_size=2, data_world_size=2, layout=ParallelLayout(world_size=2),
                                              rank=rank, is_main=rank == 0)
    rollouts.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    rollouts.handoff_s = GROUP_TIMEOUT_S
    seen = {}

    def take_ok(step):
        return lease()

    def take_error(step):
        raise TrainerWaitTimeout(f"waited 2 s (buffer.queue_timeout_s) for rollout producer(s) at step {step}")

    def take_stuck(step):
        time.sleep(3 * GROUP_TIMEOUT_S)
        return lease()

    for phase, fn in (("share", take_ok), ("error", take_error), ("stuck", take_stuck)):
        rollouts._take = fn
        start = time.monotonic()
        try:
            share = rollouts.take(5)
            seen[phase] = {"ids": share.ids, "groups": sorted({e.group_id for e in share.experiences}),
                           "metrics": share.metrics}
        except (HandoffTimeout, TrainerWaitTimeout) as exc:
            seen[phase] = {"error": type(exc).__name__, "message": str(exc), "after_s": time.monotonic() - start}
        if phase == "stuck":
            break
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    sys.stdout.flush()
    os._exit(0)  # the hand-over group is broken after the stuck phase: no orderly teardown


if __name__ == "__main__":
    main()
