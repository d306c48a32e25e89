"""Workflow ``verifiers``: environments of the `verifiers` package, written here (no Hub download), run
their own rollout and rubric against rltk's endpoint (issue 31, item 1)."""

from __future__ import annotations

import re
import sys
import textwrap

import pytest

from rltk.data.loading import format_prompts
from rltk.environments.verifiers_envs import import_verifiers, verifiers_task
from rltk.errors import ConfigError
from rltk.models.tiny import build_char_tokenizer
from rltk.rollout.base import SamplingParams
from tests.serve.helpers import ScriptedEngine

from rltk.workflows.verifiers_workflow import VerifiersWorkflow


def _has_verifiers() -> bool:
    try:
        import verifiers.legacy  # noqa: F401
    except ImportError:
        return False
    return True


needs_verifiers = pytest.mark.skipif(not _has_verifiers(),
                                     reason="the verifiers extra (pip install 'rltk[verifiers]') is not installed")

SINGLE_TURN = '''
import verifiers.legacy as vf
from datasets import Dataset

def correct(completion, answer) -> float:
    return float(completion[-1].content.strip() == answer)

def short(completion) -> float:
    return float(len(completion[-1].content) <= 2)

def length(completion) -> float:
    return float(len(completion[-1].content))

def load_environment(count=4):
    rows = [{"question": f"{a}+{a + 1}=", "answer": str(2 * a + 1)} for a in range(count)]
    # two reward functions (weights 1 and 0.5) and a metric (weight 0)
    rubric = vf.Rubric(funcs=[correct, short, length], weights=[1.0, 0.5, 0.0])
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), system_prompt="add", rubric=rubric)
'''

TOOL = '''
import asyncio
import verifiers.legacy as vf
from datasets import Dataset

CALLS = []
DELAY_S = [0.0]

async def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: the first
        b: the second
    """
    CALLS.append((a, b))
    await asyncio.sleep(DELAY_S[0])
    return a + b

def correct(completion, answer) -> float:
    return float(completion[-1].content.strip() == answer)

def load_environment(count=2):
    rows = [{"question": f"{a}+{a + 1}=", "answer": str(2 * a + 1)} for a in range(1, count + 1)]
    return vf.ToolEnv(dataset=Dataset.from_list(rows), tools=[add], max_turns=3, rubric=vf.Rubric(funcs=[correct]))
'''


@pytest.fixture
def envs(tmp_path, monkeypatch):
    """The two environments as installed modules (importable by name, as `prime env install` leaves them)."""
    (tmp_path / "vf_test_sum.py").write_text(textwrap.dedent(SINGLE_TURN))
    (tmp_path / "vf_test_tool.py").write_text(textwrap.dedent(TOOL))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("vf_test_sum", "vf_test_tool"):
        sys.modules.pop(name, None)


def sums_right_for_even(text: str) -> str:
    """A scripted policy: the right sum when the first addend is even, else 999."""
    a, b = re.findall(r"(\d+)\+(\d+)=", text)[-1]
    return str(int(a) + int(b)) if int(a) % 2 == 0 else "999"


def calls_add_then_copies_the_result(text: str) -> str:
    if text.rsplit("<|eos|>", 2)[-2].rfind("<|tool|>") >= 0:  # the last message is the tool's answer
        return text.rsplit("<|tool|>", 1)[-1].split("<|eos|>")[0]
    a, b = re.findall(r"(\d+)\+(\d+)=", text)[-1]
    return '<tool_call>{"name": "add", "arguments": {"a": %s, "b": %s}}</tool_call>' % (a, b)


@needs_verifiers
def test_a_single_turn_env_is_scored_by_its_rubric_on_the_policys_own_tokens(envs):
    tokenizer = build_char_tokenizer()
    engine = ScriptedEngine(tokenizer, sums_right_for_even)
    rows = format_prompts(verifiers_task("train", 4, 0, env_id="vf_test_sum"), tokenizer, use_chat_template=True)
    workflow = VerifiersWorkflow(engine=engine, tokenizer=tokenizer, reward=None, env_id="vf_test_sum",
                                 sampling=SamplingParams(n=2, max_new_tokens=10))
    try:
        experiences = workflow.run(rows)
        assert len(experiences) == 8 and len(engine.calls) == 1  # all 8 episodes' requests in one engine call
        for e in experiences:
            a = int(re.findall(r"(\d+)\+", e.info["prompt"])[-1])
            right = a % 2 == 0
            answer = str(2 * a + 1) if right else "999"
            # the rubric by hand: correct (weight 1) + short (weight 0.5); length is a metric (weight 0)
            assert e.score == (1.5 if right else 0.0)
            assert e.reward_details == {"correct": float(right), "short": float(right), "length": float(len(answer)),
                                        "num_turns": 1.0}
            # the env's prompt (its system prompt included) as the template renders it, and the sampled ids
            opening = f"<|system|>add<|eos|><|user|>{a}+{a + 1}=<|eos|><|assistant|>"
            assert e.prompt_ids == tokenizer(opening, add_special_tokens=False)["input_ids"]
            assert e.response_ids == tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            assert e.response_mask == [1] * len(e.response_ids)
            assert e.rollout_logprobs == [-(i + 1) / 10 for i in range(len(e.response_ids))]  # the engine's own
        groups = {}
        for e in experiences:
            groups.setdefault(e.group_id, set()).add(e.info["row_id"])
        assert len(groups) == 4 and all(len(ids) == 1 for ids in groups.values())
        assert workflow.reward.names == ["correct", "short"]  # gdpo's columns: the reward functions, not metrics
        metrics = workflow.metrics()
        assert metrics["reward/correct"] == 0.5 and metrics["reward/length"] == 2.0
        assert metrics["agentic/opening_mismatch"] == 0.0  # the task's rows open as the env does
    finally:
        workflow.close()


@needs_verifiers
def test_rltk_rows_are_played_by_the_env_with_their_ground_truth_as_answer(envs):
    tokenizer = build_char_tokenizer()
    engine = ScriptedEngine(tokenizer, sums_right_for_even)
    # as rltk's synthetic tasks make them: extras["task"] names the task (verifiers would route on it)
    rows = [{"id": "q", "prompt": "4+5=", "ground_truth": "9", "extras": {"task": "arithmetic", "a": 4}},
            {"id": "r", "prompt": "4+5=", "ground_truth": "8", "extras": {"task": "arithmetic", "a": 4}}]
    workflow = VerifiersWorkflow(engine=engine, tokenizer=tokenizer, reward=None, env_id="vf_test_sum",
                                 sampling=SamplingParams(n=1, max_new_tokens=10))
    try:
        experiences = workflow.run(rows)
        assert [e.score for e in experiences] == [1.5, 0.5]  # "9" is right for q only; short for both
        assert tokenizer.decode(experiences[0].prompt_ids) == "<|user|>4+5=<|eos|><|assistant|>"
    finally:
        workflow.close()


@needs_verifiers
def test_a_tool_env_stays_one_trajectory_with_its_tool_results_masked(envs):
    import vf_test_tool

    tokenizer = build_char_tokenizer(tool_role=True)
    engine = ScriptedEngine(tokenizer, calls_add_then_copies_the_result)
    rows = format_prompts(verifiers_task("train", 2, 0, env_id="vf_test_tool"), tokenizer, use_chat_template=True)
    workflow = VerifiersWorkflow(engine=engine, tokenizer=tokenizer, reward=None, env_id="vf_test_tool",
                                 sampling=SamplingParams(n=2, max_new_tokens=100), env={"max_new_tokens_per_turn": 100})
    try:
        experiences = workflow.run(rows)
        assert sorted(vf_test_tool.CALLS) == [(1, 2), (1, 2), (2, 3), (2, 3)]  # the env ran its own tool
        assert len(engine.calls) == 2  # two turns, each of all 4 episodes in one engine call
        for e in experiences:
            a = int(re.findall(r"(\d+)\+", e.info["prompt"])[-1])
            result = str(2 * a + 1)
            assert e.score == 1.0
            assert e.reward_details["correct"] == 1.0 and e.reward_details["total_tool_calls"] == 1.0
            assert e.info["segments"] == 1 and e.info["requests"] == 2
            call = '<tool_call>{"name": "add", "arguments": {"a": %d, "b": %d}}</tool_call>' % (a, a + 1)
            transcript = f"{call}<|eos|><|tool|>{result}<|eos|><|assistant|>{result}<|eos|>"
            assert tokenizer.decode(e.response_ids) == transcript
            # only the tool's message and the next generation prompt are the env's; the rest is sampled
            inserted = tokenizer(f"<|tool|>{result}<|eos|><|assistant|>", add_special_tokens=False)["input_ids"]
            zeros = [i for i, m in enumerate(e.response_mask) if m == 0]
            assert [e.response_ids[i] for i in zeros] == inserted
            assert zeros == list(range(zeros[0], zeros[0] + len(inserted)))
        metrics = workflow.metrics()
        assert metrics["rollout/tool_calls"] == 1.0 and metrics["rollout/tool_results"] == 1.0
    finally:
        workflow.close()


@needs_verifiers
def test_an_episode_past_its_timeout_is_dropped_and_a_step_with_none_left_names_the_wait(envs):
    import vf_test_tool

    vf_test_tool.DELAY_S[0] = 30.0  # the tool hangs; the episode timeout ends it
    tokenizer = build_char_tokenizer(tool_role=True)
    engine = ScriptedEngine(tokenizer, calls_add_then_copies_the_result)
    rows = format_prompts(verifiers_task("train", 1, 0, env_id="vf_test_tool"), tokenizer, use_chat_template=True)
    workflow = VerifiersWorkflow(engine=engine, tokenizer=tokenizer, reward=None, env_id="vf_test_tool",
                                 episode_timeout_s=0.5, sampling=SamplingParams(n=2, max_new_tokens=100),
                                 env={"max_new_tokens_per_turn": 100})
    try:
        waited = r"did not finish in 0.5 s \(rollout.workflow_args.episode_timeout_s\)"
        with pytest.raises(RuntimeError, match=r"(?s)verifiers: all 2 episodes .*" + waited):
            workflow.run(rows)
    finally:
        vf_test_tool.DELAY_S[0] = 0.0
        workflow.close()


@needs_verifiers
def test_a_bad_env_id_names_the_key_and_how_to_list_installed_envs(envs):
    tokenizer = build_char_tokenizer()
    with pytest.raises(ConfigError, match=r"'rollout\.workflow_args\.env_id'.*no module 'no_such_env'.*pip list"):
        VerifiersWorkflow(engine=None, tokenizer=tokenizer, reward=None, env_id="owner/no-such-env",
                          sampling=SamplingParams())
    with pytest.raises(ConfigError, match=r"'data\.task_args\.env_id' must name an installed verifiers environment"):
        verifiers_task("train", 1, 0)
    with pytest.raises(ConfigError, match=r"has no load_environment\(\)"):
        VerifiersWorkflow(engine=None, tokenizer=tokenizer, reward=None, env_id="textwrap", sampling=SamplingParams())
    with pytest.raises(ConfigError, match=r"'rollout\.workflow_args\.env_args'.*unexpected keyword"):
        VerifiersWorkflow(engine=None, tokenizer=tokenizer, reward=None, env_id="vf_test_sum",
                          env_args={"colour": 1}, sampling=SamplingParams())


def test_without_verifiers_installed_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers", None)  # `import verifiers` raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'rltk\[verifiers\]'"):
        import_verifiers()


# ------------------------------------------------------------------ from the command line

TINY = ["sft.steps=2", "sft.warmup_steps=0", "sft.stop_at_accuracy=null", "trainer.total_steps=2",
        "trainer.warmup_steps=0", "trainer.eval_every=0", "data.train_size=4", "data.eval_size=2",
        "trainer.prompts_per_step=2", "rollout.n=2", "checkpoint.resume=never", "checkpoint.every=0",
        "logging.logger=[jsonl]", "logging.plot=false", "rollout.max_new_tokens=4", "data.use_chat_template=true",
        "data.max_prompt_tokens=32", "rollout.workflow=verifiers"]


@needs_verifiers
def test_cli_exits_2_naming_the_key_for_an_env_that_is_not_installed(tmp_path, capsys, envs):
    from rltk.commands.cli import main

    assert main(["run", "grpo", f"output_dir={tmp_path / 'a'}", *TINY,
                 "rollout.workflow_args.env_id=no_such_env"]) == 2
    err = capsys.readouterr().err
    assert "'rollout.workflow_args.env_id': no module 'no_such_env' is installed" in err and "Traceback" not in err


@needs_verifiers
@pytest.mark.slow  # two warm-up steps and two GDPO steps of the tiny model on the env's own rows (~15 s)
def test_gdpo_trains_on_a_verifiers_env_through_the_recipe(tmp_path, envs):
    import json

    from rltk.commands.cli import main

    run_dir = tmp_path / "run"
    config = tmp_path / "verifiers.yaml"  # a file of its own: the grpo default's data.task_args are arithmetic's
    config.write_text("data:\n  task: verifiers\n  task_args: {env_id: vf_test_sum, env_args: {count: 6}}\n")
    assert main(["run", "grpo", "--config", str(config), f"output_dir={run_dir}", *TINY,
                 "rollout.workflow_args.env_id=vf_test_sum",
                 "algorithm.advantage_fn=gdpo"]) == 0  # gdpo's columns: the rubric's correct and short
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl_lines = [m for m in lines if "agentic/episodes" in m]
    assert len(rl_lines) == 2
    for m in rl_lines:
        # an episode whose completion is empty text is one verifiers refuses (EmptyModelResponseError): dropped
        assert m["agentic/episodes"] == 4.0 and m["agentic/agent_errors"] < 4.0
        assert {"reward/correct", "reward/short", "reward/length"} <= set(m)
