import sys
import textwrap
import types

import pytest

import rltk
from rltk.registry import KINDS, PluginLoadError, RegistryError, get_registry, closest


def _plugin(name, hook, components):
    module = types.ModuleType(name)
    impl = rltk.hookimpl(lambda: components)
    impl.__name__ = hook
    setattr(module, hook, impl)
    return module


def test_kind_vocabulary_is_exactly_the_public_one():
    assert set(KINDS) == {
        "advantage_fn", "kl_penalty_fn", "loss_agg", "policy_loss", "reward_fn", "workflow",
        "sample_strategy", "training_strategy", "rollout_engine", "logger", "algorithm",
        "environment", "tool", "tool_parser", "task",
        "agent",  # #11: agents of the agentic workflow
        "preference_loss",  # #32: the DPO family
        "reward_model_loss",  # #32: reward-model training (recipes/reward_model.py)
        "stage",  # #55: training loops (rltk.StageSpec)
    }
    for kind in KINDS.values():
        assert hasattr(rltk.hookspecs, kind.hook), kind.hook


def test_builtins_come_from_rltk_entry_points():
    registry = get_registry()
    builtin = [p for p in registry.plugins.values() if p.distribution == "rltk"]
    assert builtin, "no builtin plugin loaded through the 'rltk' entry-point group"
    assert rltk.get_component("algorithm", "grpo")["advantage_fn"] == "grpo"
    assert {e.plugin for e in rltk.list_components("algorithm")} == {"rltk:presets"}


def test_unknown_name_suggests_closest_and_lists_all():
    with pytest.raises(RegistryError) as info:
        rltk.get_component("algorithm", "grop")
    msg = str(info.value)
    assert "algorithm 'grpo'" not in msg and "unknown algorithm 'grop'" in msg
    assert "Did you mean: 'grpo'" in msg
    assert "rloo" in msg and "dapo" in msg  # the full list


def test_unknown_kind():
    with pytest.raises(RegistryError, match="unknown component kind 'advantage'.*'advantage_fn'"):
        rltk.get_component("advantage", "grpo")


def test_duplicate_name_names_both_plugins(fresh_registry):
    first = _plugin("first_plugin", "rltk_reward_fns", {"dup_reward": lambda **_: 1.0})
    second = _plugin("second_plugin", "rltk_reward_fns", {"dup_reward": lambda **_: 0.0})
    rltk.register_plugin(first)
    with pytest.raises(RegistryError) as info:
        rltk.register_plugin(second)
    assert "'first_plugin' and 'second_plugin'" in str(info.value)
    assert "rltk.override" in str(info.value)


def test_a_component_table_is_filled_beside_each_definition_and_registers_through_its_hook(fresh_registry):
    table = rltk.ComponentTable("kl_penalty_fn")

    @table.register("my_k1", "my_k1_alias")
    def my_k1(logprobs, ref_logprobs):
        return logprobs - ref_logprobs

    assert my_k1(3.0, 1.0) == 2.0  # the decorator returns the function itself
    assert table == {"my_k1": my_k1, "my_k1_alias": my_k1}
    rltk.register_plugin(_plugin("table_plugin", "rltk_kl_penalty_fns", table))
    entries = {e.name: e for e in rltk.list_components("kl_penalty_fn") if e.plugin == "table_plugin"}
    assert set(entries) == {"my_k1", "my_k1_alias"} and entries["my_k1"].obj is my_k1


def test_a_component_table_refuses_a_name_twice_and_an_unknown_kind():
    table = rltk.ComponentTable("policy_loss")
    table.register("twice")(lambda **_: None)
    with pytest.raises(RegistryError, match=r"policy_loss 'twice' is entered twice in one table: .*<lambda>.*second"):
        @table.register("twice")
        def second(**_):
            return None
    with pytest.raises(RegistryError, match=r"unknown component kind 'policy_losses'.*'policy_loss'"):
        rltk.ComponentTable("policy_losses")


@pytest.mark.parametrize("module, table, kind", [
    ("advantages", "ADVANTAGE_FNS", "advantage_fn"), ("policy_losses", "POLICY_LOSSES", "policy_loss"),
    ("kl", "KL_PENALTY_FNS", "kl_penalty_fn"), ("aggregation", "LOSS_AGGS", "loss_agg"),
    ("preference_losses", "PREFERENCE_LOSSES", "preference_loss"),
    ("reward_model_losses", "REWARD_MODEL_LOSSES", "reward_model_loss"),
])
def test_builtin_tables_are_what_their_entry_points_register(module, table, kind):
    import importlib

    filled = getattr(importlib.import_module(f"rltk.algorithms.{module}"), table)
    registered = {e.name: e for e in rltk.list_components(kind) if e.plugin == f"rltk:{module}"}
    assert filled and set(registered) == set(filled)
    assert all(registered[name].obj is component for name, component in filled.items())


def test_explicit_override_replaces_and_is_recorded(fresh_registry):
    preset = {"description": "my grpo", "advantage_fn": "rloo"}
    rltk.register_plugin(_plugin("my_presets", "rltk_algorithms", {"grpo": rltk.override(preset)}))
    assert rltk.get_component("algorithm", "grpo") is preset
    entry = get_registry().entry("algorithm", "grpo")
    assert entry.plugin == "my_presets" and entry.overrides == "rltk:presets"


def test_override_of_missing_name_is_an_error(fresh_registry):
    with pytest.raises(PluginLoadError, match="overrides algorithm 'nonexistent'"):
        rltk.register_plugin(_plugin("bad", "rltk_algorithms", {"nonexistent": rltk.override({})}))


def test_hook_returning_non_dict_is_an_error(fresh_registry):
    with pytest.raises(PluginLoadError, match="must return a dict"):
        rltk.register_plugin(_plugin("listy", "rltk_reward_fns", ["a"]))


def _fake_distribution(tmp_path, module_source):
    dist = tmp_path / "rltk_plugin_broken-0.3.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: rltk-plugin-broken\nVersion: 0.3\n")
    (dist / "entry_points.txt").write_text("[rltk]\nbroken = rltk_plugin_broken\n")
    (tmp_path / "rltk_plugin_broken.py").write_text(textwrap.dedent(module_source))


def test_plugin_import_failure_names_distribution_and_error(tmp_path, monkeypatch, fresh_registry):
    _fake_distribution(tmp_path, "import does_not_exist_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginLoadError) as info:
        get_registry(reload=True)
    msg = str(info.value)
    assert "rltk-plugin-broken" in msg and "broken = rltk_plugin_broken" in msg
    assert "ModuleNotFoundError" in msg and "does_not_exist_anywhere" in msg
    # Builtins-only mode skips third-party plugins entirely.
    monkeypatch.setenv("RLTK_DISABLE_PLUGIN_AUTOLOAD", "1")
    registry = get_registry(reload=True)
    assert all(p.distribution == "rltk" for p in registry.plugins.values())
    monkeypatch.delitem(sys.modules, "rltk_plugin_broken", raising=False)


def test_disable_autoload_hides_example_plugin(monkeypatch, fresh_registry):
    assert "group_rank" in {e.name for e in rltk.list_components("advantage_fn")}
    monkeypatch.setenv("RLTK_DISABLE_PLUGIN_AUTOLOAD", "1")
    get_registry(reload=True)
    with pytest.raises(RegistryError, match=r"unknown advantage_fn 'group_rank'\..*Valid: .*grpo.*rloo"):
        rltk.get_component("advantage_fn", "group_rank")


def test_lifecycle_hooks_reach_plugins(fresh_registry):
    seen = []
    module = types.ModuleType("watcher")

    @rltk.hookimpl
    def rltk_on_step_end(step, metrics):  # may accept a subset of the spec's arguments
        seen.append((step, metrics["reward"]))

    module.rltk_on_step_end = rltk_on_step_end
    rltk.register_plugin(module)
    rltk.get_plugin_manager().hook.rltk_on_step_end(step=3, metrics={"reward": 0.5})
    assert seen == [(3, 0.5)]


def test_closest():
    assert closest("grop", ["grpo", "rloo", "gae"])[0] == "grpo"
    assert set(closest("seq-mean", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])) >= {
        "seq-mean-token-sum", "seq-mean-token-mean"
    }
