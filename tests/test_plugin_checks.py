"""Plugins that misbehave are refused at registration, or stop a run with an error naming them."""

import sys
import textwrap
import types

import pytest

import rltk
from rltk.commands.cli import main
from rltk.registry import LifecycleHookError, PluginLoadError, get_registry


def _module(name, **hooks):
    module = types.ModuleType(name)
    for attr, fn in hooks.items():
        setattr(module, attr, fn)
    return module


def _returns(components):
    return rltk.hookimpl(lambda: components)


# ------------------------------------------------------------ components that are not components


@pytest.mark.parametrize("kind, hook, bad", [
    ("reward_fn", "rltk_reward_fns", 42),
    ("advantage_fn", "rltk_advantage_fns", "grpo"),
    ("logger", "rltk_loggers", None),
])
def test_a_component_that_cannot_be_called_is_refused_naming_the_plugin(fresh_registry, kind, hook, bad):
    good = lambda **_: 1.0  # noqa: E731
    plugin = _module("bad_components", **{hook: _returns({"fine_one": good, "broken": bad})})
    with pytest.raises(PluginLoadError) as info:
        rltk.register_plugin(plugin)
    msg = str(info.value)
    assert f"plugin 'bad_components': {hook}() registers {kind} 'broken' as {type(bad).__name__}" in msg
    assert "cannot be called" in msg
    # Nothing of the plugin was registered, not even its good component, and it is not half-loaded.
    names = {e.name for e in rltk.list_components(kind)}
    assert "broken" not in names and "fine_one" not in names
    assert "bad_components" not in get_registry().plugins
    assert "bad_components" not in {name for name, _ in rltk.get_plugin_manager().list_name_plugin()}


def test_a_preset_that_is_not_a_mapping_is_refused(fresh_registry):
    with pytest.raises(PluginLoadError, match=r"algorithm preset 'mine' as list .*a preset is a dict"):
        rltk.register_plugin(_module("bad_preset", rltk_algorithms=_returns({"mine": ["grpo"]})))


def test_a_name_that_is_not_a_string_is_refused(fresh_registry):
    with pytest.raises(PluginLoadError, match=r"returned the name 3; names are the non-empty strings"):
        rltk.register_plugin(_module("bad_name", rltk_reward_fns=_returns({3: lambda **_: 1.0})))


# ------------------------------------------------------------ hooks that do not match the specs


def test_an_argument_the_spec_lacks_is_refused_naming_plugin_hook_and_offer(fresh_registry):
    @rltk.hookimpl
    def rltk_on_step_end(step, metrics, optimizer):
        pass

    with pytest.raises(PluginLoadError) as info:
        rltk.register_plugin(_module("greedy_hook", rltk_on_step_end=rltk_on_step_end))
    assert str(info.value) == (
        "plugin 'greedy_hook': rltk_on_step_end() takes 'optimizer', which the hook does not pass; "
        "rltk_on_step_end offers (step, metrics). An implementation may take any subset of them"
    )

    @rltk.hookimpl
    def rltk_reward_fns(config):
        return {}

    with pytest.raises(PluginLoadError, match=r"rltk_reward_fns\(\) takes 'config'.*offers no arguments"):
        rltk.register_plugin(_module("component_hook_with_args", rltk_reward_fns=rltk_reward_fns))

    # A subset is fine, and so is an extra argument with a default (pluggy never passes it).
    @rltk.hookimpl
    def rltk_on_checkpoint(path, verbose=False):
        pass

    rltk.register_plugin(_module("subset_hook", rltk_on_checkpoint=rltk_on_checkpoint))


def test_a_misspelt_hook_is_reported_with_the_closest_spec(fresh_registry):
    plugin = _module("typo_plugin", rltk_reward_fnz=_returns({"r": lambda **_: 1.0}))
    with pytest.raises(PluginLoadError) as info:
        rltk.register_plugin(plugin)
    msg = str(info.value)
    assert msg.startswith("plugin 'typo_plugin' defines rltk_reward_fnz(), which is not an rltk hook")
    assert "Did you mean: 'rltk_reward_fns'" in msg and "rltk_on_step_end" in msg  # the full list
    # Unmarked functions with the prefix are typos too; helpers without it are the plugin's business.
    with pytest.raises(PluginLoadError, match="rltk_on_stepend"):
        rltk.register_plugin(_module("typo_unmarked", rltk_on_stepend=lambda step: None))
    rltk.register_plugin(_module("with_helpers", helper=lambda: 1, rltk_version="1.0"))


def test_a_lifecycle_hook_without_the_marker_is_refused(fresh_registry):
    with pytest.raises(PluginLoadError, match=r"defines rltk_on_train_end\(\) without @rltk.hookimpl"):
        rltk.register_plugin(_module("unmarked", rltk_on_train_end=lambda run_dir, metrics: None))


def _distribution(tmp_path, module, source):
    dist = tmp_path / f"{module}-0.1.dist-info"
    dist.mkdir()
    name = module.replace("_", "-")
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[rltk]\nhooks = {module}\n")
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))


@pytest.mark.parametrize("module, source, expected", [
    ("rltk_plugin_extra_arg", """
        import rltk

        @rltk.hookimpl
        def rltk_on_step_end(step, metrics, trainer):
            pass
        """, "rltk: error: plugin 'rltk-plugin-extra-arg:hooks': rltk_on_step_end() takes 'trainer'"),
    ("rltk_plugin_typo", """
        import rltk

        @rltk.hookimpl
        def rltk_reward_fnz():
            return {}
        """, "rltk: error: plugin 'rltk-plugin-typo:hooks' defines rltk_reward_fnz(), which is not an rltk hook"),
    ("rltk_plugin_not_callable", """
        import rltk

        @rltk.hookimpl
        def rltk_reward_fns():
            return {"name": 42}
        """, "rltk: error: plugin 'rltk-plugin-not-callable:hooks': rltk_reward_fns() registers reward_fn 'name'"),
])
def test_rltk_list_reports_a_bad_installed_plugin_cleanly(fresh_registry, tmp_path, monkeypatch, capsys,
                                                          module, source, expected):
    _distribution(tmp_path, module, source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr("rltk.registry._registry", None)  # `rltk list` loads the plugins afresh
    try:
        assert main(["list"]) == 2
    finally:
        sys.modules.pop(module, None)
    err = capsys.readouterr().err
    assert err.startswith(expected) and "Traceback" not in err, err


# ------------------------------------------------------------ lifecycle hooks that raise


class Boom(ValueError):
    pass


def _raising_plugin(name, hook="rltk_on_step_end"):
    def impl(step, metrics):
        if step == 3:
            raise Boom("metric 'reward' missing")

    impl.__name__ = hook
    return _module(name, **{hook: rltk.hookimpl(impl)})


def test_a_raising_lifecycle_hook_stops_the_run_naming_plugin_hook_and_step(fresh_registry):
    seen = []

    @rltk.hookimpl
    def rltk_on_step_end(step):
        seen.append(step)

    rltk.register_plugin(_module("watcher", rltk_on_step_end=rltk_on_step_end))
    rltk.register_plugin(_raising_plugin("strict_checker"))
    rltk.call_lifecycle_hook("rltk_on_step_end", step=2, metrics={})
    with pytest.raises(LifecycleHookError) as info:
        rltk.call_lifecycle_hook("rltk_on_step_end", step=3, metrics={})
    err = info.value
    assert str(err).startswith(
        "plugin 'strict_checker' raised in its rltk_on_step_end hook at step 3: Boom: metric 'reward' missing. "
        "A lifecycle hook that raises stops the run"
    )
    assert err.plugin == "strict_checker" and err.hook == "rltk_on_step_end" and isinstance(err.__cause__, Boom)
    # pluggy calls the last registered first: the watcher after the raise is not called for step 3.
    assert seen == [2]


def test_the_plugin_is_found_behind_helpers_and_decorators(fresh_registry):
    import functools

    def check(step):
        raise KeyError("deep")

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return fn(*args, **kwargs)
        return wrapper

    @rltk.hookimpl
    @decorate
    def rltk_on_checkpoint(step, path):
        check(step)

    rltk.register_plugin(_module("decorated", rltk_on_checkpoint=rltk_on_checkpoint))
    with pytest.raises(LifecycleHookError, match=r"^plugin 'decorated' raised in its rltk_on_checkpoint hook at step 7: "
                                                 r"KeyError: 'deep'"):
        rltk.call_lifecycle_hook("rltk_on_checkpoint", step=7, path="/tmp/x")


def test_interrupts_pass_through_unchanged(fresh_registry):
    @rltk.hookimpl
    def rltk_on_train_start(config, run_dir):
        raise KeyboardInterrupt

    rltk.register_plugin(_module("interrupter", rltk_on_train_start=rltk_on_train_start))
    with pytest.raises(KeyboardInterrupt):
        rltk.call_lifecycle_hook("rltk_on_train_start", config=None, run_dir=None)


def test_rltk_run_reports_the_hook_and_exits_1(fresh_registry, tmp_path, monkeypatch, capsys):
    rltk.register_plugin(_raising_plugin("strict_checker"))

    def fake_run(args, extra):  # the training loop, reduced to its hook calls
        for step in (1, 2, 3):
            rltk.call_lifecycle_hook("rltk_on_step_end", step=step, metrics={})
        return 0

    monkeypatch.setattr("rltk.commands.cli.cmd_run", fake_run)
    assert main(["run", "grpo"]) == 1
    err = capsys.readouterr().err
    lines = err.rstrip().splitlines()
    assert lines[0] == "Traceback (most recent call last):" and "Boom: metric 'reward' missing" in err
    assert lines[-1].startswith("rltk: error: plugin 'strict_checker' raised in its rltk_on_step_end hook at step 3")


def test_code_shared_by_two_plugins_names_them_both_rather_than_the_wrong_one(fresh_registry):
    rltk.register_plugin(_raising_plugin("checker_a"))  # one factory: both implementations share code
    rltk.register_plugin(_raising_plugin("checker_b"))
    with pytest.raises(LifecycleHookError) as info:
        rltk.call_lifecycle_hook("rltk_on_step_end", step=3, metrics={})
    assert str(info.value).startswith("one of the plugins 'checker_a', 'checker_b' raised in its rltk_on_step_end")
    assert info.value.plugin is None
