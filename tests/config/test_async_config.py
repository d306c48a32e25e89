"""The asynchronous-training keys: defaults, bad values named with what is valid, and the modes the loop does
not run yet refused (exit 2), never silently run synchronously."""

from __future__ import annotations

import pytest

from rltk.cli import main
from rltk.config import ConfigError, load_config


def test_defaults_are_the_synchronous_loop():
    cfg = load_config([], [])
    t = cfg.trainer
    assert (t.mode, t.max_staleness, t.stale_policy, t.sync_every) == ("sync", 1, "drop", 1)
    assert (cfg.buffer.queue_path, cfg.buffer.queue_timeout_s) == (None, 600.0)
    cfg = load_config([], ["trainer.max_staleness=0", "trainer.stale_policy=wait", "trainer.sync_every=4",
                           "buffer.queue_path=/tmp/q.sqlite", "buffer.queue_timeout_s=30"])
    assert (cfg.trainer.max_staleness, cfg.trainer.stale_policy, cfg.trainer.sync_every) == (0, "wait", 4)


@pytest.mark.parametrize("overrides, match", [
    (["trainer.mode=asynch"], r"bad value 'asynch' for 'trainer\.mode'\. Did you mean: 'async'.* Valid: sync, "
                              r"one_step_off, async"),
    (["trainer.stale_policy=skip"], r"bad value 'skip' for 'trainer\.stale_policy'\..*Valid: drop, wait"),
    (["trainer.max_staleness=-1"], r"bad value -1 for 'trainer\.max_staleness': must be an integer >= 0"),
    (["trainer.sync_every=0"], r"bad value 0 for 'trainer\.sync_every': must be an integer >= 1"),
    (["buffer.queue_timeout_s=0"], r"bad value 0\.0 for 'buffer\.queue_timeout_s': must be a number of seconds > 0"),
])
def test_bad_values_name_the_key_and_what_is_valid(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config([], overrides)


@pytest.mark.parametrize("mode", ["one_step_off", "async"])
def test_modes_the_loop_does_not_run_yet_are_refused(mode):
    with pytest.raises(ConfigError, match=rf"bad value '{mode}' for 'trainer\.mode': the {mode} mode is not yet "
                                          rf"wired into the RL loop.*Valid today: sync"):
        load_config([], [f"trainer.mode={mode}"])


def test_the_decoupled_loss_is_refused_until_the_loop_passes_behaviour_logprobs():
    with pytest.raises(ConfigError, match=r"'algorithm\.policy_loss'.*behaviour_logprobs.*does not pass yet.*"
                                          r"rollout_correction\.tis_cap=null"):
        load_config([], ["algorithm.policy_loss=decoupled_ppo"])
    # the equivalent the message names is a valid synchronous config
    load_config([], ["algorithm.use_rollout_logprobs=false", "algorithm.rollout_correction.tis=token",
                     "algorithm.rollout_correction.tis_cap=null"])


def test_behaviour_logprobs_is_filled_in_by_rltk_not_configured():
    with pytest.raises(ConfigError, match=r"'algorithm\.policy_loss_args\.behaviour_logprobs'.*filled in by rltk"):
        load_config([], ["algorithm.policy_loss_args.behaviour_logprobs=1"])


def test_cli_exits_2_without_traceback(capsys):
    assert main(["validate", "grpo", "trainer.mode=async", "trainer.max_staleness=1"]) == 2
    err = capsys.readouterr().err
    assert "'trainer.mode'" in err and "not yet wired" in err and "Traceback" not in err
