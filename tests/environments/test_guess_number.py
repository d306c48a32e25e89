"""The guess_number environment: its feedback, rewards and limits, alone and under the multi_turn workflow."""

import pytest

import rltk
from rltk.data.multi_turn_tasks import guess_number
from rltk.environments.base import AssistantTurn
from rltk.environments.guess_number import GuessNumber
from rltk.rollout.base import SamplingParams
from rltk.workflows.multi_turn import MultiTurnWorkflow
from tests.builtin_plugins import ensure_registered
from tests.workflows.multi_turn_helpers import ScriptedEngine


@pytest.fixture(autouse=True)
def builtins():
    ensure_registered("tasks", "guess_number")


def row(secret, low=1, high=31):
    return next(r for r in guess_number("test", high - low + 1, 0, low=low, high=high) if r["extras"]["secret"] == secret)


def play(env, guesses):
    return [env.step(AssistantTurn(text=g)) for g in guesses]


def test_feedback_and_reward_by_hand():
    env = GuessNumber()
    assert env.reset(row(11)) == [{"role": "user", "content": "guess 1-31"}]
    results = play(env, ["16", "8", " 12 ", "x1", "11"])
    assert [r.observation for r in results[:4]] == [[{"role": "user", "content": c}] for c in
                                                    ("lower", "higher", "lower", "a number")]
    assert [(r.reward, r.done) for r in results] == [(0.0, False)] * 4 + [(1.0, True)]
    assert results[-1].info == {"guess": 11, "secret": 11, "solved": True, "guesses": 5}


def test_decay_rewards_fewer_guesses():
    env = GuessNumber(decay=0.5)
    env.reset(row(4))
    assert play(env, ["16", "8", "4"])[-1].reward == 0.25  # 0.5 ** (3 - 1)


def test_max_guesses_ends_unsolved():
    env = GuessNumber(max_guesses=2)
    env.reset(row(4))
    first, second = play(env, ["16", "8"])
    assert not first.done and second.done and second.reward == 0.0 and second.observation == []


@pytest.mark.parametrize("kwargs, message", [
    ({"decay": 0.0}, r"env.environment_args.decay must be in \(0, 1\], got 0.0"),
    ({"decay": 2}, r"decay must be in \(0, 1\], got 2"),
    ({"max_guesses": 0}, r"env.environment_args.max_guesses must be an integer >= 1 or null, got 0"),
])
def test_bad_arguments_name_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GuessNumber(**kwargs)


def test_a_row_of_another_task_is_refused_naming_the_task():
    with pytest.raises(KeyError, match=r"row 'a' has no extras\['secret'\].*data.task=guess_number"):
        GuessNumber().reset({"prompt": "1+2=", "extras": {"a": 1}, "id": "a"})


def test_registered_as_an_environment():
    assert rltk.get_component("environment", "guess_number") is GuessNumber


def _workflow(tokenizer, script, max_turns):
    return MultiTurnWorkflow(engine=ScriptedEngine(tokenizer, script), tokenizer=tokenizer,
                             reward=lambda **sample: 0.0, sampling=SamplingParams(n=1, max_new_tokens=4),
                             env={"environment": "guess_number", "max_turns": max_turns})


def test_binary_search_wins_within_the_turn_limit_under_the_workflow():
    from rltk.models.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    rows = guess_number("test", 31, 0)  # each secret once

    def binary_search(prompt_ids, call):  # reads the feedback so far from the ids the engine is given
        text = tokenizer.decode(prompt_ids, skip_special_tokens=False)
        lo, hi = 1, 31
        for reply in text.split("<|user|>")[2:]:
            guess = (lo + hi) // 2
            lo, hi = (guess + 1, hi) if reply.startswith("higher") else (lo, guess - 1)
        return str((lo + hi) // 2)

    experiences = _workflow(tokenizer, binary_search, max_turns=5).run(rows)
    assert len(experiences) == 31 and all(e.score == 1.0 for e in experiences)
    assert max(e.info["turns"] for e in experiences) == 5  # ceil(log2(32)): the limit is exactly enough
    # one guess short of the limit, the secrets that need five guesses are lost
    short = _workflow(tokenizer, binary_search, max_turns=4).run(rows)
    assert sum(e.score for e in short) == sum(e.info["turns"] < 5 for e in experiences) == 15


class FakeClient:
    """An openai-client look-alike whose replies come from ``policy(messages)``; it records every request."""

    def __init__(self, policy):
        from types import SimpleNamespace

        self.requests = []

        def create(model, messages, **kwargs):
            self.requests.append({"model": model, "messages": [dict(m) for m in messages], **kwargs})
            message = SimpleNamespace(content=policy(messages))
            return SimpleNamespace(choices=[SimpleNamespace(message=message)])

        self.chat = SimpleNamespace(completions=SimpleNamespace(create=create))


def test_the_agent_plays_the_environment_over_the_chat_api():
    from rltk.environments.guess_number import guess_number_agent

    guesses = iter(["16", "8", "4", "6", "5"])
    client = FakeClient(lambda messages: next(guesses))
    assert guess_number_agent(row(5), client, "policy") == 1.0
    last = client.requests[-1]["messages"]
    assert [m["content"] for m in last] == ["guess 1-31", "16", "lower", "8", "lower", "4", "higher", "6", "lower"]
    assert [m["role"] for m in last[1:3]] == ["assistant", "user"] and client.requests[0]["model"] == "policy"


def test_the_agent_loses_after_max_turns_and_decays_like_the_environment():
    from rltk.environments.guess_number import guess_number_agent

    assert guess_number_agent(row(5), FakeClient(lambda m: "16"), "m", max_turns=3) == 0.0
    client = FakeClient(lambda m: "16" if len(m) == 1 else "24")
    assert guess_number_agent(row(24), client, "m", decay=0.5, max_tokens=4) == 0.5
    assert all(r["max_tokens"] == 4 for r in client.requests)
    assert rltk.get_component("agent", "guess_number") is guess_number_agent
