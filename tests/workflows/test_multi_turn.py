import json
import types
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rltk
from rltk.batch import collate
from rltk.rollout.base import SamplingParams
from rltk.workflows.chat import render_text
from rltk.workflows.multi_turn import MultiTurnWorkflow
from tests.builtin_plugins import ensure_registered
from tests.workflows.multi_turn_helpers import (
    BadReturnEnv, CountingEnv, MatchReward, RecordingEngine, ResetRaisesEnv, ScriptedEngine, StepRaisesEnv,
    constant_reward, tiny_engine, tool_tokenizer,
)

ENVS = {"counting": CountingEnv, "step_raises": StepRaisesEnv, "reset_raises": ResetRaisesEnv,
        "bad_return": BadReturnEnv}


@pytest.fixture(scope="module", autouse=True)
def plugins():
    ensure_registered("tools", "tool_parsers", "multi_turn")
    module = types.ModuleType("multi_turn_test_envs")
    module.rltk_environments = lambda: ENVS
    rltk.register_plugin(module, "multi_turn_test_envs")
    yield
    rltk.unregister_plugin("multi_turn_test_envs")


@pytest.fixture(scope="module")
def tok():
    return tool_tokenizer()


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def workflow(tok, engine, reward=None, n=1, max_new_tokens=16, **env):
    return MultiTurnWorkflow(engine=engine, tokenizer=tok, reward=reward or MatchReward(),
                             sampling=SamplingParams(n=n, max_new_tokens=max_new_tokens), env=env)


def rows(*prompts, **extras):
    return [{"prompt": p, "ground_truth": "84", "extras": dict(extras), "id": f"r{i}"} for i, p in enumerate(prompts)]


def segments(mask):
    """[start, end) spans of consecutive 1s."""
    spans, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


# ------------------------------------------------------------------ token-in / token-out with the real engine

def test_trajectory_ids_are_exactly_what_the_hf_engine_received_and_produced(tok):
    engine = RecordingEngine(tiny_engine(tok))
    wf = workflow(tok, engine, reward=constant_reward(1.0), n=2, max_new_tokens=6, environment="counting",
                  environment_args={"turns": 3}, tools=["calculator"])
    experiences = wf.run(rows("12*7=", "3+4=", "99-1="))
    assert len(experiences) == 6 and len(engine.calls) == 3  # one engine call per turn, all episodes together
    assert [len(prompts) for prompts, _, _ in engine.calls] == [6, 6, 6]
    # Per engine call: the (prompt sent, ids produced, log-probs) triples equal, as a multiset, the
    # episodes' (trajectory so far, turn ids, turn log-probs) at that turn.
    for k, (prompts, params, groups) in enumerate(engine.calls):
        assert params.n == 1 and params.max_new_tokens == 6
        sent = sorted((tuple(p), tuple(g[0].token_ids), tuple(g[0].logprobs)) for p, g in zip(prompts, groups))
        built = []
        for e in experiences:
            start, end = segments(e.response_mask)[k]
            built.append((tuple(e.prompt_ids + e.response_ids[:start]), tuple(e.response_ids[start:end]),
                          tuple(e.rollout_logprobs[start:end])))
        assert sorted(built) == sent
    for e in experiences:
        assert len(segments(e.response_mask)) == e.info["turns"] == 3
        observation = [i for i, m in enumerate(e.response_mask) if not m]
        assert all(e.rollout_logprobs[i] == 0.0 for i in observation)
        # the opening is the chat template's own tokenization, tools included
        assert e.prompt_ids == tok.apply_chat_template([{"role": "user", "content": e.info["prompt"]}],
                                                       tools=[rltk.get_component("tool", "calculator").schema()],
                                                       add_generation_prompt=True, tokenize=True, return_dict=False)
    assert wf.metrics()["rollout/engine_calls"] == 3.0


# ------------------------------------------------------------------ hand-derived: a calculator episode

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>'


def test_calculator_episode_hand_derived(tok):
    engine = ScriptedEngine(tok, [CALL, "84"])
    reward = MatchReward()
    wf = workflow(tok, engine, reward=reward, max_new_tokens=120, tools=["calculator"])
    (e,) = wf.run(rows("12*7="))
    turn1 = ids(tok, CALL) + [tok.eos_token_id]
    observation = ids(tok, "<|user|>tool:84<|eos|><|assistant|>")
    turn2 = ids(tok, "84") + [tok.eos_token_id]
    assert e.prompt_ids == ids(tok, "<|system|>tools: calculator<|eos|><|user|>12*7=<|eos|><|assistant|>")
    assert e.response_ids == turn1 + observation + turn2
    assert e.response_mask == [1] * len(turn1) + [0] * len(observation) + [1] * len(turn2)
    assert e.rollout_logprobs == [-0.5] * len(turn1) + [0.0] * len(observation) + [-0.5] * len(turn2)
    assert e.score == 1.0 and e.turn_rewards is None and e.finish_reason == "stop"
    assert reward.seen == [{"prompt": "12*7=", "response": "84"}]  # the final answer, as single_turn scores it
    assert {k: e.info[k] for k in ("turns", "tool_calls", "tool_errors", "truncated", "stop_reason")} == {
        "turns": 2, "tool_calls": 1, "tool_errors": 0, "truncated": False, "stop_reason": "answered"}
    assert e.info["messages"][2] == {"role": "tool", "content": "84", "name": "calculator", "tool_call_id": "call_0"}
    # the ids spell out the template's rendering of the whole conversation
    tools = [rltk.get_component("tool", "calculator").schema()]
    assert tok.decode(e.prompt_ids + e.response_ids) == render_text(tok, e.info["messages"], tools=tools,
                                                                    add_generation_prompt=False)
    m = wf.metrics()
    assert (m["rollout/turns_mean"], m["rollout/tool_calls"], m["rollout/tool_errors"]) == (2.0, 1.0, 0.0)
    assert m["rollout/reward_fn_mean"] == 1.0 and m["rollout/env_reward_mean"] == 0.0


# ------------------------------------------------------------------ tool failure paths: message + counter

@pytest.mark.parametrize("call, message", [
    ("<tool_call>{bad json</tool_call>", "error: tool call 1 is not valid JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', "error: tool call 1 has no tool name"),
    ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "error: tool call 1 ('calculator'): "
                                                                        "arguments must be a JSON object"),
    ('<tool_call>{"name": "search", "arguments": {}}</tool_call>',
     "error: unknown tool 'search'. Available tools: calculator"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>',
     "error: CalculatorError: division by zero"),
    ('<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>',
     "error: ToolArgumentError: tool 'calculator' is missing required argument(s) ['expression']"),
])
def test_a_failed_tool_call_becomes_an_error_observation_and_is_counted(tok, call, message):
    engine = ScriptedEngine(tok, [call, "84"])
    wf = workflow(tok, engine, max_new_tokens=120, tools=["calculator"])
    (e,) = wf.run(rows("12*7="))
    observation = e.info["messages"][2]
    assert observation["role"] == "tool" and observation["content"].startswith(message)
    assert e.info["tool_errors"] == 1 and e.info["turns"] == 2 and e.score == 1.0  # the episode went on
    start, end = segments(e.response_mask)[0][1], segments(e.response_mask)[1][0]
    assert tok.decode(e.response_ids[start:end]).startswith("<|user|>tool:" + message)  # the model sees it
    assert wf.metrics()["rollout/tool_errors"] == 1.0
    parse_failure = "not valid JSON" in message or "no tool name" in message or "JSON object" in message
    assert wf.metrics()["rollout/tool_parse_errors"] == float(parse_failure)


# ------------------------------------------------------------------ environment rewards and failures

def test_turn_rewards_sit_on_each_turns_last_token_and_sum_into_the_score(tok):
    engine = ScriptedEngine(tok, ["a", "bb", "84"])
    wf = workflow(tok, engine, environment="counting", environment_args={"turns": 3, "reward": 0.5})
    (e,) = wf.run(rows("q"))
    ends = [end - 1 for _, end in segments(e.response_mask)]
    assert e.turn_rewards == [(ends[0], 0.5), (ends[1], 0.5), (ends[2], 0.5)]
    assert e.score == 2.5 and e.info["env_reward"] == 1.5 and e.info["reward_fn_score"] == 1.0
    assert e.info["env_info"] == [{"seen": 1}, {"seen": 2}, {"seen": 3}]
    batch = collate([e], pad_token_id=0)
    expected = torch.zeros(len(e.response_ids))
    expected[ends[0]] = expected[ends[1]] = 0.5
    expected[ends[2]] = 0.5 + 1.0  # the last turn's reward plus the reward function's score
    assert torch.equal(batch["token_rewards"][0], expected)
    assert batch["token_rewards"].sum() == batch["scores"][0] == 2.5
    assert wf.metrics()["rollout/env_reward_mean"] == 1.5


def test_an_environment_that_raises_in_step_ends_its_episode_with_the_fallback(tok):
    engine = ScriptedEngine(tok, ["a", "b", "c", "84"])
    wf = workflow(tok, engine, reward=MatchReward(fallback=-1.0), n=2, environment="step_raises",
                  environment_args={"fail_at": 2})
    with pytest.warns(RuntimeWarning, match="raised in step.*simulator crashed.*fallback score -1.0"):
        experiences = wf.run(rows("q"))
    for e in experiences:
        assert e.score == -1.0 and e.turn_rewards is None
        assert e.info["env_error"] == "RuntimeError: simulator crashed" and e.info["stop_reason"] == "env_error"
        assert e.info["turns"] == 2 and segments(e.response_mask)[-1][1] == len(e.response_ids)
    assert wf.metrics()["rollout/env_errors"] == 2.0


def test_an_environment_that_raises_in_reset_drops_only_its_episodes(tok):
    engine = ScriptedEngine(tok, ["84"])
    wf = workflow(tok, engine, n=2, environment="reset_raises", environment_args={"turns": 1})
    data = rows("a", "b")
    data[0]["extras"]["broken"] = True
    with pytest.warns(RuntimeWarning, match="failed to open the episode: KeyError.*no such board.*dropped"):
        experiences = wf.run(data)
    assert [e.info["row_id"] for e in experiences] == ["r1", "r1"]
    assert {e.group_id for e in experiences} == {1}  # row 0 still used its group id: no reuse
    assert wf.metrics()["rollout/env_errors"] == 2.0


def test_an_environment_returning_the_wrong_type_is_an_environment_error(tok):
    wf = workflow(tok, ScriptedEngine(tok, ["84"]), environment="bad_return")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (e,) = wf.run(rows("q"))
    assert "must return a rltk.environments.base.StepResult, got dict" in e.info["env_error"]
    assert any("StepResult" in str(w.message) for w in caught)


def test_environment_close_is_called_once_per_episode(tok, monkeypatch):
    closed = []
    monkeypatch.setattr(CountingEnv, "close", lambda self: closed.append(id(self)))
    wf = workflow(tok, ScriptedEngine(tok, ["x"]), n=3, environment="counting", environment_args={"turns": 2})
    wf.run(rows("q"))
    assert len(closed) == 3 and len(set(closed)) == 3


# ------------------------------------------------------------------ limits

def test_max_turns_truncates(tok):
    wf = workflow(tok, ScriptedEngine(tok, ["x"]), environment="counting", environment_args={"turns": 10},
                  max_turns=2)
    (e,) = wf.run(rows("q"))
    assert e.info["turns"] == 2 and e.info["truncated"] and e.info["stop_reason"] == "max_turns"
    assert e.finish_reason == "length" and e.response_mask[-1] == 1  # nothing appended after the last turn
    assert wf.metrics()["rollout/truncated_fraction"] == 1.0


def test_max_total_tokens_cuts_the_last_turn_and_flags_it(tok):
    engine = ScriptedEngine(tok, ["abcdefgh"])  # 9 tokens a turn with eos; observation <|user|>again<|eos|><|assistant|> 8
    wf = workflow(tok, engine, environment="counting", environment_args={"turns": 10}, max_total_tokens=25,
                  max_turns=10)
    (e,) = wf.run(rows("q"))
    assert len(e.response_ids) == 25 and e.info["stop_reason"] == "max_total_tokens" and e.info["truncated"]
    assert segments(e.response_mask) == [(0, 9), (17, 25)]  # the second turn got the 8 tokens left
    assert [call[1].max_new_tokens for call in engine.calls] == [16, 8]


def test_an_empty_completion_breaks_the_engine_contract(tok):
    class Empty(ScriptedEngine):
        def generate(self, prompt_ids, params):
            groups = super().generate(prompt_ids, params)
            for (completion,) in groups:
                completion.token_ids, completion.logprobs = [], []
            return groups

    with pytest.raises(RuntimeError, match="returned an empty completion"):
        workflow(tok, Empty(tok, ["x"])).run(rows("q"))


def test_an_observation_that_does_not_fit_ends_the_episode(tok):
    wf = workflow(tok, ScriptedEngine(tok, ["abcdefgh"]), environment="counting", environment_args={"turns": 10},
                  max_total_tokens=12)
    (e,) = wf.run(rows("q"))
    assert len(e.response_ids) == 9 and e.info["stop_reason"] == "max_total_tokens"


def test_per_turn_token_limit_reaches_the_engine(tok):
    engine = ScriptedEngine(tok, ["abcdefgh"])
    wf = workflow(tok, engine, max_new_tokens=50, environment="counting", environment_args={"turns": 2},
                  max_new_tokens_per_turn=4)
    (e,) = wf.run(rows("q"))
    assert [call[1].max_new_tokens for call in engine.calls] == [4, 4]
    assert [end - start for start, end in segments(e.response_mask)] == [4, 4]
    # a length-cut turn is closed by the template's closing before the observation (mask 0)
    assert e.response_ids[4] == tok.eos_token_id and e.response_mask[4] == 0


def test_tools_only_episode_ends_at_the_first_turn_without_a_call(tok):
    engine = ScriptedEngine(tok, [CALL, CALL, "84"])
    wf = workflow(tok, engine, max_new_tokens=120, tools=["calculator"], max_turns=5)
    (e,) = wf.run(rows("q"))
    assert e.info["turns"] == 3 and e.info["tool_calls"] == 2 and e.info["stop_reason"] == "answered"


def test_without_tools_configured_the_environment_sees_tool_calls(tok):
    seen = []

    class Spy(CountingEnv):
        def step(self, turn):
            seen.append((turn.tool_calls, turn.parse_error, turn.index))
            return super().step(turn)

    ENVS["spy"] = Spy
    try:
        rltk.unregister_plugin("multi_turn_test_envs")
        module = types.ModuleType("multi_turn_test_envs")
        module.rltk_environments = lambda: ENVS
        rltk.register_plugin(module, "multi_turn_test_envs")
        wf = workflow(tok, ScriptedEngine(tok, [CALL]), max_new_tokens=120, environment="spy",
                      environment_args={"turns": 1})
        wf.run(rows("q"))
    finally:
        del ENVS["spy"]
    assert seen[0][0][0].name == "calculator" and seen[0][1] is None and seen[0][2] == 0


# ------------------------------------------------------------------ groups, baseline, evaluation, state

def test_groups_are_per_row_and_unique_across_calls_and_resumes(tok):
    wf = workflow(tok, ScriptedEngine(tok, ["84"]), n=3)
    first = wf.run(rows("a", "b"))
    assert [e.group_id for e in first] == [0, 0, 0, 1, 1, 1]
    assert [e.info["sample_index"] for e in first] == [0, 1, 2, 0, 1, 2]
    state = json.loads(json.dumps(wf.state_dict()))
    resumed = workflow(tok, ScriptedEngine(tok, ["84"]), n=3)
    resumed.load_state_dict(state)
    assert {e.group_id for e in resumed.run(rows("c"))} == {2}
    with pytest.raises(ValueError, match=r"multi_turn.load_state_dict: state\[.next_group_id.\] = -1 must be an integer >= 0"):
        resumed.load_state_dict({"next_group_id": -1})


def test_greedy_baseline_scores_one_greedy_episode_per_row(tok):
    engine = ScriptedEngine(tok, lambda prompt, call: "84" if len(engine.calls) > 1 else "no")
    wf = workflow(tok, engine, n=2)
    experiences = wf.run(rows("a"), greedy_baseline=True)
    assert engine.calls[1][1].greedy and [e.baseline_score for e in experiences] == [1.0, 1.0]
    assert [e.score for e in experiences] == [0.0, 0.0]
    assert "baseline_scores" in collate(experiences, 0)


def test_evaluate(tok):
    engine = ScriptedEngine(tok, ["x", "84"])
    wf = workflow(tok, engine, environment="counting", environment_args={"turns": 2, "reward": 0.0})
    metrics = wf.evaluate(rows("a", "b"))
    assert engine.calls[0][1].greedy and engine.calls[0][1].n == 1
    assert metrics["accuracy"] == 1.0 and metrics["mean_turns"] == 2.0 and metrics["num_responses"] == 2.0
    assert metrics["truncated_fraction"] == 0.0


def test_registered_and_built_from_the_env_section(tok):
    assert rltk.get_component("workflow", "multi_turn") is MultiTurnWorkflow
    with pytest.raises(rltk.RegistryError, match="unknown environment 'countin' at 'env.environment'.*'counting'"):
        workflow(tok, ScriptedEngine(tok, ["x"]), environment="countin")
    with pytest.raises(ValueError, match=r"env.tools_args.calculator: tool 'calculator' has no argument 'bogus'"):
        workflow(tok, ScriptedEngine(tok, ["x"]), tools=["calculator"], tools_args={"calculator": {"bogus": 1}})
    with pytest.raises(ValueError, match="env.max_turns must be an integer >= 1, got 0"):
        workflow(tok, ScriptedEngine(tok, ["x"]), max_turns=0)
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['env.max_turn'\]"):
        workflow(tok, ScriptedEngine(tok, ["x"]), max_turn=3)
    wf = workflow(tok, ScriptedEngine(tok, ["x"]), tools=["calculator"], tools_args={"calculator": {"digits": 2}})
    assert wf.tools["calculator"].bound == {"digits": 2} and wf.max_new_tokens_per_turn == 16


# ------------------------------------------------------------------ invariants over random episodes

texts = st.text(alphabet="abc 0123456789+*", min_size=0, max_size=10)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(texts, min_size=1, max_size=5), st.lists(st.integers(1, 5), min_size=1, max_size=4),
       st.integers(1, 6), st.integers(10, 80), st.integers(2, 12), st.booleans())
def test_mask_and_token_invariants(tok, script, turns, max_turns, max_total, per_turn, stop):
    engine = ScriptedEngine(tok, lambda prompt, call: script[(len(prompt) + call) % len(script)], stop=stop)
    wf = workflow(tok, engine, reward=constant_reward(0.25), max_new_tokens=per_turn, environment="counting",
                  environment_args={"reward": 0.5}, max_turns=max_turns, max_total_tokens=max_total)
    data = [{"prompt": "q", "ground_truth": "", "extras": {"turns": t}} for t in turns]
    experiences = wf.run(data)
    assert len(experiences) == len(turns)
    assert wf.metrics()["rollout/engine_calls"] == max(e.info["turns"] for e in experiences)
    for e, wanted in zip(experiences, turns):
        n = len(e.response_ids)
        assert len(e.response_mask) == len(e.rollout_logprobs) == n <= max_total
        assert all((lp == -0.5) == bool(m) for lp, m in zip(e.rollout_logprobs, e.response_mask))
        spans = segments(e.response_mask)
        assert e.response_mask[-1] == 1 and len(spans) == e.info["turns"] <= min(max_turns, wanted)
        assert all(end - start <= per_turn for start, end in spans)
        assert [p for p, _ in e.turn_rewards] == [end - 1 for _, end in spans]
        assert e.score == pytest.approx(0.5 * len(spans) + 0.25)
        assert collate([e], 0)["token_rewards"].sum().item() == pytest.approx(e.score)
        assert e.info["truncated"] == (e.info["stop_reason"] != "done")
        # the engine got this episode's ids up to each turn, and nothing else
        for k, (start, _) in enumerate(spans):
            assert e.prompt_ids + e.response_ids[:start] in engine.calls[k][0]
