"""``algorithm.rollout_correction``: defaults off, bad settings name the full key, conflicts refused."""

from __future__ import annotations

import pytest

from rltk.config import load_config
from rltk.errors import ConfigError

KEY = "algorithm.rollout_correction"


def test_off_by_default_and_set_from_the_command_line():
    cfg = load_config([], [])
    rc = cfg.algorithm.rollout_correction
    assert (rc.tis, rc.mis, rc.rejection, rc.log_metrics) == (None, None, None, False)
    assert (rc.tis_cap, rc.mis_low, rc.mis_high, rc.rejection_low, rc.rejection_high) == (2.0, 0.5, 2.0, 0.5, 2.0)
    cfg = load_config([], [f"{KEY}.mis=sequence", f"{KEY}.mis_high=3", f"{KEY}.rejection=geometric",
                           f"{KEY}.rejection_low=0.99", f"{KEY}.rejection_high=1.01"])
    assert cfg.algorithm.rollout_correction.mis == "sequence" and cfg.algorithm.rollout_correction.mis_high == 3.0


@pytest.mark.parametrize("overrides, match", [
    ([f"{KEY}.tis=tokens"], rf"bad value 'tokens' for '{KEY}\.tis'\. Valid: null \(off\), token, sequence"),
    ([f"{KEY}.rejection=geo"], rf"'{KEY}\.rejection'\. Valid: null \(off\), geometric, sequence, token"),
    ([f"{KEY}.tis=token", f"{KEY}.mis=token"], rf"'{KEY}\.tis'='token' and '{KEY}\.mis'='token' both set"),
    ([f"{KEY}.tis=token", f"{KEY}.tis_cap=0.8"], rf"bad value 0\.8 for '{KEY}\.tis_cap': must be a number >= 1"),
    ([f"{KEY}.mis_low=1.2"], rf"bad value 1\.2 for '{KEY}\.mis_low': must be in \[0, 1\]"),
    ([f"{KEY}.rejection_high=0.99"], rf"bad value 0\.99 for '{KEY}\.rejection_high': must be a number >= 1"),
])
def test_bad_settings_name_the_full_key_the_value_and_what_is_valid(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config([], overrides)


def test_unknown_setting_is_refused_with_the_key():
    with pytest.raises(ConfigError, match=rf"{KEY}\.tis_cpa"):
        load_config([], [f"{KEY}.tis_cpa=2"])


def test_correcting_against_the_rollout_log_probs_themselves_is_refused():
    with pytest.raises(ConfigError, match=rf"{KEY}\.rejection=token corrects between the trainer's old log-probs "
                                          r"and the engine's, but algorithm.use_rollout_logprobs=true"):
        load_config([], [f"{KEY}.rejection=token", "algorithm.use_rollout_logprobs=true"])
    load_config([], [f"{KEY}.log_metrics=true", "algorithm.use_rollout_logprobs=false"])


def test_a_stage_override_is_checked_too():
    with pytest.raises(ConfigError, match=rf"'{KEY}\.tis'"):
        load_config([], ["stages=[{name: rl, type: rl, overrides: {algorithm.rollout_correction.tis: bad}}]"])
