"""``launcher`` and ``launcher_args``: defaults, and every bad value refused (exit 2) naming the key and what is
valid, before Ray is touched (whether a cluster is reachable and can meet a request:
tests/training/test_ray_source.py)."""

from __future__ import annotations

import pytest

from rltk.commands.cli import main
from rltk.config import load_config
from rltk.config.launcher_checks import ActorRequest, RayLauncherSettings, RewardServiceRequest, ray_launcher_settings
from rltk.errors import ConfigError

from tests.waits import scaled

RAY = ["trainer.mode=async", "launcher=ray"]


def test_the_default_is_local_and_ray_settings_default_to_one_cpu_a_producer_and_one_restart():
    cfg = load_config([], [])
    assert (cfg.launcher, dict(cfg.launcher_args)) == ("local", {})
    assert ray_launcher_settings(load_config([], RAY)) == RayLauncherSettings(
        address=None, namespace="rltk", connect_timeout_s=30.0, placement_timeout_s=120.0, max_restarts=1,
        work_dir=None, producer=ActorRequest(cpus=1.0, gpus=0.0, resources={}, labels={}))
    cfg = load_config([], [*RAY, "launcher_args.address=auto", "launcher_args.max_restarts=3",
                           "launcher_args.producer.cpus=2", "launcher_args.producer.resources={rollout: 1}",
                           "launcher_args.producer.labels={pool: inference}"])
    settings = ray_launcher_settings(cfg)
    assert (settings.address, settings.max_restarts) == ("auto", 3)
    assert settings.producer == ActorRequest(cpus=2.0, gpus=0.0, resources={"rollout": 1.0},
                                             labels={"pool": "inference"})


@pytest.mark.parametrize("overrides, match", [
    (["launcher=rey"], r"bad value 'rey' for 'launcher'\. Did you mean: 'ray'.* Valid: local, ray"),
    (["launcher_args.address=auto"], r"'launcher_args' is set \(\['address'\]\) but launcher=local"),
    (["launcher=ray"], r"bad value 'ray' for 'launcher': .*every stage runs trainer\.mode=sync with no reward "
                       r"service"),
    ([*RAY, "trainer.producers=0"], r"bad value 0 for 'trainer\.producers' with launcher=ray"),
    ([*RAY, "launcher_args.adress=h:1"], r"unknown key 'launcher_args\.adress'\. Did you mean: 'address'"),
    ([*RAY, "launcher_args.address=ray://head:10001"],
     r"bad value 'ray://head:10001' for 'launcher_args\.address': Ray Client \(ray://\) is not supported"),
    ([*RAY, "launcher_args.address=7"], r"bad value 7 for 'launcher_args\.address'"),
    ([*RAY, "launcher_args.max_restarts=-1"], r"bad value -1 for 'launcher_args\.max_restarts': must be an integer"),
    ([*RAY, "launcher_args.connect_timeout_s=0"], r"bad value 0 for 'launcher_args\.connect_timeout_s': must be a "
                                                  r"number > 0"),
    ([*RAY, "launcher_args.placement_timeout_s=inf"], r"'launcher_args\.placement_timeout_s'"),
    ([*RAY, "launcher_args.producer.cpu=1"], r"unknown key 'launcher_args\.producer\.cpu'\. Did you mean: 'cpus'"),
    ([*RAY, "launcher_args.producer.gpus=-1"], r"bad value -1 for 'launcher_args\.producer\.gpus': must be a number"),
    ([*RAY, "launcher_args.producer.resources={GPU: 1}"],
     r"bad key 'launcher_args\.producer\.resources\.GPU': ask for gpus with launcher_args\.producer\.gpus"),
    ([*RAY, "launcher_args.producer.resources={rollout: 0}"],
     r"bad value 0 for 'launcher_args\.producer\.resources\.rollout': must be a number > 0"),
    ([*RAY, "launcher_args.producer.labels={pool: 3}"], r"bad value 3 for 'launcher_args\.producer\.labels\.pool'"),
    ([*RAY, "launcher_args.rewards={exact_mach: {}}"],
     r"unknown key 'launcher_args\.rewards\.exact_mach': 'exact_mach' is not one of the run's rewards "
     r"\(reward\.reward_fn: exact_match\)\. Did you mean: 'exact_match'"),
    ([*RAY, "launcher_args.rewards={exact_match: {replica: 2}}"],
     r"unknown key 'launcher_args\.rewards\.exact_match\.replica'\. Did you mean: 'replicas'.* Valid: cpus, gpus, "
     r"resources, labels, replicas, timeout_s"),
    ([*RAY, "launcher_args.rewards={exact_match: {replicas: 0}}"],
     r"bad value 0 for 'launcher_args\.rewards\.exact_match\.replicas': must be an integer >= 1"),
    ([*RAY, "launcher_args.rewards={exact_match: {timeout_s: 0}}"],
     r"bad value 0 for 'launcher_args\.rewards\.exact_match\.timeout_s': must be a number > 0"),
    ([*RAY, "launcher_args.rewards={exact_match: {resources: {GPU: 1}}}"],
     r"bad key 'launcher_args\.rewards\.exact_match\.resources\.GPU': ask for gpus with "
     r"launcher_args\.rewards\.exact_match\.gpus"),
    ([*RAY, "launcher_args.rewards=[exact_match]"], r"bad value \['exact_match'\] for 'launcher_args\.rewards'"),
])
def test_bad_values_name_the_key_and_what_is_valid(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config([], overrides)


def test_reward_services_are_read_with_their_requests_and_are_enough_for_a_synchronous_run():
    cfg = load_config([], ["launcher=ray", "reward.reward_fn=[exact_match,format_tags]",
                           "launcher_args.rewards={format_tags: {cpus: 0.5, replicas: 2, timeout_s: 60, "
                           "resources: {sandbox: 1}, labels: {pool: cpu}}}"])
    assert ray_launcher_settings(cfg).rewards == {"format_tags": RewardServiceRequest(
        request=ActorRequest(cpus=0.5, gpus=0.0, resources={"sandbox": 1.0}, labels={"pool": "cpu"}), replicas=2,
        timeout_s=60.0)}
    assert ray_launcher_settings(load_config([], RAY)).rewards == {}


def test_a_stage_that_runs_async_is_enough_for_launcher_ray():
    stages = "stages=[{name: warmup, type: sft}, {name: rl, type: rl, overrides: {trainer.mode: one_step_off}}]"
    assert load_config([], ["launcher=ray", stages]).launcher == "ray"


def test_rltk_run_exits_2_naming_the_key_before_anything_starts(capsys):
    assert main(["run", "grpo", *RAY, "launcher_args.producer.cpus=many"]) == 2
    assert "launcher_args.producer.cpus" in capsys.readouterr().err


def test_rltk_and_the_local_launcher_never_import_ray():
    import sys

    from tests.isolated import run_isolated

    imports = "import sys, rltk, rltk.config, rltk.training.rollouts.rollout_source, rltk.training.stages.run\n"
    run_isolated([sys.executable, "-c", imports + "rltk.config.load_config([], ['trainer.mode=async'])\n"
                  "assert 'ray' not in sys.modules, 'ray was imported'\n"], timeout=scaled(300))
