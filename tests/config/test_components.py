"""Component arguments are checked against their signature's annotations and defaults before anything runs."""

from __future__ import annotations

import inspect
from typing import Literal

import pytest

from rltk.config.components import check_component_args, expected_types
from rltk.config.loader import load_config
from rltk.errors import ConfigError


@pytest.mark.parametrize("override, message", [
    ("algorithm.advantage_fn_args.eps=abc",
     "'algorithm.advantage_fn_args.eps': bad value 'abc' for argument 'eps' of advantage_fn 'grpo': "
     "must be a number; default 1e-06"),
    ("algorithm.advantage_fn_args.eps=null",
     "'algorithm.advantage_fn_args.eps': bad value null for argument 'eps' of advantage_fn 'grpo': "
     "must be a number; default 1e-06"),
    ("algorithm.advantage_fn_args.norm_by_std=1",
     "'algorithm.advantage_fn_args.norm_by_std': bad value 1 for argument 'norm_by_std' of advantage_fn 'grpo': "
     "must be true or false; default true"),
    ("algorithm.advantage_fn_args.norm_by_std=maybe",
     "bad value 'maybe' for argument 'norm_by_std' of advantage_fn 'grpo': must be true or false"),
])
def test_a_value_of_the_wrong_type_is_refused_naming_the_key_and_what_is_valid(override, message):
    with pytest.raises(ConfigError) as info:
        load_config([], [override])
    assert message in str(info.value)


@pytest.mark.parametrize("override", ["algorithm.advantage_fn_args.eps=1", "algorithm.advantage_fn_args.eps=1e-8",
                                      "algorithm.advantage_fn_args.norm_by_std=false"])
def test_values_of_the_right_type_pass(override):
    key, _, text = override.partition("=")
    cfg = load_config([], [override])
    assert str(cfg.algorithm.advantage_fn_args[key.rsplit(".", 1)[1]]).lower() == text.replace("1e-8", "1e-08")


def _component(rate: float = 0.5, steps: int = 3, flag: bool | None = None, unit: Literal["chars", "tokens"] = "chars",
               gamma=1, free=None, names: list[str] | None = None):
    """A component with one argument of each checked kind."""


@pytest.mark.parametrize("args, message", [
    ({"rate": "0.1"}, "bad value '0.1' for argument 'rate' of reward_fn 'toy': must be a number; default 0.5"),
    ({"rate": True}, "bad value true for argument 'rate' of reward_fn 'toy': must be a number; default 0.5"),
    ({"steps": 2.5}, "bad value 2.5 for argument 'steps' of reward_fn 'toy': must be a whole number; default 3"),
    ({"flag": "true"}, "bad value 'true' for argument 'flag' of reward_fn 'toy': must be true or false or null; "
                       "default null"),
    ({"unit": "char"}, "bad value 'char' for argument 'unit' of reward_fn 'toy'. Valid: 'chars', 'tokens'"),
    ({"gamma": "x"}, "bad value 'x' for argument 'gamma' of reward_fn 'toy': must be a number; default 1"),
    ({"names": "a"}, "bad value 'a' for argument 'names' of reward_fn 'toy': must be a list or null; default null"),
])
def test_annotations_and_defaults_say_what_an_argument_takes(args, message):
    with pytest.raises(ConfigError) as info:
        check_component_args("reward_fn", "toy", _component, args, "reward.reward_fn_args.toy")
    assert f"'reward.reward_fn_args.toy.{next(iter(args))}': " + message in str(info.value)


def test_what_fits_passes_and_what_cannot_be_checked_is_left_alone():
    check_component_args("reward_fn", "toy", _component,
                         {"rate": 2, "steps": 4, "flag": None, "unit": "tokens", "gamma": 0.99, "free": "anything",
                          "names": ["a"]}, "reward.reward_fn_args.toy")
    params = inspect.signature(_component).parameters
    assert expected_types(_component, params["free"]) is None  # no annotation, default None: anything goes
    assert expected_types(_component, params["gamma"]) == ({int, float}, ())  # an int default still takes 0.99
