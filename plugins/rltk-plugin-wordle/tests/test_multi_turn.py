"""Wordle through rltk's multi_turn workflow: a scripted episode by hand, then GRPO steps of the tiny model."""

import json
from pathlib import Path

import pytest

import rltk
from rltk.commands.cli import main
from rltk.models.tiny import build_char_tokenizer
from rltk.rewards.compose import build_reward_composer
from rltk.rollout.base import Completion, RolloutEngine, SamplingParams
from rltk.workflows.multi_turn import MultiTurnWorkflow
from rltk_plugin_wordle import wordle_task

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "wordle.yaml"

# The tiny template with a tool role of its own (tool results as "<|user|>tool:..." turns), so these
# tests do not depend on which roles the shipped tiny template knows.
TOOL_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' -%}<|user|>tool:{{ message['content'] }}<|eos|>"
    "{%- else -%}<|{{ message['role'] }}|>{{ message['content'] }}<|eos|>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)

CALL = '<tool_call>{"name": "wordle_candidates", "arguments": {"history": "slate --G-G"}}</tool_call>'


class ScriptedEngine(RolloutEngine):
    """Turn k of every episode is ``script[k]`` + eos, log-prob -0.5 per token; records what it was sent."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.calls = tokenizer, script, []

    def generate(self, prompt_ids, params):
        text = self.script[len(self.calls)]
        self.calls.append([list(p) for p in prompt_ids])
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        return [[Completion(i, list(ids), [-0.5] * len(ids), "stop") for _ in range(params.n)]
                for i in range(len(prompt_ids))]

    def update_weights(self, state_dict_or_model):
        pass


def test_scripted_episode_guess_tool_call_solve():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = TOOL_TEMPLATE
    engine = ScriptedEngine(tokenizer, ["slate", CALL, "crane"])
    workflow = MultiTurnWorkflow(
        engine=engine, tokenizer=tokenizer, reward=build_reward_composer(["exact_match"], timeout_s=None),
        sampling=SamplingParams(n=2, max_new_tokens=8),
        env={"environment": "wordle", "tools": ["wordle_candidates"], "max_turns": 6,
             "max_new_tokens_per_turn": 128, "max_total_tokens": 400})
    experiences = workflow.run([{"prompt": "wordle", "ground_truth": "crane", "extras": {}, "id": "w0"}])
    assert len(experiences) == 2 and len(engine.calls) == 3  # both episodes step in one engine call per turn
    exp = experiences[0]
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    turns, observations = _segments(exp.response_ids, exp.response_mask)
    assert [decode(t) for t in turns] == ["slate<|eos|>", CALL + "<|eos|>", "crane<|eos|>"]
    assert [decode(o) for o in observations] == [
        "<|user|>slate --G-G<|eos|><|assistant|>",          # the environment's marks
        "<|user|>tool:brave crane grape<|eos|><|assistant|>",  # the tool's answer, hand-derived in test_game
    ]
    # slate earns 2 greens of 5; the tool call is answered by the tool (no reward); crane the 3 others
    assert exp.turn_rewards == [(5, 0.4), (len(exp.response_ids) - 1, pytest.approx(0.6))]
    assert exp.score == pytest.approx(0.4 + 0.6 + 1.0)  # environment rewards + exact_match of the last turn
    assert exp.info["turns"] == 3 and exp.info["tool_calls"] == 1 and exp.info["tool_errors"] == 0
    assert exp.info["stop_reason"] == "done" and exp.info["env_info"][-1]["solved"] is True
    # token-in/token-out: the last engine call got exactly the prompt and everything before the last turn
    assert engine.calls[-1][0] == exp.prompt_ids + exp.response_ids[: -len(turns[-1])]
    metrics = workflow.metrics()
    assert metrics["rollout/env_reward_mean"] == pytest.approx(1.0)
    assert metrics["rollout/reward_fn_mean"] == 1.0 and metrics["rollout/turns_mean"] == 3.0


def _segments(ids, mask):
    """The policy's turns (mask 1) and the observations between them (mask 0), as id lists."""
    runs, current, flag = [], [], None
    for token, m in zip(ids, mask):
        if m != flag and current:
            runs.append((flag, current))
            current = []
        flag = m
        current.append(token)
    runs.append((flag, current))
    return [r for f, r in runs if f == 1], [r for f, r in runs if f == 0]


@pytest.fixture
def batches(monkeypatch):
    import rltk.training.updates.rl as rl

    seen = []
    estimate = rl.Estimator.__call__

    def recording(self, batch, strategy=None):
        advantages, returns = estimate(self, batch, strategy)
        seen.append({**{k: v.clone() for k, v in batch.items()}, "advantages": advantages, "returns": returns})
        return advantages, returns

    monkeypatch.setattr(rl.Estimator, "__call__", recording)
    return seen


@pytest.mark.slow  # two GRPO steps of the tiny model on Wordle episodes from the shipped config (~10 s)
def test_grpo_runs_the_shipped_config(tmp_path, batches):
    # rows as a file, so the test does not need an rltk with pluggable tasks (data.task=wordle)
    for split, name in (("train", "train.jsonl"), ("test", "eval.jsonl")):
        rows = wordle_task(split, 16 if split == "train" else 4, seed=0)
        (tmp_path / name).write_text("".join(json.dumps({"prompt": r["prompt"], "answer": r["ground_truth"]}) + "\n"
                                             for r in rows))
    run_dir = tmp_path / "run"
    assert main(["run", "grpo", "--config", str(CONFIG), f"output_dir={run_dir}",
                 f"data.path={tmp_path / 'train.jsonl'}", f"data.eval_path={tmp_path / 'eval.jsonl'}",
                 "trainer.total_steps=2", "trainer.prompts_per_step=2", "rollout.n=2", "trainer.eval_every=0",
                 "trainer.warmup_steps=0", "env.max_turns=3", "env.max_new_tokens_per_turn=8",
                 "env.max_total_tokens=60", "checkpoint.resume=never", "checkpoint.every=0",
                 "logging.logger=[jsonl]", "logging.plot=false"]) == 0
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl_lines = [m for m in lines if "rollout/turns_mean" in m]
    assert len(rl_lines) == 2 and len(batches) == 2
    for m, batch in zip(rl_lines, batches):
        assert 1.0 <= m["rollout/turns_mean"] <= 3.0 and m["rollout/env_errors"] == 0.0
        # per-turn rewards are multiples of 1/5 (new greens) or the invalid-guess penalty
        rewards = batch["token_rewards"][batch["token_rewards"] != 0]
        assert all(abs(r * 5 - round(r * 5)) < 1e-5 or abs(r + 0.1) < 1e-6 for r in rewards.tolist())
        assert batch["token_rewards"].sum(-1).sub(batch["scores"]).abs().max() < 1e-5
        assert (batch["advantages"] * (1 - batch["response_mask"])).abs().max() == 0
    assert rltk.get_component("environment", "wordle").__module__ == "rltk_plugin_wordle.game"
