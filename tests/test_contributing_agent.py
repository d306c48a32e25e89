"""CONTRIBUTING's agent section is a plugin that works as written: its blocks are copied out, the module is
registered, the config validates against the demonstrations, and the agent plays an episode through the
real agentic workflow (a scripted policy stands in for training)."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import tomllib
from pathlib import Path

import pytest

import rltk
from rltk.commands.cli import main
from tests.serve.helpers import ScriptedEngine, ensure_serve_builtins

CONTRIBUTING = Path(__file__).resolve().parents[1] / "CONTRIBUTING.md"
BLOCK = re.compile(r"<!-- agent-example: (\S+) -->\n```\w*\n(.*?)```", re.S)


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """CONTRIBUTING's files written into tmp_path, the plugin module imported and registered."""
    files = dict(BLOCK.findall(CONTRIBUTING.read_text()))
    assert set(files) == {"rltk_plugin_convert/__init__.py", "pyproject.toml", "convert.jsonl", "convert.yaml"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    spec = importlib.util.spec_from_file_location("rltk_plugin_convert", tmp_path / "rltk_plugin_convert/__init__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ensure_serve_builtins()
    rltk.register_plugin(module, name="rltk_plugin_convert")
    monkeypatch.chdir(tmp_path)  # the config names convert.jsonl relative to where rltk runs
    yield module
    rltk.unregister_plugin("rltk_plugin_convert")
    sys.modules.pop("rltk_plugin_convert", None)


def test_the_pyproject_points_its_entry_point_at_the_module(plugin, tmp_path):
    project = tomllib.loads((tmp_path / "pyproject.toml").read_text())
    assert project["project"]["entry-points"]["rltk"] == {"convert": "rltk_plugin_convert"}


def test_the_config_validates_and_the_agent_converts_through_its_tool(plugin, tmp_path, capsys):
    from rltk.config.loader import load_config
    from rltk.rollout.base import SamplingParams
    from rltk.training.scaffold.rows import build_rows
    from rltk.training.scaffold.setup import build_reward, build_tokenizer_and_policy
    from rltk.workflows.agentic import AgenticWorkflow

    assert main(["validate", "grpo", "--config", "convert.yaml"]) == 0
    assert "the first 2 warm-up examples fit the rollout" in capsys.readouterr().out  # 3 rows, 1 held out
    cfg = load_config([Path("convert.yaml")], [])
    tokenizer, _ = build_tokenizer_and_policy(cfg)
    rows, _ = build_rows(cfg, tokenizer)
    assert len(rows) == 2 and all(row["sft_messages"][1]["tool_calls"] for row in rows)

    def policy(prompt_text):  # calls the tool as the demonstrations do, then answers with its result
        if "<|tool|>" in prompt_text:
            return prompt_text.rsplit("<|tool|>", 1)[-1].split("<|eos|>")[0]
        value, source, target = re.findall(r"<\|user\|>(\d+) (\w+) to (\w+)<\|eos\|>", prompt_text)[-1]
        arguments = {"value": int(value), "from_unit": source, "to_unit": target}
        return '<tool_call>{"name": "convert", "arguments": %s}</tool_call>' % json.dumps(arguments)

    env = {"tools": list(cfg.env.tools), "max_turns": cfg.env.max_turns,
           "max_new_tokens_per_turn": cfg.env.max_new_tokens_per_turn}
    workflow = AgenticWorkflow(engine=ScriptedEngine(tokenizer, policy), tokenizer=tokenizer, reward=build_reward(cfg),
                               sampling=SamplingParams(n=2, max_new_tokens=cfg.rollout.max_new_tokens), env=env,
                               **dict(cfg.rollout.workflow_args))
    try:
        experiences = workflow.run(rows)
        metrics = workflow.metrics()
    finally:
        workflow.close()
    assert [e.score for e in experiences] == [1.0] * 4  # e.g. "3000", from convert(3, "km", "m")
    assert tokenizer.decode(experiences[0].prompt_ids) == rows[0]["prompt"]  # the warm-up's prompt, tools and all
    assert metrics["agentic/opening_mismatch"] == 0 and metrics["agent/calls"] == 1
    assert (metrics["rollout/tool_calls"], metrics["rollout/tool_results"], metrics["rollout/tool_errors"]) == (1, 1, 0)
    assert plugin.convert(value=3, from_unit="km", to_unit="m") == "3000"
    assert plugin.convert(value=25, from_unit="mm", to_unit="cm") == "2.5"
