import subprocess
import sys
from pathlib import Path

import pytest

from rltk.commands.cli import main, shipped_recipes

from tests.waits import scaled

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args, env=None):
    return subprocess.run(["rltk", *args], capture_output=True, text=True, env=env, timeout=scaled(120))


def test_list_shows_plugin_components_with_plugin_and_summary():
    out = run_cli("list", "advantage_fn")
    assert out.returncode == 0, out.stderr
    line = next(l for l in out.stdout.splitlines() if l.strip().startswith("group_rank"))
    assert "rltk-plugin-example:example" in line and "Rank-based group advantage" in line


def test_list_unknown_kind_exit_2_without_traceback():
    out = run_cli("list", "advantage")
    assert out.returncode == 2
    assert "advantage_fn" in out.stderr and "Traceback" not in out.stderr


def test_plugins_lists_distribution_and_components(capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "rltk-plugin-example:example  (rltk-plugin-example 0.1.0, module rltk_plugin_example)" in out
    assert "advantage_fn: group_rank" in out and "reward_fn: overlong_penalty" in out


def test_validate_ok_and_errors(tmp_path, capsys):
    assert main(["validate", "grpo"]) == 0
    assert main(["validate", "grpo", "algorithm.advantage_fn=group_rank"]) == 0
    capsys.readouterr()
    assert main(["validate", "grpo", "algorithm.advantage_fn=grop"]) == 2
    err = capsys.readouterr().err
    assert "algorithm.advantage_fn" in err and "'grpo'" in err
    assert main(["validate", str(tmp_path / "missing.yaml")]) == 2


def test_validate_loads_no_model_code():
    """`rltk validate grpo` stays a couple of seconds: it never imports a model's code (transformers' modelling
    and generation, torch's compiler, which they pull in). Two heavy imports remain, each for a check: torch,
    which the registry's components are written in (their names and arguments are checked), and transformers'
    tokenizer, which the check of the warm-up examples against the rollout's caps tokenizes with."""
    import os

    heavy = ["transformers.modeling_utils", "transformers.generation", "transformers.models.qwen2.modeling_qwen2",
             "torch._dynamo"]
    code = (f"import sys; from rltk.commands.cli import main; code = main(['validate', 'grpo']); "
            f"print('loaded:', [m for m in {heavy!r} if m in sys.modules]); sys.exit(code)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=scaled(120))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok: ") and "the first 256 warm-up examples fit the rollout" in out.stdout
    assert out.stdout.splitlines()[-1] == "loaded: []"


def test_a_short_run_cuts_the_recipes_warmup_to_fit_and_a_warmup_you_set_must_fit(tmp_path, capsys):
    from rltk.errors import ConfigError
    from rltk.recipe_tools.validation import validate

    cfg, _ = validate("grpo", [], [])
    assert (cfg.trainer.warmup_steps, cfg.sft.warmup_steps) == (10, 20)  # the shipped length trains as before
    assert "rltk: note" not in capsys.readouterr().err
    cfg, _ = validate("grpo", [], ["trainer.total_steps=2", "sft.steps=4"])
    assert (cfg.trainer.warmup_steps, cfg.sft.warmup_steps) == (2, 4)
    err = capsys.readouterr().err
    assert ("rltk: note: trainer.warmup_steps=10 (a default; you did not set it) is longer than this run's "
            "trainer.total_steps=2: using 2 (set trainer.warmup_steps to choose)") in err
    cfg, _ = validate("ppo", [], ["trainer.total_steps=2"])  # the critic's warm-up leaves the policy one step
    assert (cfg.critic.warmup_steps, cfg.trainer.warmup_steps) == (1, 1)
    # set on the command line, or in the user's own file: refused, naming the key
    with pytest.raises(ConfigError, match=r"bad value 10 for 'trainer.warmup_steps': must be in \[0, "
                                          r"trainer.total_steps=2\]"):
        validate("grpo", [], ["trainer.total_steps=2", "trainer.warmup_steps=10"])
    mine = tmp_path / "mine.yaml"
    mine.write_text("trainer:\n  warmup_steps: 10\n")
    with pytest.raises(ConfigError, match=r"bad value 10 for 'trainer.warmup_steps'"):
        validate("grpo", [mine], ["trainer.total_steps=2"])


def test_unknown_plugin_name_suggests_when_plugin_absent():
    import os

    env = dict(os.environ, RLTK_DISABLE_PLUGIN_AUTOLOAD="1")
    out = run_cli("validate", "grpo", "algorithm.advantage_fn=group_rank", env=env)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "unknown advantage_fn 'group_rank'" in out.stderr and "grpo" in out.stderr


def test_run_unknown_recipe(capsys):
    assert main(["run", "gpro"]) == 2
    assert "Did you mean: 'grpo'" in capsys.readouterr().err


def test_run_recipe_script_by_path_gets_config_and_overrides(tmp_path):
    script = tmp_path / "my_recipe.py"
    script.write_text(
        "import sys\n"
        "from rltk.recipes import parse_recipe_args\n"
        "cfg = parse_recipe_args()\n"
        "open(sys.argv[0] + '.out', 'w').write(f'{cfg.algorithm.advantage_fn} {cfg.trainer.lr}')\n"
    )
    out = run_cli("run", str(script), "algorithm.advantage_fn=rloo", "trainer.lr=0.25")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "my_recipe.py.out").read_text() == "rloo 0.25"
    bad = run_cli("run", str(script), "trainer.lr=-1")
    assert bad.returncode == 2 and "'trainer.lr'" in bad.stderr and "Traceback" not in bad.stderr


def test_shipped_recipes_come_from_the_package():
    recipes = shipped_recipes()
    assert "grpo" in recipes
    # The installed data package and the source folder are the same files.
    assert recipes["grpo"].read_text() == (REPO / "recipes" / "grpo.py").read_text()



def test_rm_is_another_name_for_the_reward_model_recipe():
    # `rltk run rm` (issue 32's name) runs the reward_model script with its config: one recipe, two names.
    from rltk.recipe_tools.validation import default_config_for, resolve_recipe, validate

    assert resolve_recipe("rm") == resolve_recipe("reward_model") == shipped_recipes()["reward_model"]
    assert default_config_for(resolve_recipe("rm")).name == "reward_model.yaml"
    cfg, line = validate("rm", [], ["reward_model.steps=70"])
    assert cfg.reward_model.steps == 70 and cfg.name == "rm-tiny" and "for recipe reward_model" in line
    assert "rm" not in shipped_recipes()  # listed once, under its own name

# ---------------------------------------------------------------- first hour of a new user (issue 10)

def one_line_error(out) -> str:
    """The stderr of a usage/config error: exit 2, one line, no traceback."""
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr
    lines = [l for l in out.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("rltk: error: "), out.stderr
    return lines[0]


def test_version_prints_the_package_version():
    import rltk

    out = run_cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"rltk {rltk.__version__}"


def test_validate_takes_a_config_the_way_run_does(tmp_path):
    cfg = tmp_path / "mine.yaml"
    cfg.write_text("trainer:\n  lr: 3.0e-4\n")
    for args in (["--config", str(cfg), "grpo"], ["grpo", "--config", str(cfg)], [str(cfg)],
                 ["--config", str(cfg)], ["grpo", "--config", str(cfg), "trainer.total_steps=7"]):
        out = run_cli("validate", *args)
        assert out.returncode == 0, (args, out.stderr)
        assert out.stdout.startswith(f"ok: {cfg}"), out.stdout
        assert ("for recipe grpo" in out.stdout) == ("grpo" in args), out.stdout
    # With the recipe named, what it cannot serve is caught whichever way the file came.
    err = one_line_error(run_cli("validate", "--config", str(cfg), "grpo", "algorithm.name=ppo"))
    assert "'algorithm.advantage_fn'='gae'" in err and "rltk run ppo" in err


def test_run_with_a_yaml_in_place_of_the_recipe_says_how_to_pass_it(tmp_path):
    cfg = tmp_path / "grpo.yaml"
    cfg.write_text("trainer:\n  lr: 3.0e-4\n")
    err = one_line_error(run_cli("run", str(cfg)))
    assert f"`rltk run grpo --config {cfg}`" in err
    err = one_line_error(run_cli("run", "grpo", str(cfg)))
    assert f"rltk run grpo --config {cfg}" in err


@pytest.mark.parametrize("override, expected", [
    ("model.path={missing}", "bad value '{missing}' for 'model.path': the folder does not exist"),
    ("model.path={file}", "bad value '{file}' for 'model.path': it is a file, not a model folder"),
    ("buffer.sample_strategy=mix_expert", "'buffer.sample_strategy'='mix_expert' reads experiences of buffer "
                                          "source(s) 'expert', which recipe 'grpo' fills only from a dataset of "
                                          "expert responses: set buffer.expert.path="),
    ("algorithm.name=ppo", "'algorithm.advantage_fn'='gae' (the advantage_fn of algorithm.name='ppo') needs "
                           "batch field(s) 'values', which recipe 'grpo' does not provide"),
    ("seed=4294967296", "bad value 4294967296 for 'seed': must be an integer in [0, 2**32 - 1"),
    ("seed=-1", "bad value -1 for 'seed'"),
])
def test_user_errors_found_before_loading_exit_2_with_one_line(tmp_path, capsys, override, expected):
    missing, file = tmp_path / "no-such-model", tmp_path / "model.safetensors"
    file.write_text("not a folder")
    override = override.format(missing=missing, file=file)
    expected = expected.format(missing=missing, file=file)
    err = one_line_error(run_cli("run", "grpo", f"output_dir={tmp_path / 'run'}", override))
    assert expected in err, err
    assert not (tmp_path / "run").exists()  # refused before anything was written
    assert main(["validate", "grpo", override]) == 2  # validate catches it too
    assert expected in capsys.readouterr().err


def test_ppo_preset_under_grpo_names_both_keys_and_the_recipe_that_serves_it():
    err = one_line_error(run_cli("validate", "grpo", "algorithm.name=ppo"))
    assert "algorithm.advantage_fn" in err and "algorithm.name='ppo'" in err and "`rltk run ppo`" in err
    assert "rloo" in err  # and the estimators the grpo recipe can serve
    assert run_cli("validate", "ppo").returncode == 0


def test_a_kl_setting_with_kl_coef_0_warns_once_naming_the_keys():
    out = run_cli("validate", "grpo", "algorithm.kl_coef=0", "algorithm.kl_penalty_fn=k3", "algorithm.kl_in=reward")
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("rltk: warning: "), out.stderr
    assert "algorithm.kl_penalty_fn=k3 (command line)" in lines[0] and "algorithm.kl_in=reward" in lines[0]
    assert "algorithm.kl_coef is 0" in lines[0] and "algorithm.kl_coef=0.01" in lines[0]
    quiet = run_cli("validate", "grpo", "algorithm.kl_penalty_fn=k3", "algorithm.kl_coef=0.05")
    assert quiet.returncode == 0 and quiet.stderr == ""
    assert run_cli("validate", "grpo").stderr == ""  # the default run's KL keys have a coefficient


def test_one_name_for_a_list_key_on_the_command_line(capsys):
    assert main(["validate", "grpo", "reward.reward_fn=exact_match", "logging.logger=jsonl"]) == 0
    assert "ok:" in capsys.readouterr().out
