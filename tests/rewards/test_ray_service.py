"""Reward services on Ray (``launcher_args.rewards``), against a real Ray of the test's own: a reward function
run by actors scores as it would in place, its failures and timeouts are counted by the composer that asked, and
a service Ray gave up stops training. Across nodes, with the audit of opened paths:
tests/training/test_ray_source.py."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from rltk.config import load_config  # noqa: E402
from rltk.config.launcher_checks import ray_launcher_settings  # noqa: E402
from rltk.errors import ConfigError  # noqa: E402
from rltk.models.tiny import build_char_tokenizer, build_tiny_reward_model, save_pretrained_dir  # noqa: E402
from rltk.rewards.ray_service import RemoteReward, RewardServiceGone, service_name  # noqa: E402
from rltk.training.rollouts import ray_cluster  # noqa: E402
from rltk.training.scaffold.setup import build_reward  # noqa: E402
from tests.rewards.slow_http import SlowServer  # noqa: E402
from tests.waits import scaled  # noqa: E402
from tests.rewards.test_code_execution import LIMITS, needs_sandbox  # noqa: E402

pytestmark = pytest.mark.slow  # a Ray of its own, actors that import torch

SIZES = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
SAMPLES = [{"prompt": p, "response": r, "ground_truth": g} for p, r, g in [
    ("<|user|>1+2=<|eos|><|assistant|>", "3", "3"), ("<|user|>12+30=<|eos|><|assistant|>", "42 is it", "42"),
    ("<|user|>7+8=<|eos|><|assistant|>", "15", "15"), ("<|user|>99+1=<|eos|><|assistant|>", "one hundred", "100"),
    ("<|user|>5+5=<|eos|><|assistant|>", "", "10")]]


@pytest.fixture(scope="module")
def a_ray():
    ray.shutdown()  # whatever an earlier test of this process left connected
    # rltk's own start of a local Ray: on the loopback, as a run's is
    ray_cluster.init_ray("local", num_cpus=3, include_dashboard=False, namespace="rltk-test", log_to_driver=False)
    yield
    ray_cluster.release_reward_services(report=False)
    ray.shutdown()


@pytest.fixture(scope="module")
def rm_folder(tmp_path_factory):
    tokenizer = build_char_tokenizer()
    model = build_tiny_reward_model(tokenizer, seed=3, **SIZES)
    return save_pretrained_dir(model, tokenizer, tmp_path_factory.mktemp("rm") / "model")


def placed(overrides: list[str], name: str = "svc"):
    """The config of a run named ``name`` with ``overrides``, its reward services placed; its composer."""
    cfg = load_config([], ["launcher=ray", f"name={name}", f"launcher_args.placement_timeout_s={round(scaled(60))}",
                           *overrides])
    ray_cluster.place_reward_services(cfg, ray_launcher_settings(cfg))
    return cfg, build_reward(cfg)


def test_a_service_scores_as_the_function_in_place_its_samples_split_in_order_among_replicas(a_ray, rm_folder):
    rewards = ["reward.reward_fn=[exact_match,reward_model]", "reward.weights.reward_model=0.5",
               f"reward.reward_fn_args.reward_model.path={rm_folder}"]
    cfg, remote = placed([*rewards, "launcher_args.rewards={reward_model: {replicas: 2}, exact_match: {cpus: 0.5}}"])
    assert [type(spec.fn) for spec in remote.specs] == [RemoteReward, RemoteReward]
    in_place = build_reward(load_config([], rewards))
    got, expected = remote.score_batch(SAMPLES), in_place.score_batch(SAMPLES)
    assert [d["exact_match"] for _, d in got] == [1.0, 0.0, 1.0, 0.0, 0.0]  # by hand
    for (total, details), (total_here, details_here) in zip(got, expected):
        assert set(details) == set(details_here) == {"exact_match", "reward_model", "reward_model/raw"}
        assert total == pytest.approx(total_here, abs=1e-6)
        assert details["reward_model/raw"] == pytest.approx(details_here["reward_model/raw"], abs=1e-6)
    # the 5 samples went 3 and 2 to the two replicas, each on a node folder of its own
    scored = [ray.get(ray.get_actor(service_name("svc", "reward_model", k), namespace="rltk").samples_scored.remote())
              for k in range(2)]
    assert scored == [3, 2]
    assert remote.stats()["failures/reward_model"] == 0 and remote.stats()["calls"] == 5


def test_failures_and_timeouts_at_the_service_are_counted_by_the_composer_that_asked(a_ray):
    down = ["reward.reward_fn=[reward_model]", "reward.fallback=-1",
            "reward.reward_fn_args.reward_model={url: 'http://127.0.0.1:9/score', retries: 0}"]
    _, remote = placed([*down, "launcher_args.rewards={reward_model: {cpus: 0.5}}"])
    with pytest.warns(RuntimeWarning, match=r"reward 'reward_model' failed on a sample \(ConnectionError: cannot reach "
                                            r"http://127\.0\.0\.1:9/score"):
        assert [total for total, _ in remote.score_batch(SAMPLES)] == [-1.0] * 5
    assert (remote.stats()["failures/reward_model"], remote.stats()["timeouts/reward_model"]) == (5, 0)
    with SlowServer({"scores": [0.0]}, byte_every_s=None) as never:  # accepts, never answers
        hung = ["reward.reward_fn=[reward_model]", "reward.fallback=-1",
                f"reward.reward_fn_args.reward_model={{url: '{never.url}', timeout_s: 60, retries: 0}}"]
        _, remote = placed([*hung, "launcher_args.rewards={reward_model: {cpus: 0.5, timeout_s: 2}}"])
        with pytest.warns(RuntimeWarning, match=r"reward 'reward_model' failed on a sample \(RewardTimeout: reward "
                                                r"service 'reward_model' .* did not score 5 samples within 2 s "
                                                r"\(launcher_args\.rewards\.reward_model\.timeout_s\)"):
            assert [total for total, _ in remote.score_batch(SAMPLES)] == [-1.0] * 5
        assert (remote.stats()["failures/reward_model"], remote.stats()["timeouts/reward_model"]) == (5, 5)


def test_a_service_whose_process_died_is_started_again_and_the_call_made_again(a_ray):
    import os
    import signal

    _, remote = placed(["launcher_args.rewards={exact_match: {cpus: 0.5}}", "launcher_args.max_restarts=1"],
                       name="restarts")
    assert [score for score, _ in remote.score_batch(SAMPLES)] == [1.0, 0.0, 1.0, 0.0, 0.0]
    service = ray.get_actor(service_name("restarts", "exact_match", 0), namespace="rltk")
    first = ray.get(service.where.remote())["pid"]
    os.kill(first, signal.SIGKILL)  # as the out-of-memory killer would
    assert [score for score, _ in remote.score_batch(SAMPLES)] == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert ray.get(service.where.remote())["pid"] != first
    assert remote.stats()["failures/exact_match"] == 0


def test_a_service_ray_gave_up_stops_training_naming_it(a_ray):
    _, remote = placed(["launcher_args.rewards={exact_match: {cpus: 0.5}}"])
    assert remote.score_batch(SAMPLES[:1])[0][0] == 1.0
    ray.kill(ray.get_actor(service_name("svc", "exact_match", 0), namespace="rltk"), no_restart=True)
    with pytest.raises(RewardServiceGone, match=r"reward service 'exact_match' .* is gone and Ray did not start it "
                                                r"again \(launcher_args\.max_restarts\)"):
        remote.score_batch(SAMPLES)


def test_requests_no_node_meets_and_names_another_run_holds_are_refused_naming_the_key(a_ray, monkeypatch):
    unmet = load_config([], ["launcher=ray", "launcher_args.rewards={exact_match: {resources: {sandbox: 1}}}"])
    with pytest.raises(ConfigError, match=r"'launcher_args\.rewards\.exact_match\.resources\.sandbox': no node of "
                                          r"the Ray cluster has 1 of resource 'sandbox'"):
        ray_cluster.open_cluster(unmet)  # connected already: the requests are checked against the nodes
    with pytest.raises(ConfigError, match=r"bad value for 'launcher_args\.rewards\.exact_match': the Ray cluster "
                                          r"placed 0 of 1 reward service actors within 3 s"):
        placed(["launcher_args.rewards={exact_match: {resources: {sandbox: 1}}}",
                "launcher_args.placement_timeout_s=3"])
    assert not ray_cluster._SERVICES  # what was placed is ended
    placed(["launcher_args.rewards={exact_match: {cpus: 0.5}}"], name="other")
    monkeypatch.setattr(ray_cluster, "NAME_RELEASE_S", 1.0)
    held = dict(ray_cluster._SERVICES)
    ray_cluster._SERVICES.clear()  # as if another trainer's process held them
    try:
        with pytest.raises(ConfigError, match=r"bad value 'other' for 'name': another run of that name holds the "
                                              r"reward service actor 'rltk-reward/other/exact_match/0' in the Ray "
                                              r"namespace 'rltk'"):
            placed(["launcher_args.rewards={exact_match: {cpus: 0.5}}"], name="other")
    finally:
        ray_cluster._SERVICES.update(held)


@needs_sandbox
def test_code_sandboxes_run_on_the_service_and_score_as_in_place(a_ray):
    tests = '["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(0, 5) == 5"]'
    samples = [{"prompt": "write add", "response": f"```python\n{program}\n```", "ground_truth": tests}
               for program in ("def add(a, b):\n    return 0 if a == 0 else a + b", "def add(a, b):\n    return a + b",
                               "import os\nwhile True:\n    os.fork()")]
    limits = ", ".join(f"{k}: {v}" for k, v in LIMITS.items())
    sandboxed = ["reward.reward_fn=[code_execution]", "reward.timeout_s=30", "reward.workers=2",
                 f"reward.reward_fn_args.code_execution={{{limits}}}"]
    _, remote = placed([*sandboxed, "launcher_args.rewards={code_execution: {cpus: 1}}"], name="sandboxes")
    results = remote.score_batch(samples)
    assert [score for score, _ in results] == pytest.approx([2 / 3, 1.0, 0.0])
    assert results[2][1]["code_execution/killed/processes"] == 3.0  # the bomb, stopped in the service's sandbox
    service = ray.get_actor(service_name("sandboxes", "code_execution", 0), namespace="rltk")
    assert ray.get(service.samples_scored.remote()) == 3
    assert remote.stats()["failures/code_execution"] == 0
