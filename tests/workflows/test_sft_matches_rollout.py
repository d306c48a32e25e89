"""The warm-up teaches exactly the token stream a multi_turn rollout produces.

For each demonstration of the multi-turn tasks, an engine that writes the
demonstration's assistant turns drives the real ``multi_turn`` workflow (with
the real calculator tool or the guess_number environment). The episode's ids
and policy mask must equal :func:`rltk.data.chat.tokenize_transcript`'s
tokens and loss mask: the SFT stage trains on the same tokens, under the same
mask, that RL later samples and scores.
"""

import pytest

from rltk.data.chat import render_text, tokenize_transcript
from rltk.data.loading import format_prompts
from rltk.data.multi_turn_tasks import calculator_arithmetic, guess_number
from rltk.models.tiny import build_char_tokenizer
from rltk.registry import get_registry
from rltk.rollout.base import SamplingParams
from rltk.workflows.multi_turn import MultiTurnWorkflow
from tests.builtin_plugins import ensure_registered
from tests.workflows.multi_turn_helpers import ScriptedEngine


@pytest.fixture(autouse=True)
def builtins():
    ensure_registered("tools", "tool_parsers", "multi_turn", "tasks", "guess_number")


def replay(tokenizer, transcript):
    """An engine script writing the transcript's assistant turns, as the template renders them, in order."""
    turns = [render_text(tokenizer, [m], add_generation_prompt=False)[len("<|assistant|>"):-len("<|eos|>")] for m in transcript if m["role"] == "assistant"]
    return lambda prompt_ids, call: turns[call]


@pytest.mark.parametrize("task, env", [
    (calculator_arithmetic, {"tools": ["calculator"], "max_turns": 3}),
    (guess_number, {"environment": "guess_number", "max_turns": 5}),
])
def test_rollout_ids_and_mask_equal_the_tokenized_demonstration(task, env):
    tokenizer = build_char_tokenizer(tool_role=bool(env.get("tools")))
    tools = [get_registry().entry("tool", name).obj.schema() for name in env.get("tools", [])]
    rows = format_prompts(task("train", 12, 0), tokenizer, use_chat_template=True, tools=tools,
                          max_prompt_tokens=None)
    for row in rows:
        prompt, response, mask = tokenize_transcript(row["sft_messages"], tokenizer, tools=tools)
        workflow = MultiTurnWorkflow(engine=ScriptedEngine(tokenizer, replay(tokenizer, row["sft_messages"])),
                                     tokenizer=tokenizer, reward=lambda **sample: 0.0,
                                     sampling=SamplingParams(n=1, max_new_tokens=100), env=env)
        (episode,) = workflow.run([row])
        assert episode.prompt_ids == prompt
        assert episode.response_ids == response
        assert episode.response_mask == mask
        assert episode.info["stop_reason"] in ("answered", "done") and episode.info["tool_errors"] == 0
        assert tokenizer.decode(prompt, skip_special_tokens=False) == row["prompt"]  # the data's prompt text too
