"""A preset switched on the command line warns about each YAML algorithm setting that still overrides it."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rltk.commands.cli import main
from rltk.config.loader import load_config

REPO = Path(__file__).resolve().parents[2]
GRPO_YAML = REPO / "recipes" / "configs" / "grpo.yaml"


def warnings_of(capsys, files, overrides) -> list[str]:
    cfg = load_config(files, overrides)
    lines = capsys.readouterr().err.splitlines()
    assert all(line.startswith("rltk: warning: ") for line in lines), lines
    return cfg, [line for line in lines if "on the command line replaces" in line]


def yaml(tmp_path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_dapo_over_the_grpo_yaml_names_the_kl_coef_and_how_to_follow_the_preset(capsys):
    cfg, lines = warnings_of(capsys, [GRPO_YAML], ["algorithm.name=dapo"])
    assert cfg.algorithm.kl_coef == 0.05  # the precedence is unchanged: the YAML still wins
    assert len(lines) == 1
    assert f"replaces preset 'grpo' (named in {GRPO_YAML})" in lines[0]
    assert "algorithm.kl_coef=0.05 ('dapo': 0.0)" in lines[0]
    assert lines[0].endswith("To follow the preset, add algorithm.kl_coef=0.0 to the command line")
    # following the advice silences it and gives the preset's value
    cfg, lines = warnings_of(capsys, [GRPO_YAML], ["algorithm.name=dapo", "algorithm.kl_coef=0.0"])
    assert lines == [] and cfg.algorithm.kl_coef == 0.0


def test_every_overridden_key_in_one_line_nested_arguments_and_booleans_included(tmp_path, capsys):
    path = yaml(tmp_path, """
algorithm:
  name: grpo
  kl_coef: 0.02
  dynamic_sampling: false
  entropy_coef: 0.01           # not set by the preset: nothing to report
  policy_loss_args: {clip_eps_low: 0.2, clip_eps_high: 0.25}   # low equals DAPO's, high does not
""")
    _, lines = warnings_of(capsys, [path], ["algorithm.name=dapo"])
    assert len(lines) == 1
    line = lines[0]
    for part in ("algorithm.kl_coef=0.02 ('dapo': 0.0)", "algorithm.dynamic_sampling=false ('dapo': true)",
                 "algorithm.policy_loss_args.clip_eps_high=0.25 ('dapo': 0.28)"):
        assert part in line, line
    assert "entropy_coef" not in line and "clip_eps_low" not in line
    # in the preset's order
    assert line.endswith("add algorithm.policy_loss_args.clip_eps_high=0.28 algorithm.kl_coef=0.0 "
                         "algorithm.dynamic_sampling=true to the command line")


def test_a_component_the_yaml_pins_is_reported_and_its_dropped_arguments_are_not(tmp_path, capsys):
    path = yaml(tmp_path, "algorithm: {name: grpo, advantage_fn: grpo, advantage_fn_args: {norm_by_std: true}}\n")
    _, lines = warnings_of(capsys, [path], ["algorithm.name=reinforce_plus_plus", "algorithm.kl_coef=0.01"])
    assert len(lines) == 1
    assert "algorithm.advantage_fn=grpo ('reinforce_plus_plus': reinforce_plus_plus)" in lines[0]
    assert "advantage_fn_args" not in lines[0]


def test_a_yaml_without_a_name_was_written_against_the_default_preset(tmp_path, capsys):
    path = yaml(tmp_path, "algorithm: {kl_coef: 0.05}\n")
    _, lines = warnings_of(capsys, [path], ["algorithm.name=gpg"])
    assert len(lines) == 1 and "replaces the default preset 'grpo', which the YAML leaves in place" in lines[0]
    assert "algorithm.kl_coef=0.05 ('gpg': 0.0)" in lines[0]


def test_with_several_files_each_key_names_its_file(tmp_path, capsys):
    first = yaml(tmp_path, "algorithm: {name: grpo, kl_coef: 0.05}\n")
    second = tmp_path / "more.yaml"
    second.write_text("algorithm: {dynamic_sampling: false}\n")
    _, lines = warnings_of(capsys, [first, second], ["algorithm.name=dapo"])
    assert f"algorithm.kl_coef=0.05 ('dapo': 0.0) from {first}" in lines[0]
    assert f"algorithm.dynamic_sampling=false ('dapo': true) from {second}" in lines[0]


@pytest.mark.parametrize("files,overrides", [
    ([GRPO_YAML], []),                                           # no switch
    ([GRPO_YAML], ["algorithm.name=grpo"]),                      # the YAML's own preset
    ([GRPO_YAML], ["algorithm.name=rloo"]),                      # grpo.yaml sets nothing rloo sets
    ([], ["algorithm.name=dapo", "algorithm.kl_coef=0.05"]),     # no YAML: the command line is explicit
    ([GRPO_YAML], ["algorithm.name=dapo", "algorithm.kl_coef=0.05"]),  # the key chosen on the command line too
])
def test_no_warning_when_nothing_the_preset_sets_is_overridden_by_a_file(files, overrides, capsys):
    _, lines = warnings_of(capsys, files, overrides)
    assert lines == []


def test_a_switch_inside_the_yaml_is_the_user_choosing_both(tmp_path, capsys):
    path = yaml(tmp_path, "algorithm: {name: dapo, kl_coef: 0.05}\n")
    _, lines = warnings_of(capsys, [path], [])
    assert lines == []


def test_rltk_validate_prints_it_for_a_recipe(capsys):
    assert main(["validate", "grpo", "algorithm.name=dapo"]) == 0
    err = capsys.readouterr().err
    assert "rltk: warning: algorithm.name=dapo on the command line replaces preset 'grpo'" in err
    assert "add algorithm.kl_coef=0.0 to the command line" in err


def test_no_warning_when_asked_for_none(capsys):
    cfg = load_config([GRPO_YAML], ["algorithm.name=dapo"], warn=False)
    assert capsys.readouterr().err == "" and OmegaConf.select(cfg, "algorithm.name") == "dapo"
