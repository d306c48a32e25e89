"""Tool-using agents under `agentic`: their tools reach the warm-up, their tool use is counted, and
`run_tool_calls` runs the calls of a reply (issue 29, items 1, 3 and 4)."""

from __future__ import annotations

import json
import logging
import re
import types

import pytest

import rltk
from rltk.data.loading import format_prompts
from rltk.data.multi_turn_tasks import calculator_arithmetic
from rltk.models.tiny import build_char_tokenizer
from rltk.rollout.base import SamplingParams
from rltk.tools.builtin import calculator
from rltk.workflows.agentic import AgenticWorkflow
from rltk.workflows.agents import run_tool_calls
from tests.serve.helpers import ScriptedEngine, ensure_serve_builtins

CALL = '<tool_call>{"name": "%s", "arguments": {"expression": "%s"}}</tool_call>'


def exact(prompt, response, ground_truth, extras):
    return float(response.strip() == ground_truth)


def toolless(row, client, model):
    """The issue's agent before the fix: its tools are its own business, so none reach the warm-up's prompt."""
    client.chat.completions.create(model=model, messages=list(row["messages"]), tools=[calculator.schema()])


def reporting(row, client, model, *, tools):
    """Uses its tools, and reports a number of its own beside a reward of None (the reward function scores)."""
    messages = list(row["messages"])
    for _ in range(3):
        message = client.chat.completions.create(model=model, messages=messages,
                                                 tools=[t.schema() for t in tools]).choices[0].message
        if not message.tool_calls:
            return None, {"turns_seen": len(messages)}
        messages += run_tool_calls(message, tools)
    return None, {"turns_seen": len(messages)}


@pytest.fixture(scope="module", autouse=True)
def agents():
    ensure_serve_builtins()
    plugin = types.ModuleType("agentic_tool_test_agents")
    plugin.rltk_agents = rltk.hookimpl(lambda: {"toolless": toolless, "reporting": reporting})
    rltk.register_plugin(plugin, name="agentic_tool_test_agents")
    yield
    rltk.unregister_plugin("agentic_tool_test_agents")


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer(tool_role=True)


def rows(tokenizer, count=2):
    """calculator_arithmetic rows formatted as a run formats them: the opening rendered with env.tools."""
    return format_prompts(calculator_arithmetic("train", count, 0), tokenizer, use_chat_template=True,
                          tools=[calculator.schema()])


def calling(tool_name="calculator", expression=None):
    """A scripted policy: call ``tool_name`` on the question, then answer with the tool's result."""
    def script(prompt_text):
        if prompt_text.endswith("<|eos|><|assistant|>") and prompt_text.rsplit("<|eos|>", 2)[-2].rfind("<|tool|>") >= 0:
            return prompt_text.rsplit("<|tool|>", 1)[-1].split("<|eos|>")[0]
        question = re.findall(r"<\|user\|>([\d+]+)=<\|eos\|>", prompt_text)[-1]
        return CALL % (tool_name, expression or question)
    return script


def workflow_for(tokenizer, script, agent, tools=("calculator",)):
    engine = ScriptedEngine(tokenizer, script)
    return AgenticWorkflow(engine=engine, tokenizer=tokenizer, reward=exact, agent=agent,
                           sampling=SamplingParams(n=2, max_new_tokens=120),
                           env={"tools": list(tools), "max_new_tokens_per_turn": 120})


def test_the_agent_gets_env_tools_and_its_opening_is_the_warm_ups_prompt(tokenizer):
    workflow = workflow_for(tokenizer, calling(), "arithmetic_tools")
    try:
        batch = rows(tokenizer)
        experiences = workflow.run(batch)
        assert [e.score for e in experiences] == [1.0] * 4  # the calculator's sums, copied
        # the first request is the row's prompt as the warm-up rendered it, tools block included
        assert tokenizer.decode(experiences[0].prompt_ids) == batch[0]["prompt"]
        assert batch[0]["prompt"].startswith("<|system|>tools: calculator(expression)<|eos|>")
        metrics = workflow.metrics()
        assert metrics["agentic/opening_mismatch"] == 0.0
        # one call and one result per episode, all well formed; every episode used the tool
        assert (metrics["rollout/tool_calls"], metrics["rollout/tool_results"], metrics["rollout/tool_errors"],
                metrics["rollout/tool_parse_errors"], metrics["rollout/tool_call_fraction"]) == (1, 1, 0, 0, 1)
        assert experiences[0].info["tool_calls"] == 1 and experiences[0].info["segments"] == 1
        assert workflow.evaluate(batch)["tool_calls"] == 1.0
    finally:
        workflow.close()


def test_an_agent_whose_prompt_the_warm_up_never_rendered_is_counted_and_reported(tokenizer, caplog):
    # the failure: tools offered by the agent, but none in env.tools, so the warm-up's prompt (and
    # demonstrations) had no tools block while every request carried one
    workflow = workflow_for(tokenizer, calling(), "toolless", tools=())
    try:
        batch = format_prompts(calculator_arithmetic("train", 2, 0), tokenizer, use_chat_template=True)
        with caplog.at_level(logging.WARNING, logger="rltk.workflows.agentic"):
            workflow.run(batch)
            workflow.run(batch)
        assert workflow.metrics()["agentic/opening_mismatch"] == 1.0
        warnings = [r.getMessage() for r in caplog.records if "is not the prompt the warm-up" in r.getMessage()]
        assert len(warnings) == 1  # once per workflow; the metric counts every step
        assert "'<|system|>tools: calculator(expression)" in warnings[0] and "env.tools (none)" in warnings[0]
    finally:
        workflow.close()


def test_tool_errors_parse_errors_and_the_agents_own_numbers_are_logged(tokenizer):
    # an unknown tool: the call parses, run_tool_calls answers "error: ...", the endpoint counts it
    workflow = workflow_for(tokenizer, calling(tool_name="abacus"), "reporting")
    try:
        workflow.run(rows(tokenizer, 1))
        metrics = workflow.metrics()
        # the call, its "error: unknown tool" result, then the scripted policy repeats that text as its answer
        assert (metrics["rollout/tool_calls"], metrics["rollout/tool_results"], metrics["rollout/tool_errors"]) == (1, 1, 1)
        assert metrics["agent/turns_seen"] == 3  # the user message, the assistant's call, the tool's error
    finally:
        workflow.close()
    broken = workflow_for(tokenizer, lambda text: "<tool_call>{not json</tool_call>", "reporting")
    try:
        broken.run(rows(tokenizer, 1))
        metrics = broken.metrics()
        # the endpoint could not parse the call: no tool_calls in the reply, so the agent stops
        assert (metrics["rollout/tool_calls"], metrics["rollout/tool_parse_errors"], metrics["rollout/tool_errors"],
                metrics["rollout/tool_call_fraction"]) == (0, 2, 1, 0)
    finally:
        broken.close()


def test_an_agent_that_takes_tools_needs_env_tools(tokenizer):
    with pytest.raises(ValueError, match=r"env.tools is empty; list them in env.tools"):
        workflow_for(tokenizer, calling(), "arithmetic_tools", tools=())


@pytest.mark.parametrize("returned, error", [((1.0, {"x": "a"}), "dict of finite numbers"), ("yes", "finite float")])
def test_a_bad_return_value_drops_the_episode_naming_what_is_valid(tokenizer, returned, error):
    from rltk.workflows.agentic import _agent_result

    with pytest.raises(TypeError, match=error):
        _agent_result("a", returned)
    assert _agent_result("a", (None, {"calls": 2})) == (None, {"calls": 2.0})
    assert _agent_result("a", 0.5) == (0.5, {})


# ---------------------------------------------------------------- run_tool_calls

def reply(*calls, content=None):
    return {"role": "assistant", "content": content,
            "tool_calls": [{"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
                           for i, (n, a) in enumerate(calls)]}


def test_run_tool_calls_echoes_the_turn_and_answers_each_call():
    messages = run_tool_calls(reply(("calculator", '{"expression": "2+3"}'), ("calculator", '{"expression": "7/0"}')),
                              [calculator])
    assert messages[0] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'}},
        {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "7/0"}'}}]}
    assert messages[1] == {"role": "tool", "tool_call_id": "call_0", "name": "calculator", "content": "5"}
    assert messages[2]["tool_call_id"] == "call_1" and messages[2]["content"].startswith("error: ")
    assert "division by zero" in messages[2]["content"]


@pytest.mark.parametrize("name, arguments, says", [
    ("abacus", '{"expression": "1"}', "unknown tool 'abacus'; available: calculator"),
    ("calculator", '{"expression": ', "arguments are not valid JSON"),
    ("calculator", '[1]', "arguments must be a JSON object"),
    ("calculator", '{"expr": "1+1"}', "missing required argument"),
])
def test_run_tool_calls_turns_a_bad_call_into_an_error_the_model_reads(name, arguments, says):
    [_, result] = run_tool_calls(reply((name, arguments)), {"calculator": calculator})
    assert result["content"].startswith("error: ") and says in result["content"]


def test_run_tool_calls_reads_openai_objects_and_a_reply_without_calls():
    openai = pytest.importorskip("openai")
    from openai.types.chat import ChatCompletionMessage

    message = ChatCompletionMessage.model_validate(reply(("calculator", json.dumps({"expression": "6*7"}))))
    assert run_tool_calls(message, [calculator])[1]["content"] == "42"
    plain = ChatCompletionMessage(role="assistant", content="42")
    assert run_tool_calls(plain, [calculator]) == [{"role": "assistant", "content": "42"}]
    del openai
