"""Rank 0 hands every trainer rank its share of an asynchronous step's lease (two gloo processes): whole
groups, every id once; an error on rank 0 stops every rank with its message; a rank 0 that never hands
over ends the other rank's wait after the hand-over's timeout, naming what it waited for."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.isolated import run_isolated
from tests.waits import scaled

WORKER = Path(__file__).with_name("handoff_worker.py")


@pytest.mark.distributed
def test_rank_0_hands_out_shares_errors_and_a_stuck_rank_0_is_named(tmp_path):
    run_isolated([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                  str(WORKER), str(tmp_path)], timeout=scaled(300), extra_env={"RLTK_DISABLE_PLUGIN_AUTOLOAD": "1"})
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    # three groups of two: groups 0 and 2 to rank 0, group 1 to rank 1; the lease's metrics on both
    assert ranks[0]["share"]["groups"] == [0, 2] and ranks[1]["share"]["groups"] == [1]
    assert sorted(ranks[0]["share"]["ids"] + ranks[1]["share"]["ids"]) == [f"p-b0-{i}" for i in range(6)]
    assert ranks[0]["share"]["metrics"] == ranks[1]["share"]["metrics"] == {"staleness/max": 0.0}
    for rank in ranks:  # rank 0's timeout reaches every rank, with rank 0's message
        assert rank["error"]["error"] == "TrainerWaitTimeout"
        assert rank["error"]["message"] == "waited 2 s (buffer.queue_timeout_s) for rollout producer(s) at step 5"
    stuck = ranks[1]["stuck"]
    assert stuck["error"] == "HandoffTimeout"
    assert "trainer rank 1 waited up to 3 s (buffer.queue_timeout_s + 120)" in stuck["message"]
    assert "for rank 0 to hand it its share of training step 5's experiences from the queue" in stuck["message"]
    assert stuck["after_s"] < 9  # the group's 3 s timeout, not rank 0's 9 s sleep
