"""The agentic workflow: agents drive the policy through the in-process endpoint; sessions become experiences."""

from __future__ import annotations

import re
import threading
import time
import types

import pytest

import rltk
from rltk.registry import RegistryError
from rltk.rollout.base import SamplingParams
from rltk.workflows.agentic import AgenticWorkflow
from tests.serve.helpers import ScriptedEngine, ensure_serve_builtins, tiny_chat_model

from tests.waits import scaled


def answer_last_sum(prompt_text: str) -> str:
    """The scripted policy: the last sum a user asked for, or "9" when there is none."""
    sums = re.findall(r"<\|user\|>(\d+)\+(\d+)=<\|eos\|>", prompt_text)
    return str(int(sums[-1][0]) + int(sums[-1][1])) if sums else "9"


def exact(prompt, response, ground_truth, extras):
    return float(response.strip() == ground_truth)


calls = {"raise_on": set(), "rewards": {}}


def flaky(row, client, model):
    """Answers, but raises on the rows named in calls["raise_on"]."""
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": row["prompt"]}])
    if row["id"] in calls["raise_on"]:
        raise ValueError(f"agent gave up on {row['id']}")
    return calls["rewards"].get(row["id"])


def rewriter(row, client, model):
    """Turn 2 drops turn 1 from the conversation: a non-prefix continuation."""
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": row["prompt"]}])
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "1+1="}])


def picky(row, client, model):
    """Asks for its own temperature; training forces the rollout's."""
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": row["prompt"]}],
                                   temperature=0.3, max_tokens=3)


def silent(row, client, model):
    return 1.0


def bad_return(row, client, model):
    client.completions.create(model=model, prompt=row["prompt"])
    return "yes"


@pytest.fixture(scope="module", autouse=True)
def agents():
    ensure_serve_builtins()
    plugin = types.ModuleType("agentic_test_agents")
    plugin.rltk_agents = rltk.hookimpl(lambda: {"flaky": flaky, "rewriter": rewriter, "picky": picky,
                                                "silent": silent, "bad_return": bad_return})
    rltk.register_plugin(plugin, name="agentic_test_agents")
    yield
    rltk.unregister_plugin("agentic_test_agents")


@pytest.fixture(scope="module")
def setup():
    tokenizer, _ = tiny_chat_model()
    engine = ScriptedEngine(tokenizer, answer_last_sum)
    return tokenizer, engine


def make(setup, agent, n=2, **kwargs):
    tokenizer, engine = setup
    engine.calls.clear()
    sampling = SamplingParams(n=n, temperature=0.9, top_p=0.8, max_new_tokens=4)
    return AgenticWorkflow(engine=engine, tokenizer=tokenizer, reward=exact, sampling=sampling, agent=agent,
                           batch_window_s=0.05, **kwargs)


ROWS = [{"prompt": f"{a}+{b}=", "ground_truth": str(a + b), "extras": {}, "id": f"r{a}"} for a, b in
        [(2, 3), (4, 4), (10, 5)]]


def test_a_two_turn_chat_agent_gives_one_experience_per_episode_with_masks_and_logprobs(setup):
    tokenizer, engine = setup
    workflow = make(setup, "arithmetic_chat", agent_args={"checks": 1})
    try:
        experiences = workflow.run(ROWS[:2])
        assert len(experiences) == 4  # 2 rows x n=2, one segment each
        assert [e.group_id for e in experiences] == [0, 0, 1, 1]
        first = experiences[0]
        turn1 = tokenizer.apply_chat_template([{"role": "user", "content": "2+3="}], add_generation_prompt=True,
                                              tokenize=False)
        assert first.prompt_ids == tokenizer(turn1, add_special_tokens=False)["input_ids"]
        eos = tokenizer.eos_token_id
        inserted = tokenizer("<|user|>Check it. Answer:<|eos|><|assistant|>", add_special_tokens=False)["input_ids"]
        five = tokenizer("5", add_special_tokens=False)["input_ids"]
        assert first.response_ids == five + [eos] + inserted + five + [eos]
        assert first.response_mask == [1, 1] + [0] * len(inserted) + [1, 1]
        assert first.rollout_logprobs == [-0.1, -0.2] + [0.0] * len(inserted) + [-0.1, -0.2]
        assert first.score == 1.0 and experiences[2].score == 1.0  # "8" for 4+4
        # the engine got exactly the stitched prompts: turn 2's prompt is the trajectory up to its completion
        turn2_prompts = [p for prompts, _ in engine.calls for p in prompts if len(p) > len(first.prompt_ids)]
        assert first.prompt_ids + first.response_ids[:-2] in turn2_prompts
        metrics = workflow.metrics()
        assert metrics["agentic/episodes"] == 4 and metrics["agentic/agent_errors"] == 0
        assert metrics["agentic/segments_per_episode"] == 1 and metrics["agentic/requests_per_episode"] == 2
        assert metrics["rollout/policy_tokens"] == 16 and metrics["rollout/turns_mean"] == 2
        assert workflow.app_state.store.session_ids() == []  # every session was consumed
        assert workflow.run(ROWS[2:])[0].group_id == 2  # ids go on across calls
    finally:
        workflow.close()


def test_an_agent_that_raises_drops_its_episode_and_is_counted(setup):
    calls["raise_on"], calls["rewards"] = {"r4"}, {}
    workflow = make(setup, "flaky")
    try:
        experiences = workflow.run(ROWS)
        assert sorted({e.info["row_id"] for e in experiences}) == ["r10", "r2"]
        assert len(experiences) == 4
        assert workflow.metrics()["agentic/agent_errors"] == 2
        assert workflow.metrics()["agentic/episodes"] == 6
    finally:
        workflow.close()


def test_the_agents_float_is_the_score_and_none_falls_back_to_the_reward(setup):
    calls["raise_on"], calls["rewards"] = set(), {"r2": 0.25}
    workflow = make(setup, "flaky", n=1)
    try:
        scores = {e.info["row_id"]: (e.score, e.reward_details) for e in workflow.run(ROWS)}
        assert scores["r2"] == (0.25, {"agent": 0.25})
        assert scores["r4"][0] == 1.0 and scores["r10"][0] == 1.0  # scripted sums are right
    finally:
        workflow.close()


def test_a_non_prefix_continuation_starts_a_new_segment_in_the_same_group(setup):
    tokenizer, _ = setup
    workflow = make(setup, "rewriter", n=1)
    try:
        experiences = workflow.run(ROWS[:1])
        assert len(experiences) == 2
        assert [e.info["segment"] for e in experiences] == [0, 1] and {e.group_id for e in experiences} == {0}
        assert tokenizer.decode(experiences[1].prompt_ids) == "<|user|>1+1=<|eos|><|assistant|>"
        assert all(e.response_mask == [1] * len(e.response_ids) for e in experiences)
        assert workflow.metrics()["agentic/segments_per_episode"] == 2
    finally:
        workflow.close()


def test_training_forces_the_rollout_distribution_and_evaluation_forces_greedy(setup):
    _, engine = setup
    workflow = make(setup, "picky", n=1)
    try:
        workflow.run(ROWS[:1])
        [(_, params)] = engine.calls
        assert (params.temperature, params.top_p, params.greedy, params.max_new_tokens) == (0.9, 0.8, False, 3)
        engine.calls.clear()
        result = workflow.evaluate(ROWS)
        assert all(params.greedy for _, params in engine.calls)
        assert result["num_responses"] == 3 and result["agent_errors"] == 0
    finally:
        workflow.close()


def test_concurrent_episodes_share_engine_calls(setup):
    tokenizer, _ = setup

    class SlowEngine(ScriptedEngine):
        def generate(self, prompt_ids, params):
            time.sleep(0.05)
            return super().generate(prompt_ids, params)

    engine = SlowEngine(tokenizer, answer_last_sum)
    workflow = AgenticWorkflow(engine=engine, tokenizer=tokenizer, reward=exact,
                               sampling=SamplingParams(n=8, max_new_tokens=4), agent="arithmetic_chat",
                               batch_window_s=0.05)
    try:
        experiences = workflow.run(ROWS[:2])
        assert len(experiences) == 16
        assert len(engine.calls) < 16
        assert workflow.metrics()["agentic/requests_per_engine_call"] > 1
    finally:
        workflow.close()


def test_each_turn_of_all_running_episodes_goes_out_in_one_engine_call_without_waiting_the_window(setup):
    """The workflow tells the batcher how many episodes are live: once each has its request in, the round goes."""
    tokenizer, engine = setup
    engine.calls.clear()
    workflow = AgenticWorkflow(engine=engine, tokenizer=tokenizer, reward=exact,
                               sampling=SamplingParams(n=4, max_new_tokens=4), agent="arithmetic_chat",
                               agent_args={"checks": 1}, batch_window_s=scaled(5.0), batch_max_wait_s=scaled(5.0),
                               concurrency=12)
    try:
        start = time.monotonic()
        experiences = workflow.run(ROWS)  # 12 episodes, 2 turns each
        elapsed = time.monotonic() - start
        assert len(experiences) == 12
        assert [len(prompts) for prompts, _ in engine.calls] == [12, 12]  # one call per turn, all episodes in it
        assert elapsed < scaled(5.0)  # a round closed by the window or max_wait_s would take that each
        assert workflow.app_state.batcher._expected is None  # off between steps (rltk serve-like traffic)
        # fewer threads than episodes: the live count is the running ones, and the eval path does the same
        engine.calls.clear()
        workflow.concurrency = 2
        workflow.evaluate(ROWS[:2])
        assert [len(prompts) for prompts, _ in engine.calls] == [2, 2]
    finally:
        workflow.close()


def test_episodes_borrow_clients_from_a_pool_that_lives_across_steps(setup):
    """One client (and connection) per running episode, reused by the next step's episodes, closed with the workflow."""
    workflow = make(setup, "arithmetic_chat", n=4, concurrency=3)
    try:
        workflow.run(ROWS[:2])  # 8 episodes on 3 threads
        clients = list(workflow._free_clients)
        assert 1 <= len(clients) <= 3
        workflow.run(ROWS[:2])
        assert {id(c) for c in clients} <= {id(c) for c in workflow._free_clients}  # reused, none lost
        assert len(workflow._free_clients) <= 3
        clients = list(workflow._free_clients)
    finally:
        workflow.close()
    assert workflow._free_clients == []
    assert all(c.is_closed() for c in clients)


def test_failures_that_leave_nothing_to_train_on_are_errors_naming_the_cause(setup):
    calls["raise_on"] = {r["id"] for r in ROWS}
    workflow = make(setup, "flaky", n=1)
    try:
        with pytest.raises(RuntimeError, match=r"(?s)all 3 episodes .*ValueError: agent gave up on r"):
            workflow.run(ROWS)
        silent = make(setup, "silent", n=1)
        with pytest.raises(RuntimeError, match="no agent sent a single request"):
            silent.run(ROWS[:1])
        silent.close()
        bad = make(setup, "bad_return", n=1)
        with pytest.raises(RuntimeError, match="returned 'yes'; an agent returns the episode's reward"):
            bad.run(ROWS[:1])
        bad.close()
    finally:
        workflow.close()


def test_an_unknown_agent_lists_the_registered_ones(setup):
    with pytest.raises(RegistryError, match="arithmetic_chat"):
        make(setup, "arithmetic_chatt")


def test_validate_names_an_unknown_agent_and_a_mistyped_agent_argument(capsys):
    from rltk.commands.cli import main

    base = ["validate", "grpo", "rollout.workflow=agentic"]
    assert main(base + ["rollout.workflow_args.agent=arithmetic_chatt"]) == 2
    err = capsys.readouterr().err
    assert "rollout.workflow_args.agent" in err and "arithmetic_chat" in err
    assert main(base + ["rollout.workflow_args.agent=arithmetic_chat",
                        "rollout.workflow_args.agent_args.chekcs=1"]) == 2
    err = capsys.readouterr().err
    assert "rollout.workflow_args.agent_args.chekcs" in err and "checks" in err
    assert main(base + ["rollout.workflow_args.agent=arithmetic_chat",
                        "rollout.workflow_args.agent_args.checks=1"]) == 0
    assert main(base) == 2  # the workflow needs its agent
    assert "agent" in capsys.readouterr().err


def test_env_caps_requests_per_episode_and_tokens_per_request(setup):
    tokenizer, engine = setup
    capped = make(setup, "arithmetic_chat", n=1, agent_args={"checks": 1},
                  env={"max_turns": 1, "max_new_tokens_per_turn": 2, "tool_parser": "hermes"})
    try:
        with pytest.raises(RuntimeError, match=r"(?s)BadRequestError: Error code: 400 - session .* already made 1 requests.*env.max_turns"):
            capped.run(ROWS[:1])  # the re-check is the episode's second request
        assert capped.app_state.max_tokens_limit == 2
        assert all(params.max_new_tokens == 2 for _, params in engine.calls)
    finally:
        capped.close()
    with pytest.raises(ValueError, match="env.max_turns must be an integer >= 1"):
        make(setup, "arithmetic_chat", env={"max_turns": 0})


TOOL_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'tool' -%}<|user|>result: {{ m['content'] }}<|eos|>"
    "{%- elif m['role'] == 'assistant' -%}<|assistant|>{{ m['content'] }}"
    "{%- for call in m.get('tool_calls') or [] -%}"
    "<tool_call>{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}"
    "</tool_call>{%- endfor -%}<|eos|>"
    "{%- else -%}<|{{ m['role'] }}|>{{ m['content'] }}<|eos|>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


def test_the_tool_agent_runs_the_calculator_the_policy_calls_and_stays_one_trajectory():
    tokenizer, _ = tiny_chat_model()
    tokenizer.chat_template = TOOL_TEMPLATE

    def script(prompt_text):
        if prompt_text.endswith("<|eos|><|assistant|>") and "result: " in prompt_text.rsplit("<|user|>", 1)[-1]:
            return prompt_text.rsplit("result: ", 1)[-1].split("<|eos|>")[0]  # answer with the tool's output
        question = re.findall(r"<\|user\|>(\d+\+\d+)=<\|eos\|>", prompt_text)[-1]
        return '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>' % question

    engine = ScriptedEngine(tokenizer, script)
    workflow = AgenticWorkflow(engine=engine, tokenizer=tokenizer, reward=exact,
                               sampling=SamplingParams(n=2, max_new_tokens=100), agent="arithmetic_tools",
                               env={"tools": ["calculator"]})
    try:
        experiences = workflow.run(ROWS[:2])
        assert [e.score for e in experiences] == [1.0] * 4  # 5 and 8, from the calculator
        assert all(e.info["requests"] == 2 and e.info["segments"] == 1 for e in experiences)
        inserted = tokenizer("<|user|>result: 5<|eos|><|assistant|>", add_special_tokens=False)["input_ids"]
        mask = experiences[0].response_mask
        zeros = [i for i, m in enumerate(mask) if m == 0]
        assert len(zeros) == len(inserted)  # only the tool result and the next generation prompt
        assert [experiences[0].response_ids[i] for i in zeros] == inserted
    finally:
        workflow.close()


def test_the_chat_agent_opens_with_a_rows_messages_when_it_has_them(setup):
    tokenizer, engine = setup
    workflow = make(setup, "arithmetic_chat", n=1, agent_args={"system_prompt": "Add."})
    try:
        rows = [{"messages": [{"role": "user", "content": "3+4="}], "ground_truth": "7", "id": "m"}]
        [experience] = workflow.run(rows)
        assert tokenizer.decode(experience.prompt_ids) == "<|system|>Add.<|eos|><|user|>3+4=<|eos|><|assistant|>"
        assert experience.score == 1.0 and experience.info["prompt"] == "3+4="
    finally:
        workflow.close()
