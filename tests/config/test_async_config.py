"""The asynchronous-training keys: defaults, bad values named with what is valid, and what the loop cannot
run (a recipe without the modes, a bound the producer cannot keep) refused with exit 2, never run otherwise."""

from __future__ import annotations

import pytest

from rltk.commands.cli import main
from rltk.config import load_config
from rltk.errors import ConfigError
from rltk.rollout.base import RolloutEngine


def test_defaults_are_the_synchronous_loop():
    cfg = load_config([], [])
    t = cfg.trainer
    assert (t.mode, t.max_staleness, t.stale_policy, t.sync_every, t.producers) == ("sync", 1, "drop", 1, 1)
    assert (cfg.buffer.queue_path, cfg.buffer.queue_timeout_s, cfg.buffer.queue_resume) == (None, 600.0, "keep")
    cfg = load_config([], ["trainer.max_staleness=0", "trainer.stale_policy=wait", "trainer.sync_every=4",
                           "buffer.queue_path=/tmp/q.sqlite", "buffer.queue_timeout_s=30"])
    assert (cfg.trainer.max_staleness, cfg.trainer.stale_policy, cfg.trainer.sync_every) == (0, "wait", 4)


@pytest.mark.parametrize("overrides, match", [
    (["trainer.mode=asynch"], r"bad value 'asynch' for 'trainer\.mode'\. Did you mean: 'async'.* Valid: sync, "
                              r"one_step_off, async"),
    (["trainer.stale_policy=skip"], r"bad value 'skip' for 'trainer\.stale_policy'\..*Valid: drop, wait"),
    (["trainer.max_staleness=-1"], r"bad value -1 for 'trainer\.max_staleness': must be an integer >= 0"),
    (["trainer.sync_every=0"], r"bad value 0 for 'trainer\.sync_every': must be an integer >= 1"),
    (["buffer.queue_timeout_s=0"], r"bad value 0\.0 for 'buffer\.queue_timeout_s': must be a number of seconds > 0"),
    (["buffer.queue_journal=memory"], r"bad value 'memory' for 'buffer\.queue_journal'\..*Valid: wal, delete"),
    (["buffer.queue_resume=new"], r"bad value 'new' for 'buffer\.queue_resume'\..*Valid: keep, fresh"),
    (["trainer.mode=async", "trainer.producers=-1"],
     r"bad value -1 for 'trainer\.producers': must be an integer >= 0 .*`rltk produce`"),
])
def test_bad_values_name_the_key_and_what_is_valid(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config([], overrides)


def test_no_local_producers_is_valid_in_the_asynchronous_modes():
    assert load_config([], ["trainer.mode=async", "trainer.producers=0"]).trainer.producers == 0


@pytest.mark.parametrize("mode", ["one_step_off", "async"])
def test_the_rl_recipes_run_the_asynchronous_modes_and_a_recipe_that_does_not_refuses_them(mode):
    from rltk.recipe_tools.validation import shipped_recipe_spec

    for recipe, stages in [("grpo", []), ("ppo", []), ("distill", ["stages=[{name: d, type: distill}]"])]:
        load_config([], [f"trainer.mode={mode}", *stages], recipe=shipped_recipe_spec(recipe))
    with pytest.raises(ConfigError, match=rf"bad value '{mode}' for 'trainer\.mode': the dpo recipe runs sync; "
                                          rf"distill, grpo, ppo runs {mode}"):
        load_config([], [f"trainer.mode={mode}"], recipe=shipped_recipe_spec("dpo"))


@pytest.mark.parametrize("overrides, match", [
    # one_step_off is staleness 1 by definition; another bound is the async mode
    (["trainer.mode=one_step_off", "trainer.max_staleness=2"],
     r"bad value 2 for 'trainer\.max_staleness' with trainer\.mode=one_step_off.*use trainer\.mode=async"),
    # a producer may not sample with weights older than max_staleness, and gets them every sync_every steps
    (["trainer.mode=async", "trainer.max_staleness=1", "trainer.sync_every=3"],
     r"bad value 3 for 'trainer\.sync_every': with trainer\.max_staleness=1 it must be at most 2"),
    # producers run beside the trainer only in the asynchronous modes
    (["trainer.producers=2"], r"bad value 2 for 'trainer\.producers' with trainer\.mode=sync"),
    # producers=0 (all started with `rltk produce`) is an asynchronous setting too: a sync run reads no queue
    (["trainer.producers=0"], r"bad value 0 for 'trainer\.producers' with trainer\.mode=sync: producers \(local or "
                              r"started with `rltk produce`\) run only in trainer\.mode=one_step_off or async"),
    # the colocated engine lives in the trainer's process: its class does not declare runs_in_producer
    (["trainer.mode=async", "rollout.engine=vllm"],
     r"bad value 'vllm' for 'rollout\.engine' with trainer\.mode=async: a producer process samples only with "
     r"engines that declare runs_in_producer, and rltk\.rollout\.vllm_engine\.VLLMRolloutEngine does not "
     r"\(Rollouts with an in-process ``vllm\.LLM`` next to the trainer .*\)\. Engines that do: [^;]*\bhf\b[^;]*"
     r"\bvllm_server\b[^;]*; set one of those or trainer\.mode=sync"),
    # two producers would load their weights into the same given servers at once
    (["trainer.mode=async", "rollout.engine=vllm_server", "trainer.producers=2",
      "rollout.engine_args={servers: ['http://127.0.0.1:8000']}"],
     r"bad value 2 for 'trainer\.producers' with rollout\.engine_args\.servers: every producer loads"),
])
def test_asynchronous_settings_the_loop_cannot_run_are_refused(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config([], overrides)


def test_vllm_server_producers_are_accepted_and_the_trainer_evaluates_with_hf():
    from rltk.training.scaffold.setup import trainer_workflow_config

    cfg = load_config([], ["trainer.mode=async", "rollout.engine=vllm_server", "trainer.producers=2",
                           "rollout.engine_args={launch: 1}"])
    assert cfg.rollout.engine == "vllm_server"  # what the producers build
    trainer = trainer_workflow_config(cfg)  # the servers are the producers': the trainer's evaluations run on hf
    assert trainer.rollout.engine == "hf" and dict(trainer.rollout.engine_args) == {}
    assert cfg.rollout.engine == "vllm_server" and dict(cfg.rollout.engine_args) == {"launch": 1}
    sync = load_config([], ["rollout.engine=vllm_server"])
    assert trainer_workflow_config(sync) is sync  # a synchronous run samples on its servers itself


def test_the_decoupled_loss_is_accepted_now_that_the_loop_passes_behaviour_logprobs():
    cfg = load_config([], ["algorithm.policy_loss=decoupled_ppo"])
    assert cfg.algorithm.policy_loss == "decoupled_ppo"


def test_behaviour_logprobs_is_filled_in_by_rltk_not_configured():
    with pytest.raises(ConfigError, match=r"'algorithm\.policy_loss_args\.behaviour_logprobs'.*filled in by rltk"):
        load_config([], ["algorithm.policy_loss_args.behaviour_logprobs=1"])


def test_cli_exits_2_without_traceback(capsys):
    assert main(["validate", "dpo", "trainer.mode=async", "trainer.max_staleness=1"]) == 2
    err = capsys.readouterr().err
    assert "'trainer.mode'" in err and "dpo recipe runs sync" in err and "Traceback" not in err


class _SyncOnlyEngine(RolloutEngine):
    """A plugin engine that samples in the trainer's process only (it declares no runs_in_producer)."""

    def generate(self, prompt_ids, params):
        raise AssertionError("validation never builds the engine")

    def update_weights(self, state_dict_or_model, *, version=None, interrupt=False):
        raise AssertionError("validation never builds the engine")


@pytest.fixture
def sync_only_engine():
    import types

    import rltk

    module = types.ModuleType("rltk_plugin_sync_only")
    module.rltk_rollout_engines = rltk.hookimpl(lambda: {"sync_only": _SyncOnlyEngine})
    rltk.register_plugin(module, name="rltk_plugin_sync_only")
    yield "sync_only"
    rltk.unregister_plugin("rltk_plugin_sync_only")


def test_what_an_engine_can_do_is_read_from_its_class_not_its_name(sync_only_engine):
    # a plugin's server engine (rltk_plugin_example's rltk_serve, on rltk.rollout.server_pool) declares that it
    # runs in a producer and owns its servers, as vllm_server does: the same checks apply to it
    cfg = load_config([], ["trainer.mode=async", "rollout.engine=rltk_serve"])
    assert cfg.rollout.engine == "rltk_serve"
    with pytest.raises(ConfigError, match=r"bad value 2 for 'trainer\.producers' with rollout\.engine_args\.servers"):
        load_config([], ["trainer.mode=async", "rollout.engine=rltk_serve", "trainer.producers=2",
                         "rollout.engine_args={servers: ['http://127.0.0.1:8000']}"])
    from rltk.training.scaffold.setup import trainer_workflow_config

    assert trainer_workflow_config(cfg).rollout.engine == "hf"  # its servers are the producer's
    # a plugin engine that does not declare runs_in_producer is refused by its class, whatever its name
    assert load_config([], [f"rollout.engine={sync_only_engine}"]).rollout.engine == "sync_only"
    with pytest.raises(ConfigError, match=r"bad value 'sync_only' for 'rollout\.engine' with trainer\.mode=async: "
                                          r".*test_async_config\._SyncOnlyEngine does not \(A plugin engine that "
                                          r"samples in the trainer's process only.*\)\. Engines that do: hf, "
                                          r"rltk_serve, vllm_server; set one of those or trainer\.mode=sync"):
        load_config([], ["trainer.mode=async", f"rollout.engine={sync_only_engine}"])


def test_an_engine_that_cannot_run_in_a_producer_exits_2_naming_the_key(sync_only_engine, capsys):
    assert main(["validate", "grpo", "trainer.mode=async", f"rollout.engine={sync_only_engine}"]) == 2
    err = capsys.readouterr().err
    assert "'rollout.engine'" in err and "Engines that do: hf, rltk_serve, vllm_server" in err
    assert "Traceback" not in err
