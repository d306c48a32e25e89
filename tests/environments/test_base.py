import math

import pytest

from rltk.environments.base import AssistantTurn, Environment, StepResult, check_messages, check_step_result


class Echo(Environment):
    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, turn):
        return StepResult(observation=[{"role": "user", "content": turn.text}], reward=1.0, done=True)


def test_an_environment_implements_reset_and_step_and_close_defaults_to_nothing():
    env = Echo()
    assert env.reset({"prompt": "hi"}) == [{"role": "user", "content": "hi"}]
    result = env.step(AssistantTurn(text="yo"))
    assert (result.observation, result.reward, result.done, result.info) == (
        [{"role": "user", "content": "yo"}], 1.0, True, {})
    assert env.close() is None
    with pytest.raises(TypeError):
        Environment()  # abstract


def test_assistant_turn_defaults():
    turn = AssistantTurn(text="x")
    assert (turn.tool_calls, turn.parse_error, turn.token_ids, turn.finish_reason, turn.index) == (
        [], None, [], "stop", 0)


@pytest.mark.parametrize("result, message", [
    ({"observation": []}, "must return a rltk.environments.base.StepResult, got dict"),
    (StepResult(reward=math.nan), "reward must be a finite number, got nan"),
    (StepResult(reward=True), "reward must be a finite number, got True"),
    (StepResult(done=1), "done must be True or False, got 1"),
    (StepResult(info=[]), "info must be a dict"),
    (StepResult(observation={"role": "user"}), "observation must be a list of chat messages"),
    (StepResult(observation=[{"role": "user", "content": 3}]), r"observation\[0\] must be a dict with string"),
])
def test_bad_step_results_are_named(result, message):
    with pytest.raises((TypeError, ValueError), match=message):
        check_step_result(result, "environment 'x'")


def test_check_messages_accepts_extra_keys():
    messages = [{"role": "tool", "content": "4", "name": "calculator"}]
    assert check_messages(messages, "where") is messages
