"""The guard section: its defaults validate, each bad value is refused naming the key, and it is resume-safe."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from rltk.config import load_config
from rltk.errors import ConfigError
from rltk.training.scaffold.guard import GuardSettings
from rltk.training.scaffold.resume import config_differences


def test_defaults_are_the_schema_documented_ones():
    cfg = load_config([], [])
    assert GuardSettings.from_config(cfg) == GuardSettings(
        enabled=True, max_skipped_steps=10, entropy_min=1.0e-4, entropy_max=0.999, entropy_patience=5,
        check_weights_every=10)
    off = load_config([], ["guard.max_skipped_steps=0", "guard.entropy_min=0", "guard.entropy_max=1",
                           "guard.check_weights_every=0", "guard.enabled=false"])
    assert GuardSettings.from_config(off).entropy_max == 1.0


@pytest.mark.parametrize("override, message", [
    ("guard.max_skipped_steps=-1", "bad value -1 for 'guard.max_skipped_steps': must be an integer >= 0"),
    ("guard.entropy_patience=0", "bad value 0 for 'guard.entropy_patience': must be an integer >= 1"),
    ("guard.check_weights_every=-5", "bad value -5 for 'guard.check_weights_every'"),
    ("guard.entropy_min=-0.1", "bad value -0.1 for 'guard.entropy_min': must be in [0, 1], a fraction of log("),
    ("guard.entropy_max=1.5", "bad value 1.5 for 'guard.entropy_max': must be in [0, 1]"),
    ("guard.entropy_max=nan", "bad value nan for 'guard.entropy_max'"),
    ("guard.entropy_min=0.9 guard.entropy_max=0.5", "guard.entropy_min=0.9 >= guard.entropy_max=0.5: the floor"),
])
def test_bad_values_name_the_key_the_value_and_what_is_valid(override, message):
    with pytest.raises(ConfigError) as info:
        load_config([], override.split())
    assert message in str(info.value)


def test_a_stage_override_of_the_guard_is_checked_too():
    with pytest.raises(ConfigError, match=r"guard.entropy_patience"):
        load_config([], ["stages=[{name: warmup, type: sft, overrides: {guard.entropy_patience: 0}}, {name: rl}]"])


def test_guard_keys_may_change_when_a_run_resumes():
    saved = OmegaConf.to_container(load_config([], []), resolve=True)
    loosened = OmegaConf.to_container(load_config([], ["guard.entropy_patience=50", "guard.enabled=false"]),
                                      resolve=True)
    assert config_differences(saved, loosened) == []
