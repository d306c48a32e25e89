"""What a recipe and its workflow cannot serve is a config error before anything loads: a preset or
estimator needing a critic or a greedy baseline, expert data nothing fills or nothing reads."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

import rltk
from rltk.commands.cli import main
from rltk.config import load_config
from rltk.errors import ConfigError
from rltk.recipe_tools.validation import shipped_recipe_spec
from rltk.workflows.base import Workflow

REPO = Path(__file__).resolve().parents[2]
GRPO = shipped_recipe_spec("grpo")
PPO = shipped_recipe_spec("ppo")


def test_shipped_recipes_load_expert_data_and_serve_baseline_scores():
    assert GRPO.expert_data and PPO.expert_data
    assert "baseline_scores" in GRPO.batch_fields and "baseline_scores" in PPO.batch_fields


@pytest.mark.parametrize("overrides", [["algorithm.name=ppo"], ["algorithm.advantage_fn=gae"]])
def test_a_critic_estimator_under_the_grpo_recipe_exits_2_before_any_model_loads(overrides, tmp_path, capsys):
    for command in ("validate", "run"):
        assert main([command, "grpo", f"output_dir={tmp_path / 'run'}", *overrides]) == 2
        err = capsys.readouterr().err
        assert "rltk: error: 'algorithm.advantage_fn'='gae'" in err and "`rltk run ppo`" in err
        assert "Traceback" not in err
    assert not (tmp_path / "run").exists()


class NoBaselineWorkflow(Workflow):
    """A workflow whose run() cannot add a greedy baseline."""

    def __init__(self, *, engine, tokenizer, reward, sampling):
        pass

    def run(self, rows):
        return []


@pytest.fixture
def no_baseline_workflow():
    plugin = types.ModuleType("no_baseline_workflow")
    plugin.rltk_workflows = rltk.hookimpl(lambda: {"no_baseline": NoBaselineWorkflow})
    rltk.register_plugin(plugin, name="no_baseline_workflow")
    yield
    rltk.unregister_plugin("no_baseline_workflow")


def test_remax_needs_a_workflow_that_can_add_a_greedy_baseline(no_baseline_workflow):
    load_config([], ["algorithm.name=remax"], recipe=GRPO)  # single_turn can
    with pytest.raises(ConfigError) as info:
        load_config([], ["algorithm.name=remax", "rollout.workflow=no_baseline"], recipe=GRPO)
    msg = str(info.value)
    assert "'algorithm.advantage_fn'='remax' needs batch field 'baseline_scores'" in msg
    assert "'rollout.workflow'='no_baseline'" in msg and "greedy_baseline" in msg
    load_config([], ["algorithm.name=grpo", "rollout.workflow=no_baseline"], recipe=GRPO)  # grpo does not need it


def test_mix_expert_needs_buffer_expert_path_and_the_path_needs_a_reader(tmp_path):
    expert = tmp_path / "expert.jsonl"
    expert.write_text('{"prompt": "1+2=", "response": "3", "answer": "3"}\n')
    with pytest.raises(ConfigError, match=r"reads experiences of buffer source\(s\) 'expert'.*set "
                                          r"buffer.expert.path=<"):
        load_config([], ["buffer.sample_strategy=mix_expert"], recipe=GRPO)
    cfg = load_config([], ["buffer.sample_strategy=mix_expert", f"buffer.expert.path={expert}"], recipe=GRPO)
    assert cfg.buffer.expert.source == "expert"
    # a source name of one's own, on both sides
    load_config([], ["buffer.sample_strategy=mix_expert", "buffer.sample_strategy_args.expert_source=demos",
                     f"buffer.expert.path={expert}", "buffer.expert.source=demos"], recipe=PPO)
    with pytest.raises(ConfigError, match=r"'buffer.expert.source'='expert' .* is not the source "
                                          r"'buffer.sample_strategy'='mix_expert' reads \('demos'\): set "
                                          r"buffer.expert.source='demos'"):
        load_config([], ["buffer.sample_strategy=mix_expert", "buffer.sample_strategy_args.expert_source=demos",
                         f"buffer.expert.path={expert}"], recipe=GRPO)
    # expert data that nothing would read
    with pytest.raises(ConfigError, match=r"'buffer.sample_strategy'='on_policy' never reads that source.*"
                                          r"buffer.sample_strategy=mix_expert"):
        load_config([], [f"buffer.expert.path={expert}"], recipe=GRPO)
    # a recipe that does not load expert data
    plain = type(GRPO)("mine", GRPO.batch_fields, GRPO.buffer_sources, (GRPO,), expert_data=False)
    with pytest.raises(ConfigError, match=r"recipe 'mine' does not load expert data.*recipes that do: grpo"):
        load_config([], ["buffer.sample_strategy=mix_expert", f"buffer.expert.path={expert}"], recipe=plain)
    with pytest.raises(ConfigError, match=r"bad value '.*missing.jsonl' for 'buffer.expert.path': no such file"):
        load_config([], ["buffer.sample_strategy=mix_expert", f"buffer.expert.path={tmp_path / 'missing.jsonl'}"])
    with pytest.raises(ConfigError, match=r"bad value 'policy' for 'buffer.expert.source'"):
        load_config([], ["buffer.expert.source=policy"])


def test_dynamic_sampling_keys():
    cfg = load_config([], ["algorithm.name=dapo"], recipe=GRPO)
    assert cfg.algorithm.dynamic_sampling is True and cfg.algorithm.dynamic_sampling_max_rounds == 8
    assert load_config([], ["algorithm.name=grpo"]).algorithm.dynamic_sampling is False
    # the user's word beats the preset's
    assert load_config([], ["algorithm.name=dapo", "algorithm.dynamic_sampling=false"]).algorithm.dynamic_sampling \
        is False
    with pytest.raises(ConfigError, match=r"bad value 0 for 'algorithm.dynamic_sampling_max_rounds': must be >= 1"):
        load_config([], ["algorithm.name=dapo", "algorithm.dynamic_sampling_max_rounds=0"])


def test_gdpo_weights_one_per_reward_function_and_no_fixed_expert_score(tmp_path):
    two = ["algorithm.advantage_fn=gdpo", "reward.reward_fn=[exact_match,format_tags]"]
    cfg = load_config([], [*two, "algorithm.advantage_fn_args.reward_weights=[1.0,0.5]"])
    assert list(cfg.algorithm.advantage_fn_args.reward_weights) == [1.0, 0.5]
    with pytest.raises(ConfigError, match=r"'algorithm.advantage_fn_args.reward_weights'.*reward.reward_fn "
                                          r"\['exact_match', 'format_tags'\].*list of 2 numbers"):
        load_config([], [*two, "algorithm.advantage_fn_args.reward_weights=[1.0]"])
    expert = tmp_path / "expert.jsonl"
    expert.write_text('{"prompt": "1+1=", "response": "2", "answer": "2"}\n')
    with_expert = [*two, f"buffer.expert.path={expert}", "buffer.sample_strategy=mix_expert"]
    load_config([], with_expert)  # scored by the reward functions: one column each
    with pytest.raises(ConfigError, match=r"'buffer.expert.score'=1.0 .*unset buffer.expert.score"):
        load_config([], [*with_expert, "buffer.expert.score=1.0"])
    load_config([], ["buffer.expert.score=1.0", f"buffer.expert.path={expert}",  # other estimators: fine
                     "buffer.sample_strategy=mix_expert"])
