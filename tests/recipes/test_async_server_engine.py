"""Asynchronous GRPO on a plugin's server engine: ``rltk_plugin_example``'s ``rltk_serve`` (built on
:mod:`rltk.rollout.server_pool`) against a real ``rltk serve`` endpoint this module launches (slow).

`rltk run grpo trainer.mode=async rollout.engine=rltk_serve` with the endpoint's address: the producer process
samples on it and has it load every weights version the trainer publishes; every experience is trained
exactly once, each token labelled by the endpoint with the version that sampled it, within the bound.
"""

from __future__ import annotations

import importlib.util
import json
import sqlite3

import pytest

from rltk.commands.cli import main
from rltk.config.loader import load_config
from rltk.training.scaffold.setup import build_tokenizer_and_policy

from tests.waits import scaled

from .test_async_recipe import QUEUE, RL_STEPS, TINY, one_batch_a_step_within_the_bound

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("fastapi") is None or
                                 importlib.util.find_spec("rltk_plugin_example") is None,
                                 reason="needs the serve extra and rltk-plugin-example")]


@pytest.fixture(scope="module")
def endpoint():
    """One ``rltk serve --accept-weights`` endpoint, launched from the run's own tiny policy."""
    from rltk_plugin_example.serve_engine import RltkServeEngine

    tokenizer, policy = build_tokenizer_and_policy(load_config([], []))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")
        engine = RltkServeEngine(policy, tokenizer, launch=1, timeout_s=scaled(300),
                                 start_timeout_s=scaled(600))
    try:
        yield engine
    finally:
        engine.close()


def test_async_grpo_on_a_plugin_server_engine_trains_every_experience_once_and_its_weights_reach_the_server(
        endpoint, tmp_path):
    import httpx

    [url] = endpoint.servers
    run_dir = tmp_path / "run"
    assert main(["run", "grpo", f"output_dir={run_dir}", *TINY, "trainer.mode=async", "trainer.max_staleness=1",
                 "rollout.engine=rltk_serve",
                 f"rollout.engine_args={{servers: ['{url}'], timeout_s: {scaled(300):.0f}}}"]) == 0
    rows = one_batch_a_step_within_the_bound(run_dir)
    assert all(0 <= m["staleness/token_mean"] <= m["staleness/max"] for m in rows)
    with sqlite3.connect(run_dir / QUEUE) as db:
        counters = [json.loads(c) for (c,) in db.execute("SELECT counters FROM producer_counters")]
        stored = db.execute("SELECT e.id, e.min_version, e.max_version, l.step FROM experiences e "
                            "JOIN leases l ON e.lease = l.id WHERE e.status = 'consumed'").fetchall()
    assert len(stored) == 16 * RL_STEPS
    # the producer followed the weights on the endpoint: loads between and during its batches were counted
    assert len(counters) >= RL_STEPS and all("async/weight_loads_mid_batch" in c for c in counters)
    # per token, the version the endpoint labelled it with is within the bound of the step that trained it
    assert all(step - 1 - 1 <= low <= high <= step - 1 for _, low, high, step in stored)
    # the endpoint's versions moved with training: the producer's loads reached it
    assert len({(low, high) for _, low, high, _ in stored}) > 1
    label = httpx.get(url + "/rltk/weights").json()["weight_version"]
    assert RL_STEPS - 2 <= label <= RL_STEPS
