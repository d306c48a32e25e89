"""The component registry: one pluggy ``PluginManager("rltk")``.

Builtins and third-party plugins are loaded the same way, from the entry-point
group ``rltk``. ``RLTK_DISABLE_PLUGIN_AUTOLOAD=1`` loads only the entry points
of the ``rltk`` distribution itself.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata as importlib_metadata
import inspect
import os
import sys
import threading
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pluggy

from rltk import hookspecs
from rltk.batch_types import BATCH_FIELDS

PROJECT = "rltk"
ENTRY_POINT_GROUP = "rltk"
hookimpl = pluggy.HookimplMarker(PROJECT)


@dataclass(frozen=True)
class Kind:
    """A kind of component: its registration hook and its calling convention.

    ``provided`` lists parameter names the caller fills in (batch fields,
    models, tokenizers): a config may not set them, and they are not counted as
    missing arguments when a config is validated against the signature.
    """

    name: str
    hook: str
    description: str
    provided: frozenset[str] = field(default_factory=frozenset)


KINDS: dict[str, Kind] = {
    k.name: k
    for k in [
        Kind("advantage_fn", "rltk_advantage_fns", "advantage estimators", BATCH_FIELDS),
        Kind("kl_penalty_fn", "rltk_kl_penalty_fns", "per-token KL estimators",
             frozenset({"logprobs", "ref_logprobs", "old_logprobs"})),
        Kind("loss_agg", "rltk_loss_aggs", "loss aggregations",
             frozenset({"loss_mat", "mask", "global_tokens", "global_seqs"})),
        Kind("policy_loss", "rltk_policy_losses", "policy losses",
             frozenset({"logprobs", "old_logprobs", "behaviour_logprobs", "advantages", "response_mask", "loss_agg"})),
        Kind("preference_loss", "rltk_preference_losses", "preference losses (DPO family)",
             frozenset({"chosen_logps", "rejected_logps", "ref_chosen_logps", "ref_rejected_logps", "beta"})),
        Kind("reward_model_loss", "rltk_reward_model_losses", "reward-model losses over preference pairs",
             frozenset({"chosen_rewards", "rejected_rewards"})),
        Kind("reward_fn", "rltk_reward_fns", "reward functions",
             frozenset({"prompt", "response", "ground_truth", "extras"})),
        Kind("workflow", "rltk_workflows", "workflows (task -> experiences)",
             frozenset({"engine", "tokenizer", "reward", "sampling", "env"})),
        Kind("sample_strategy", "rltk_sample_strategies", "buffer sample strategies",
             frozenset({"buffer"})),
        Kind("training_strategy", "rltk_training_strategies", "training strategies",
             frozenset()),
        Kind("rollout_engine", "rltk_rollout_engines", "rollout engines",
             frozenset({"model", "tokenizer"})),
        Kind("logger", "rltk_loggers", "metric loggers",
             frozenset({"run_dir", "config", "total_steps", "resume_step"})),
        Kind("agent", "rltk_agents", "agents driving the policy through the OpenAI endpoint (agentic workflow)",
             frozenset({"row", "client", "model", "tools"})),
        Kind("algorithm", "rltk_algorithms", "algorithm presets", frozenset()),
        Kind("environment", "rltk_environments", "environments of multi-turn episodes", frozenset()),
        Kind("tool", "rltk_tools", "tools the policy can call", frozenset()),
        Kind("tool_parser", "rltk_tool_parsers", "tool-call parsers", frozenset()),
        Kind("task", "rltk_tasks", "synthetic tasks (split, size, seed -> rows)",
             frozenset({"split", "size", "seed"})),
        Kind("stage", "rltk_stages", "training loops, chained by name in a config's stages (rltk.StageSpec)",
             frozenset()),
    ]
}


#: Hooks that register components: read by name (``Registry.collect``), marked or not.
COMPONENT_HOOKS = frozenset(kind.hook for kind in KINDS.values())


class RegistryError(LookupError):
    """A component, kind or plugin problem; the message says what is valid."""


class PluginLoadError(RegistryError):
    """A plugin's entry point failed to import or to register."""


class LifecycleHookError(RuntimeError):
    """A plugin's lifecycle hook (``rltk_on_*``) raised: the run stops here.

    The message names the plugin and the hook; the plugin's own exception is
    chained as ``__cause__`` (``plugin`` and ``hook`` are attributes too).
    """

    def __init__(self, message: str, plugin: str | None, hook: str):
        super().__init__(message)
        self.plugin = plugin
        self.hook = hook


class Override:
    """Marks a component that deliberately replaces one of the same name.

    ``return {"grpo": rltk.override(my_grpo)}`` replaces the builtin ``grpo``;
    without it, two plugins claiming one name is an error.
    """

    def __init__(self, component: Any):
        self.component = component


def override(component: Any) -> Override:
    """Wrap ``component`` so it may replace an already registered name."""
    return Override(component)


class ComponentTable(dict):
    """A plugin module's ``{name: component}`` of one kind, filled by a decorator on each definition.

    ::

        ADVANTAGE_FNS = rltk.ComponentTable("advantage_fn")

        @ADVANTAGE_FNS.register("median_baseline")
        def median_baseline(*, token_rewards, response_mask, group_ids): ...

        @rltk.hookimpl
        def rltk_advantage_fns():
            return ADVANTAGE_FNS

    The registration hook still returns the table, so the module registers through its entry point like
    any plugin (two plugins claiming one name stay an error); the decorator only puts each name beside the
    function it names, and returns the function unchanged. One function may take several names (aliases).
    """

    def __init__(self, kind: str):
        if kind not in KINDS:
            raise RegistryError(unknown_name_message("component kind", kind, list(KINDS)))
        super().__init__()
        self.kind = kind

    def register(self, *names: str):
        """Decorator: enter the decorated component under each of ``names``."""

        def enter(component):
            for name in names:
                if not isinstance(name, str) or not name:
                    raise RegistryError(f"{self.kind} {component!r}: a name is a non-empty string, got {name!r}")
                if name in self:
                    raise RegistryError(f"{self.kind} '{name}' is entered twice in one table: for "
                                        f"{_label(self[name])} and for {_label(component)}")
                self[name] = component
            return component

        return enter


def _label(component: Any) -> str:
    return getattr(component, "__qualname__", None) or repr(component)


_UNLOADED = object()


class Entry:
    """One registered component.

    A builtin is registered by reference (``ref``, ``"module:attribute"``, read from its registration module's
    source, :mod:`rltk.registration.source`): ``obj`` imports it on first use; ``described`` is what checking a
    config needs, read from the source while the module is not imported (so ``rltk validate`` needs no torch).
    """

    def __init__(self, kind: str, name: str, obj: Any = _UNLOADED, plugin: str = "", overrides: str | None = None,
                 *, ref: str | None = None):
        if obj is _UNLOADED and ref is None:
            raise TypeError("Entry needs the component or a reference to it")
        self.kind, self.name, self.plugin, self.overrides, self.ref = kind, name, plugin, overrides, ref
        self._obj = obj
        self._described: Any = _UNLOADED

    def __repr__(self) -> str:
        return f"Entry({self.kind!r}, {self.name!r}, plugin={self.plugin!r})"

    @property
    def obj(self) -> Any:
        """The component itself (imported now if it was registered by reference)."""
        if self._obj is _UNLOADED:
            module, _, attribute = self.ref.partition(":")
            obj = importlib.import_module(module)
            for part in attribute.split("."):
                obj = getattr(obj, part)
            _check_component(KINDS[self.kind], self.name, obj, self.plugin)
            self._obj = obj
        return self._obj

    @property
    def loaded(self) -> bool:
        return self._obj is not _UNLOADED

    @property
    def described(self) -> Any:
        """What a config check reads of the component: the component once its module is imported, else its
        description read from the source (:class:`rltk.registration.source.Described`: the same signature,
        type hints, docstring and literal class attributes), else the component itself."""
        if self._obj is not _UNLOADED or self.ref.partition(":")[0] in sys.modules:
            return self.obj
        if self._described is _UNLOADED:
            from rltk.registration.source import describe

            self._described = describe(self.ref, lambda: self.obj)
        return self._described if self._described is not None else self.obj

    @property
    def summary(self) -> str:
        described = self.described
        doc = inspect.getdoc(described) if not isinstance(described, dict) else described.get("description", "")
        return (doc or "").strip().splitlines()[0] if doc else ""


@dataclass
class PluginInfo:
    """What one loaded plugin is and registers."""

    name: str
    distribution: str
    version: str
    module: str
    components: dict[str, list[str]] = field(default_factory=dict)


def closest(name: str, valid: list[str], n: int = 3) -> list[str]:
    """The valid names closest to ``name`` (difflib ratio, then prefix matches)."""
    close = difflib.get_close_matches(name, valid, n=n, cutoff=0.5)
    for v in valid:
        if len(close) >= n:
            break
        if v not in close and (v.startswith(name) or name.startswith(v)) and name:
            close.append(v)
    return close


def did_you_mean(name: object, valid: list[str]) -> str:
    """`` Did you mean: 'a', 'b'?`` naming the valid names closest to ``name``, or ``""`` when none is close."""
    close = closest(str(name), valid)
    return (" Did you mean: " + ", ".join(f"'{c}'" for c in close) + "?") if close else ""


def unknown_name_message(what: str, name: str, valid: list[str], where: str | None = None) -> str:
    """One message shape for every unknown-name error in rltk."""
    at = f" at '{where}'" if where else ""
    msg = f"unknown {what} '{name}'{at}." + did_you_mean(name, valid)
    msg += " Valid: " + (", ".join(sorted(valid)) if valid else "(none registered)")
    return msg


class Registry:
    """Components by kind and name, collected from every loaded plugin."""

    def __init__(self, pm: pluggy.PluginManager):
        self.pm = pm
        self.entries: dict[str, dict[str, Entry]] = {k: {} for k in KINDS}
        self.plugins: dict[str, PluginInfo] = {}

    def collect(self, plugin: object, info: PluginInfo) -> None:
        """Record what ``plugin`` registers; a name clash names both plugins.

        All or nothing: a plugin that fails any check registers none of its
        components, so a caller that catches the error keeps a consistent registry.
        """
        added: list[Entry] = []
        for kind in KINDS.values():
            impl = getattr(plugin, kind.hook, None)
            if impl is None:
                continue
            try:
                provided = impl()
            except Exception as exc:
                raise PluginLoadError(
                    f"plugin '{info.name}' (distribution '{info.distribution}') failed in "
                    f"{kind.hook}(): {type(exc).__name__}: {exc}"
                ) from exc
            if provided is None:
                continue
            if not isinstance(provided, dict):
                raise PluginLoadError(
                    f"plugin '{info.name}': {kind.hook}() must return a dict {{name: component}}, "
                    f"got {type(provided).__name__}"
                )
            for name, obj in provided.items():
                replaced = None
                if not isinstance(name, str) or not name:
                    raise PluginLoadError(
                        f"plugin '{info.name}': {kind.hook}() returned the name {name!r}; names are the non-empty "
                        f"strings configs use (e.g. {{'my_{kind.name}': ...}})"
                    )
                if isinstance(obj, Override):
                    obj = obj.component
                    replaced = self.entries[kind.name].get(name)
                    if replaced is None:
                        raise PluginLoadError(
                            f"plugin '{info.name}' overrides {kind.name} '{name}', but no plugin loaded "
                            f"before it registers that name (builtins load first; check the name)."
                        )
                elif name in self.entries[kind.name]:
                    other = self.entries[kind.name][name]
                    raise RegistryError(
                        f"{kind.name} '{name}' is registered by two plugins: '{other.plugin}' and "
                        f"'{info.name}'. Rename one, or return rltk.override(component) from "
                        f"'{info.name}' if it is meant to replace the other."
                    )
                _check_component(kind, name, obj, info.name)
                added.append(Entry(kind.name, name, obj, info.name, replaced.plugin if replaced else None))
        self.plugins[info.name] = info
        for entry in added:
            self.entries[entry.kind][entry.name] = entry
            info.components.setdefault(entry.kind, []).append(entry.name)

    def kind(self, kind: str) -> Kind:
        if kind not in KINDS:
            raise RegistryError(unknown_name_message("component kind", kind, list(KINDS)))
        return KINDS[kind]

    def entry(self, kind: str, name: str, where: str | None = None) -> Entry:
        self.kind(kind)
        table = self.entries[kind]
        if name not in table:
            raise RegistryError(unknown_name_message(kind, name, list(table), where))
        return table[name]


def _check_component(kind: Kind, name: str, obj: Any, plugin: str) -> None:
    """Refuse at registration what could only fail later, on every call: a preset that is not a
    mapping, any other component that is not callable."""
    if kind.name == "algorithm":
        if not isinstance(obj, Mapping):
            raise PluginLoadError(
                f"plugin '{plugin}': {kind.hook}() registers algorithm preset '{name}' as "
                f"{type(obj).__name__} {obj!r:.60}; a preset is a dict of algorithm.* defaults"
            )
    elif not callable(obj):
        raise PluginLoadError(
            f"plugin '{plugin}': {kind.hook}() registers {kind.name} '{name}' as {type(obj).__name__} "
            f"{obj!r:.60}, which cannot be called; return the function or class itself, "
            f"{{'{name}': my_{kind.name}}}"
        )


def _spec_arguments() -> dict[str, list[str]]:
    """Every hook spec's name and argument names."""
    return {
        name: list(inspect.signature(fn).parameters)
        for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
        if name.startswith("rltk_")
    }


def _check_hooks(pm: pluggy.PluginManager, plugin: object, name: str) -> None:
    """Refuse what pluggy would take silently or report as a bare traceback.

    * a function named ``rltk_*`` that matches no hook spec (a misspelt
      ``rltk_reward_fnz`` would register nothing);
    * an implementation with a required argument its spec does not offer;
    * a lifecycle hook without ``@rltk.hookimpl`` (pluggy would never call it;
      component hooks are read by name and work either way).

    Raises :class:`PluginLoadError` naming the plugin, the hook and what is valid.
    """
    specs = _spec_arguments()
    for attr in dir(plugin):
        if not attr.startswith("rltk_"):
            continue
        try:
            fn = getattr(plugin, attr)
        except Exception:  # a lazy attribute that fails to load is not a hook
            continue
        marked = pm.parse_hookimpl_opts(plugin, attr) is not None
        if not (marked or inspect.isroutine(fn)):
            continue
        if attr not in specs:
            raise PluginLoadError(
                f"plugin '{name}' defines {attr}(), which is not an rltk hook, so it would never be called."
                f"{did_you_mean(attr, list(specs))} Hooks: {', '.join(sorted(specs))} (rltk/hookspecs.py; a hook "
                f"of a newer rltk needs that version)"
            )
        if attr not in COMPONENT_HOOKS and not marked:
            raise PluginLoadError(
                f"plugin '{name}' defines {attr}() without @rltk.hookimpl, so rltk would never call it; "
                f"decorate it with @rltk.hookimpl"
            )
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            continue
        required = [p.name for p in params if p.default is p.empty
                    and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        unknown = [a for a in required if a not in specs[attr]]
        if unknown:
            offered = f"({', '.join(specs[attr])})" if specs[attr] else "no arguments"
            raise PluginLoadError(
                f"plugin '{name}': {attr}() takes {', '.join(repr(a) for a in unknown)}, which the hook does not "
                f"pass; {attr} offers {offered}. An implementation may take any subset of them"
            )


def _register(registry: Registry, module: object, info: PluginInfo) -> None:
    """Check ``module``'s hooks, register it with pluggy and collect its components, or raise
    :class:`PluginLoadError` leaving the registry as it was."""
    pm = registry.pm
    _check_hooks(pm, module, info.name)
    try:
        pm.register(module, name=info.name)
    except pluggy.PluginValidationError as exc:  # what _check_hooks does not foresee, still named
        raise PluginLoadError(f"plugin '{info.name}' (distribution '{info.distribution}'): {exc}") from exc
    try:
        registry.collect(module, info)
    except BaseException:
        pm.unregister(name=info.name)
        raise


def _load_entry_points(pm: pluggy.PluginManager, registry: Registry, builtins_only: bool) -> None:
    eps = importlib_metadata.entry_points(group=ENTRY_POINT_GROUP)
    # Builtins first so third-party overrides find what they replace; then by
    # distribution and name so the order never depends on the file system.
    def order(ep):
        dist = ep.dist.name if ep.dist else ""
        return (dist != PROJECT, dist, ep.name)

    seen: set[tuple[str, str]] = set()
    for ep in sorted(eps, key=order):
        dist = ep.dist.name if ep.dist else "<unknown distribution>"
        key = (dist, ep.name)
        if key in seen:  # the same distribution visible twice on sys.path
            continue
        seen.add(key)
        if builtins_only and dist != PROJECT:
            continue
        plugin_name = f"{dist}:{ep.name}"
        version = ep.dist.version if ep.dist else "?"
        if dist == PROJECT and _register_from_source(registry, ep.value, PluginInfo(plugin_name, dist, version,
                                                                                    ep.value)):
            continue
        try:
            module = ep.load()
        except Exception as exc:
            raise PluginLoadError(
                f"plugin entry point '{ep.name} = {ep.value}' of distribution '{dist}' failed to "
                f"import: {type(exc).__name__}: {exc}. Fix or uninstall it (pip uninstall {dist}), "
                f"or set RLTK_DISABLE_PLUGIN_AUTOLOAD=1 to load builtins only."
            ) from exc
        _register(registry, module, PluginInfo(plugin_name, dist, version, ep.value))


def _register_from_source(registry: Registry, module: str, info: PluginInfo) -> bool:
    """Register rltk's own registration module ``module`` by reference, read from its source without importing
    it (its components import when first used); False when its source cannot say exactly what it registers.

    Only rltk's own modules are read so: a builtin never overrides and has no lifecycle hooks, which this
    leaves out (tests/test_builtin_registrations_from_source.py holds each builtin to what importing it gives)."""
    if ":" in module or module in sys.modules:
        return False
    from rltk.registration.source import read_registrations

    found = read_registrations(module, {kind.hook: kind.name for kind in KINDS.values()})
    if found is None:
        return False
    added = []
    for kind in (k for k in KINDS if k in found):  # in the order collect() reads a module's hooks
        for name, ref in found[kind].items():
            if name in registry.entries[kind]:
                other = registry.entries[kind][name]
                raise RegistryError(f"{kind} '{name}' is registered by two plugins: '{other.plugin}' and "
                                    f"'{info.name}'")
            added.append(Entry(kind, name, plugin=info.name, ref=ref))
    registry.plugins[info.name] = info
    for entry in added:
        registry.entries[entry.kind][entry.name] = entry
        info.components.setdefault(entry.kind, []).append(entry.name)
    return True


_lock = threading.Lock()
_registry: Registry | None = None


def get_registry(reload: bool = False) -> Registry:
    """The process-wide registry, loaded from entry points on first use."""
    global _registry
    with _lock:
        if _registry is None or reload:
            pm = pluggy.PluginManager(PROJECT)
            pm.add_hookspecs(hookspecs)
            registry = Registry(pm)
            builtins_only = os.environ.get("RLTK_DISABLE_PLUGIN_AUTOLOAD", "") not in ("", "0")
            _load_entry_points(pm, registry, builtins_only)
            _registry = registry
        return _registry


def get_plugin_manager() -> pluggy.PluginManager:
    """The pluggy manager, for lifecycle hooks: ``get_plugin_manager().hook.rltk_on_step_end(...)``."""
    return get_registry().pm


def register_plugin(module: object, name: str | None = None) -> None:
    """Register an in-process plugin (tests, notebooks) as if it came from an entry point."""
    registry = get_registry()
    name = name or getattr(module, "__name__", repr(module))
    _register(registry, module, PluginInfo(name, "<in-process>", "", getattr(module, "__name__", "")))


def unregister_plugin(name: str) -> None:
    """Remove an in-process plugin registered with :func:`register_plugin`."""
    registry = get_registry()
    registry.pm.unregister(name=name)
    info = registry.plugins.pop(name, None)
    if info:
        for kind, names in info.components.items():
            for n in names:
                e = registry.entries[kind].get(n)
                if e is not None and e.plugin == name:
                    del registry.entries[kind][n]


def call_lifecycle_hook(hook: str, **kwargs: Any) -> list:
    """Call every plugin's implementation of lifecycle hook ``hook`` (``rltk_on_step_end`` ...).

    Policy: a lifecycle hook may stop a run. Whatever an implementation raises
    (other than ``KeyboardInterrupt``/``SystemExit``, which pass through) ends
    the run as a :class:`LifecycleHookError` that names the plugin, the hook
    and the step, with the plugin's exception chained; implementations after
    it are not called. Checkpoints written before it stay, so the run can be
    resumed. A hook that must never stop training catches its own errors.
    """
    caller = getattr(get_plugin_manager().hook, hook)
    try:
        return caller(**kwargs)
    except Exception as exc:
        impls = caller.get_hookimpls()
        culprit = _raising_hookimpl(exc, impls)
        at = f" at step {kwargs['step']}" if "step" in kwargs else ""
        if culprit is not None:
            who, plugin = f"plugin '{culprit.plugin_name}'", culprit.plugin_name
        else:  # raised outside any implementation's own code (e.g. pluggy calling it)
            plugin = None
            who = "one of the plugins " + ", ".join(f"'{i.plugin_name}'" for i in impls)
        raise LifecycleHookError(
            f"{who} raised in its {hook} hook{at}: {type(exc).__name__}: {exc}. A lifecycle hook that raises "
            f"stops the run (checkpoints written so far are kept; fix the plugin and resume, or uninstall it)",
            plugin, hook,
        ) from exc


def _raising_hookimpl(exc: BaseException, impls: list) -> Any:
    """The implementation whose own code is on ``exc``'s traceback (the outermost one), if any.

    Code shared by several implementations (one factory's closures, a decorator
    without ``functools.wraps``) identifies none of them, so it is skipped.
    """
    by_code: dict[Any, list] = {}
    for impl in impls:
        code = getattr(inspect.unwrap(impl.function), "__code__", None)
        if code is not None:
            by_code.setdefault(code, []).append(impl)
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        owners = by_code.get(frame.f_code, [])
        if len(owners) == 1:
            return owners[0]
    return None


def get_component(kind: str, name: str) -> Any:
    """The component registered as ``name`` for ``kind``.

    Raises :class:`RegistryError` naming the kind, the closest names and all
    valid ones when ``name`` is unknown.
    """
    return get_registry().entry(kind, name).obj


def list_components(kind: str | None = None) -> list[Entry]:
    """Registered components (of one kind, or all), sorted by kind and name."""
    registry = get_registry()
    kinds = [registry.kind(kind).name] if kind else list(KINDS)
    return [registry.entries[k][n] for k in kinds for n in sorted(registry.entries[k])]
