from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rltk.config import RecipeSpec, apply_overrides, load_config, validate_config
from rltk.errors import ConfigError

from tests.waits import scaled

REPO = Path(__file__).resolve().parents[2]


def test_load_order_schema_preset_yaml_cli(tmp_path):
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("trainer:\n  lr: 1.0e-4\n  total_steps: 7\nalgorithm:\n  name: rloo\n")
    cfg = load_config([cfg_file], ["trainer.total_steps=9"])
    assert cfg.trainer.lr == 1e-4  # yaml over schema
    assert cfg.trainer.total_steps == 9  # cli over yaml
    assert cfg.algorithm.advantage_fn == "rloo"  # preset named in yaml over schema
    assert cfg.algorithm.kl_in == "reward"
    assert cfg.trainer.micro_batch_size == 32  # schema default


def test_user_setting_beats_preset():
    cfg = load_config([], ["algorithm.name=rloo", "algorithm.kl_in=loss"])
    assert cfg.algorithm.advantage_fn == "rloo" and cfg.algorithm.kl_in == "loss"


def test_swap_component_by_one_override():
    cfg = load_config([], ["algorithm.advantage_fn=rloo", "algorithm.kl_penalty_fn=k3"])
    assert cfg.algorithm.advantage_fn == "rloo"


def test_unknown_component_name_names_key_and_suggests():
    with pytest.raises(ConfigError) as info:
        load_config([], ["algorithm.advantage_fn=grop"])
    msg = str(info.value)
    assert "'algorithm.advantage_fn'" in msg and "'grop'" in msg and "'grpo'" in msg and "rloo" in msg


def test_unknown_key_is_an_error_with_suggestion(tmp_path):
    f = tmp_path / "typo.yaml"
    f.write_text("trainer:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError) as info:
        load_config([f])
    msg = str(info.value)
    assert str(f) in msg and "trainer.learning_rate" in msg and "Valid keys under 'trainer'" in msg


def test_component_args_checked_against_signature():
    with pytest.raises(ConfigError) as info:
        load_config([], ["algorithm.advantage_fn=grpo", "algorithm.advantage_fn_args.norm_by_sdt=false"])
    msg = str(info.value)
    assert "algorithm.advantage_fn_args.norm_by_sdt" in msg and "'norm_by_std'" in msg


def test_batch_fields_cannot_be_configured():
    with pytest.raises(ConfigError, match="filled in by rltk"):
        load_config([], ["algorithm.advantage_fn_args.scores=1"])


def test_plugin_component_selected_by_name():
    cfg = load_config([], ["algorithm.advantage_fn=group_rank"])
    assert cfg.algorithm.advantage_fn == "group_rank"


def test_list_component_args_and_weights():
    cfg = load_config([], [
        "reward.reward_fn=[exact_match,overlong_penalty]",
        "reward.reward_fn_args.overlong_penalty.max_length=16",
        "reward.weights.overlong_penalty=0.5",
    ])
    assert list(cfg.reward.reward_fn) == ["exact_match", "overlong_penalty"]
    with pytest.raises(ConfigError, match="'reward.weights.format_tags'.*not selected"):
        load_config([], ["reward.weights.format_tags=1.0"])
    with pytest.raises(ConfigError, match="reward.reward_fn_args.overlong_penalty"):
        load_config([], ["reward.reward_fn_args.overlong_penalty.max_length=16"])


def test_choices_and_ranges():
    with pytest.raises(ConfigError, match="'algorithm.kl_in'.*Valid: loss, reward"):
        load_config([], ["algorithm.kl_in=rewrd"])
    with pytest.raises(ConfigError, match="'rollout.temperature'"):
        load_config([], ["rollout.temperature=0"])
    with pytest.raises(ConfigError, match="mini_batches=3 must divide"):
        load_config([], ["trainer.mini_batches=3", "trainer.prompts_per_step=4", "rollout.n=4"])


def test_reward_timeout_and_workers():
    cfg = load_config([], [])
    assert cfg.reward.timeout_s == 5.0 and cfg.reward.workers == 4
    assert load_config([], ["reward.timeout_s=null", "reward.workers=1"]).reward.timeout_s is None
    with pytest.raises(ConfigError, match=r"bad value 0.0 for 'reward.timeout_s': must be > 0 seconds, or null"):
        load_config([], ["reward.timeout_s=0"])
    with pytest.raises(ConfigError, match=r"bad value 0 for 'reward.workers': must be >= 1"):
        load_config([], ["reward.workers=0"])


def test_type_errors_name_the_key():
    with pytest.raises(ConfigError, match="'abc'.*'trainer.lr'"):
        load_config([], ["trainer.lr=abc"])


def test_interpolation_env_and_arithmetic(monkeypatch):
    monkeypatch.setenv("RLTK_TEST_STEPS", "12")
    cfg = load_config([], [
        "trainer.total_steps=${oc.env:RLTK_TEST_STEPS,5}",
        "trainer.warmup_steps=${floordiv:${trainer.total_steps},4}",
        "rollout.max_new_tokens=${sub:${model.tiny.max_position_embeddings},100}",
        "name=exp1",
    ])
    assert cfg.trainer.total_steps == 12 and cfg.trainer.warmup_steps == 3
    assert cfg.rollout.max_new_tokens == 28
    assert cfg.output_dir == "runs/exp1"


def test_stage_overrides_are_validated():
    cfg = load_config([], [])
    staged = apply_overrides(cfg, {"trainer.lr": 0.5}, "stage")
    assert staged.trainer.lr == 0.5 and cfg.trainer.lr != 0.5
    with pytest.raises(ConfigError, match="unknown config key 'trainer.lrr'.*'trainer.lr'"):
        apply_overrides(cfg, {"trainer.lrr": 0.5}, "stage")
    bad = OmegaConf.merge(cfg, {"stages": [{"name": "warm", "type": "sft", "overrides": {"algorithm.loss_agg": "tok-mean"}}]})
    with pytest.raises(ConfigError, match="'algorithm.loss_agg'.*token-mean"):
        validate_config(bad)


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="key=value"):
        load_config([], ["algorithm.advantage_fn"])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config([tmp_path / "nope.yaml"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config([bad])


def test_every_shipped_config_validates():
    # Walk the whole tree: configs in sub-folders must be validated too.
    files = sorted((REPO / "recipes").rglob("*.yaml"))
    assert files, "no shipped configs found under recipes/"
    for f in files:
        load_config([f])


def test_swapping_a_component_drops_the_presets_arguments_for_it():
    cfg = load_config([], ["algorithm.name=dr_grpo"])
    assert cfg.algorithm.advantage_fn_args == {"norm_by_std": False}
    cfg = load_config([], ["algorithm.name=dr_grpo", "algorithm.advantage_fn=rloo"])
    assert cfg.algorithm.advantage_fn_args == {}
    assert cfg.algorithm.loss_agg == "seq-mean-token-sum-norm"  # the rest of the preset stays


def test_critic_section_checked_when_the_advantage_needs_values():
    with pytest.raises(ConfigError, match="'critic.lr'"):
        load_config([], ["algorithm.name=ppo", "critic.lr=-1"])
    load_config([], ["critic.lr=-1"])  # grpo has no critic: the section is not read


# ---------------------------------------------------------------- issue 10: first hour of a new user

def test_one_name_for_a_list_key_is_a_one_element_list(tmp_path):
    cfg = load_config([], ["reward.reward_fn=exact_match", "logging.logger=jsonl", "data.extras_keys=topic"])
    assert list(cfg.reward.reward_fn) == ["exact_match"] and list(cfg.logging.logger) == ["jsonl"]
    assert list(cfg.data.extras_keys) == ["topic"]
    f = tmp_path / "one.yaml"
    f.write_text("reward:\n  reward_fn: exact_match\n")
    assert list(load_config([f]).reward.reward_fn) == ["exact_match"]
    staged = apply_overrides(load_config(), {"logging.logger": "console"}, "stage")
    assert list(staged.logging.logger) == ["console"]
    # A wrong single name still gets the registry's message, not OmegaConf's.
    with pytest.raises(ConfigError, match="'reward.reward_fn'.*'exact_match'"):
        load_config([], ["reward.reward_fn=exact_mach"])


GRPO_RECIPE = RecipeSpec("grpo", batch_fields=frozenset({"token_rewards", "response_mask", "group_ids", "scores"}),
                         buffer_sources=frozenset({"policy"}),
                         others=(RecipeSpec("ppo", frozenset({"token_rewards", "response_mask", "values"})),))


def test_the_recipe_must_serve_the_advantage_estimators_fields():
    with pytest.raises(ConfigError) as info:
        load_config([], ["algorithm.name=ppo"], recipe=GRPO_RECIPE)
    msg = str(info.value)
    assert "'algorithm.advantage_fn'='gae'" in msg and "algorithm.name='ppo'" in msg and "'values'" in msg
    assert "`rltk run ppo`" in msg and "grpo, " in msg
    with pytest.raises(ConfigError, match="'algorithm.advantage_fn'='gae' needs"):  # chosen directly
        load_config([], ["algorithm.advantage_fn=gae"], recipe=GRPO_RECIPE)
    load_config([], ["algorithm.name=ppo"])  # no recipe known: not checked (a custom recipe may serve it)
    load_config([], ["algorithm.name=rloo"], recipe=GRPO_RECIPE)


def test_the_recipe_must_fill_the_buffer_sources_the_sample_strategy_reads():
    with pytest.raises(ConfigError) as info:
        load_config([], ["buffer.sample_strategy=mix_expert"], recipe=GRPO_RECIPE)
    assert "'buffer.sample_strategy'='mix_expert'" in str(info.value) and "'expert'" in str(info.value)
    # No expert share, nothing expert to read.
    load_config([], ["buffer.sample_strategy=mix_expert", "buffer.sample_strategy_args.expert_fraction=0"],
                recipe=GRPO_RECIPE)
    with_expert = RecipeSpec("mine", buffer_sources=frozenset({"policy", "demos"}))
    load_config([], ["buffer.sample_strategy=mix_expert", "buffer.sample_strategy_args.expert_source=demos"],
                recipe=with_expert)


def test_shipped_recipes_declare_what_they_serve():
    from rltk.recipe_tools.validation import shipped_recipe_spec

    grpo, ppo = shipped_recipe_spec("grpo"), shipped_recipe_spec("ppo")
    assert "values" not in grpo.batch_fields and "values" in ppo.batch_fields
    assert grpo.buffer_sources == ppo.buffer_sources == {"policy"}
    # dpo, sft, reward_model declare no PROVIDES: never suggested
    assert [r.name for r in grpo.others] == ["distill", "ppo"]
    load_config([REPO / "recipes" / "configs" / "ppo.yaml"], recipe=ppo)
    # the distillation advantage needs the teacher's log-probs: only the distill recipe serves them
    with pytest.raises(ConfigError, match="Use `rltk run distill`"):
        load_config([], ["algorithm.advantage_fn=on_policy_distill"], recipe=grpo)


def test_critic_checks_live_in_config_and_follow_the_recipe():
    import subprocess
    import sys

    # Config is the lowest layer: validating never imports training code.
    code = ("import sys; from rltk.config import load_config; load_config([], ['algorithm.name=ppo']); "
            "print([m for m in sys.modules if m.startswith('rltk.training')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(120))
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
    # A recipe with a critic reads the critic section whatever the estimator.
    ppo = RecipeSpec("ppo", batch_fields=frozenset({"values", "token_rewards", "response_mask", "group_ids", "scores"}))
    with pytest.raises(ConfigError, match="'critic.lr'"):
        load_config([], ["critic.lr=-1", "algorithm.name=rloo"], recipe=ppo)


def test_seed_range_and_paths(tmp_path):
    load_config([], ["seed=4294967295"])
    for bad in ("-1", "4294967296"):
        with pytest.raises(ConfigError, match=rf"bad value {bad} for 'seed'.*\[0, 2\*\*32 - 1"):
            load_config([], [f"seed={bad}"])
    model = tmp_path / "model"
    model.mkdir()
    with pytest.raises(ConfigError, match="'model.path'.*no config.json"):
        load_config([], [f"model.path={model}"])
    (model / "config.json").write_text("{}")
    load_config([], [f"model.path={model}"])
    with pytest.raises(ConfigError, match="'model.path'.*is a file"):
        load_config([], [f"model.path={model / 'config.json'}"])
    with pytest.raises(ConfigError, match="'data.path'.*no such file"):
        load_config([], [f"data.path={tmp_path / 'train.jsonl'}"])
    with pytest.raises(ConfigError, match="'critic.model_path'"):
        load_config([], ["algorithm.name=ppo", f"critic.model_path={tmp_path / 'critic'}"])


def test_kl_settings_without_kl_coef_warn(capsys):
    load_config([], ["algorithm.kl_penalty_fn=k2", "algorithm.kl_controller=adaptive"])
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "algorithm.kl_penalty_fn=k2 (command line)" in err[0]
    assert "algorithm.kl_controller=adaptive" in err[0] and "algorithm.kl_coef is 0 (from the default)" in err[0]
    load_config([], ["algorithm.name=rloo"])  # a preset that puts the KL in the reward
    assert "KL in the reward of algorithm.name=rloo" in capsys.readouterr().err
    load_config([], ["algorithm.name=rloo", "algorithm.kl_coef=0.02"])
    load_config([], ["algorithm.kl_penalty_fn=k2", "algorithm.kl_penalty_fn=k2"], warn=False)
    load_config([], ["algorithm.kl_penalty_fn=k2",  # an RL stage with its own coefficient uses it
                     "stages=[{name: rl, type: rl, overrides: {algorithm.kl_coef: 0.1}}]"])
    load_config([REPO / "recipes" / "configs" / "grpo.yaml"])  # the default run sets no KL key
    assert capsys.readouterr().err == ""


def test_token_budget_keys():
    cfg = load_config([], [])
    assert cfg.trainer.max_tokens_per_micro_batch is None and cfg.trainer.pack_sequences is False
    cfg = load_config([], ["rollout.max_new_tokens=64", "trainer.max_tokens_per_micro_batch=65",
                           "trainer.pack_sequences=true"])
    assert cfg.trainer.max_tokens_per_micro_batch == 65 and cfg.trainer.pack_sequences is True
    with pytest.raises(ConfigError, match=r"bad value 64 for 'trainer.max_tokens_per_micro_batch': must be null .* "
                                          r"above rollout.max_new_tokens=64"):
        load_config([], ["rollout.max_new_tokens=64", "trainer.max_tokens_per_micro_batch=64"])
    with pytest.raises(ConfigError, match="trainer.pack_sequences"):
        load_config([], ["trainer.pack_sequences=maybe"])
