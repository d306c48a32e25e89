"""Weighted combinations of reward functions that survive a failing or hanging component.

:class:`RewardComposer` scores one sample with several reward functions and
returns the weighted sum plus each component's score, so the recipe can log
every component. A component that raises, returns something that is not a
finite number, or runs longer than ``timeout_s`` gives that sample the
``fallback`` score for that component; the failure is counted, warned about
once per component, and training goes on.

Timeouts and their trade-off: Python cannot kill a thread, and a process per
call would cost milliseconds and require picklable reward functions. So each
call with a timeout runs in a fresh *daemon* thread that the caller waits for
at most ``timeout_s``: a hung reward function no longer blocks training (nor
interpreter exit, which a ``ThreadPoolExecutor`` worker would), but it keeps
running in the background, holding its CPU and memory until it returns. The
number of such abandoned threads is reported by :meth:`RewardComposer.stats`
(``abandoned_threads``) so a leak shows up in the logs. The thread costs about
0.1 ms per component and sample (a 4 x 8 GRPO step with two rewards: ~6 ms);
``timeout_s=None`` calls inline with no protection against hangs, for reward
functions you trust.

The limit of threads: a timeout interrupts waiting (network, sleep) and
pure-Python loops, but not one long C call that holds the GIL, such as a
catastrophically backtracking regex or ``9**9**9`` on big integers; that
freezes every thread until it returns. The builtin rewards therefore bound
their inputs before any such work (see :mod:`rltk.rewards.countdown`); a
reward that must run untrusted heavy code belongs in a subprocess of its own.
"""

from __future__ import annotations

import inspect
import math
import threading
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

PROVIDED_ARGS = ("prompt", "response", "ground_truth", "extras")


@dataclass
class RewardSpec:
    """One component of a composed reward: a named function, its weight and its arguments."""

    name: str
    fn: Callable[..., Any]
    weight: float = 1.0
    args: dict[str, Any] = field(default_factory=dict)


class RewardTimeout(TimeoutError):
    """A reward function ran longer than the composer's ``timeout_s``."""


class RewardComposer:
    """Score a sample with several reward functions: ``sum_i weight_i * score_i``.

    Each reward function is called as ``fn(prompt=..., response=...,
    ground_truth=..., extras=..., **args)`` (a function may leave out the
    sample fields it does not use) and returns a float, or a dict of
    named floats whose ``"score"`` entry (or, without one, whose sum) is its
    score; the other entries are reported as ``"<name>/<key>"`` details.

    Args:
        specs: the components, as :class:`RewardSpec` or ``(name, fn, weight,
            args)`` tuples. Names must be unique (they key the details).
        fallback: the score a component gives a sample on which it failed.
        timeout_s: longest a component may run on one sample (seconds);
            ``None`` runs components inline with no timeout.

    Raises ``ValueError`` at construction for duplicate names, non-finite
    weights, arguments the function does not accept, arguments the caller
    provides (``prompt``, ``response``, ``ground_truth``, ``extras``) and
    missing required arguments, each naming the reward and its valid args.

    Example::

        composer = RewardComposer([("math", math_answer, 1.0, {}),
                                   ("format", format_tags, 0.1, {"tags": ["answer"]})])
        score, details = composer(prompt, response, ground_truth, extras)
        # details == {"math": 1.0, "format": 0.0}; score == 1.0
    """

    def __init__(
        self,
        specs: Sequence[RewardSpec | tuple],
        *,
        fallback: float = 0.0,
        timeout_s: float | None = 5.0,
    ):
        self.specs = [spec if isinstance(spec, RewardSpec) else RewardSpec(*spec) for spec in specs]
        if not self.specs:
            raise ValueError("RewardComposer needs at least one reward function")
        if not _is_finite_number(fallback):
            raise ValueError(f"reward fallback must be a finite number, got {fallback!r}")
        if timeout_s is not None and not (_is_finite_number(timeout_s) and timeout_s > 0):
            raise ValueError(f"reward timeout_s must be a positive number of seconds or None, got {timeout_s!r}")
        self.fallback = float(fallback)
        self.timeout_s = timeout_s
        seen: set[str] = set()
        for spec in self.specs:
            if spec.name in seen:
                raise ValueError(
                    f"reward '{spec.name}' appears twice; give each component a distinct name "
                    f"(the names key the logged scores)"
                )
            seen.add(spec.name)
            if not _is_finite_number(spec.weight):
                raise ValueError(f"reward '{spec.name}': weight must be a finite number, got {spec.weight!r}")
            spec.weight = float(spec.weight)
            spec.args = dict(spec.args or {})
            validate_reward_args(spec.name, spec.fn, spec.args)
        # Functions may leave out sample fields they do not use (e.g. prompt).
        self._sample_fields = {spec.name: _accepted_sample_fields(spec.fn) for spec in self.specs}
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self._abandoned: list[threading.Thread] = []
        self.failures: dict[str, int] = {}
        self.timeouts: dict[str, int] = {}
        self.calls = 0
        self.reset_stats()

    @property
    def names(self) -> list[str]:
        """Component names, in order."""
        return [spec.name for spec in self.specs]

    def __call__(
        self, prompt: str, response: str, ground_truth: str, extras: dict | None = None
    ) -> tuple[float, dict[str, float]]:
        """Score one sample: ``(weighted sum, {component name: its score, ...})``."""
        sample = {"prompt": prompt, "response": response, "ground_truth": ground_truth, "extras": extras or {}}
        total = 0.0
        details: dict[str, float] = {}
        for spec in self.specs:
            score, extra_details = self._score_one(spec, sample)
            details[spec.name] = score
            details.update(extra_details)
            total += spec.weight * score
        with self._lock:
            self.calls += 1
        return total, details

    def stats(self) -> dict[str, float]:
        """Counts since the last :meth:`reset_stats`, flat for a metrics logger.

        ``calls``, ``failures/<name>``, ``timeouts/<name>`` (timeouts are also
        counted as failures) and ``abandoned_threads`` (timed-out calls still
        running now).
        """
        with self._lock:
            self._abandoned = [t for t in self._abandoned if t.is_alive()]
            out: dict[str, float] = {"calls": float(self.calls)}
            for name in self.names:
                out[f"failures/{name}"] = float(self.failures[name])
                out[f"timeouts/{name}"] = float(self.timeouts[name])
            out["abandoned_threads"] = float(len(self._abandoned))
            return out

    def reset_stats(self) -> None:
        """Zero the call, failure and timeout counts (e.g. after logging them)."""
        with self._lock:
            self.calls = 0
            self.failures = {name: 0 for name in self.names}
            self.timeouts = {name: 0 for name in self.names}

    def state_dict(self) -> dict[str, Any]:
        """The cumulative counters, JSON-able, for a checkpoint: ``{"calls", "failures", "timeouts"}``.

        ``failures`` and ``timeouts`` map each component name to its count. A
        resumed run that loads this with :meth:`load_state_dict` keeps counting
        from where the interrupted one stopped, so the logged ``reward_fn/*``
        numbers equal those of a run that was never interrupted. Abandoned
        threads are not state: they do not outlive the process.
        """
        with self._lock:
            return {"calls": int(self.calls), "failures": dict(self.failures), "timeouts": dict(self.timeouts)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue counting from ``state``, a :meth:`state_dict` of a composer with the same components.

        Raises ``ValueError`` naming the offending entry when ``state`` lacks a
        counter, holds a count that is not an integer >= 0, or names other
        components than this composer's (counts of another reward setup would
        be logged under the wrong names).
        """
        if not isinstance(state, Mapping) or set(state) != {"calls", "failures", "timeouts"}:
            got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"RewardComposer.load_state_dict: expected the keys ['calls', 'failures', 'timeouts'] "
                             f"of RewardComposer.state_dict(), got {got}")
        _check_count("calls", state["calls"])
        for kind in ("failures", "timeouts"):
            counts = state[kind]
            if not isinstance(counts, Mapping) or set(counts) != set(self.names):
                got = sorted(counts) if isinstance(counts, Mapping) else repr(counts)
                raise ValueError(f"RewardComposer.load_state_dict: state['{kind}'] counts the reward(s) {got}, "
                                 f"but this composer's are {self.names}; the counts of another reward setup "
                                 f"cannot continue here")
            for name, count in counts.items():
                _check_count(f"{kind}['{name}']", count)
        with self._lock:
            self.calls = int(state["calls"])
            self.failures = {name: int(state["failures"][name]) for name in self.names}
            self.timeouts = {name: int(state["timeouts"][name]) for name in self.names}

    def _score_one(self, spec: RewardSpec, sample: dict) -> tuple[float, dict[str, float]]:
        try:
            result = self._call(spec, sample)
            return _as_score(spec.name, result)
        except Exception as exc:
            self._record_failure(spec.name, exc)
            return self.fallback, {}

    def _call(self, spec: RewardSpec, sample: dict) -> Any:
        kwargs = {k: v for k, v in sample.items() if k in self._sample_fields[spec.name]}
        kwargs.update(spec.args)
        if self.timeout_s is None:
            return spec.fn(**kwargs)
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["value"] = spec.fn(**kwargs)
            except BaseException as exc:  # even sys.exit() in a reward must not end training
                outcome["error"] = exc if isinstance(exc, Exception) else RuntimeError(repr(exc))

        worker = threading.Thread(target=run, name=f"rltk-reward-{spec.name}", daemon=True)
        worker.start()
        worker.join(self.timeout_s)
        if worker.is_alive():
            with self._lock:
                self._abandoned.append(worker)
                self.timeouts[spec.name] += 1
            raise RewardTimeout(f"reward '{spec.name}' took longer than timeout_s={self.timeout_s}")
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def _record_failure(self, name: str, exc: BaseException) -> None:
        with self._lock:
            self.failures[name] += 1
            first = name not in self._warned
            self._warned.add(name)
        if first:
            where = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-3))
            warnings.warn(
                f"reward '{name}' failed on a sample ({type(exc).__name__}: {exc}); that sample gets "
                f"fallback={self.fallback} for '{name}' and training continues. Further failures are "
                f"counted in stats()['failures/{name}'] without a warning.\n{where}",
                RuntimeWarning,
                stacklevel=3,
            )


def validate_reward_args(name: str, fn: Callable, args: Mapping[str, Any]) -> None:
    """Check ``args`` against ``fn``'s signature; raise ``ValueError`` naming the reward and its valid args."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins without a signature: nothing to check
        return
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    configurable = [
        p for p in params.values()
        if p.name not in PROVIDED_ARGS and p.kind in (inspect.Parameter.KEYWORD_ONLY,
                                                       inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    valid = ", ".join(p.name for p in configurable) or "(none)"
    provided = sorted(set(args) & set(PROVIDED_ARGS))
    if provided:
        raise ValueError(
            f"reward '{name}': argument(s) {provided} are filled in for every sample and cannot be "
            f"configured. Valid args: {valid}"
        )
    if not accepts_any:
        unknown = sorted(set(args) - {p.name for p in configurable})
        if unknown:
            raise ValueError(f"reward '{name}' has no argument(s) {unknown}. Valid args: {valid}")
    missing = [p.name for p in configurable if p.default is inspect.Parameter.empty and p.name not in args]
    if missing:
        raise ValueError(f"reward '{name}' needs argument(s) {missing}; set them in its args. Valid args: {valid}")


def build_reward_composer(
    names_or_specs: str | Sequence[str | Mapping[str, Any]],
    weights: Sequence[float] | Mapping[str, float] | None = None,
    args: Mapping[str, Mapping[str, Any]] | None = None,
    fallback: float = 0.0,
    timeout_s: float | None = 5.0,
) -> RewardComposer:
    """A :class:`RewardComposer` over registered reward functions (kind ``reward_fn``).

    Components are given by registered name (``"math_answer"`` or
    ``["math_answer", "format_tags"]``) or as mappings ``{"fn":
    "format_tags", "name": "strict_format", "weight": 0.1, "args": {...}}``
    (``name`` defaults to ``fn``; use it to register one function twice with
    different args). ``weights`` is a list in component order or a mapping
    by name (missing names weigh 1.0); ``args`` maps a component name to its
    arguments. OmegaConf containers are accepted as they are.
    """
    import rltk  # deferred: rltk.registry imports the builtin plugins, which import this module

    names_or_specs = _plain(names_or_specs)
    weights, args = _plain(weights), _plain(args) or {}
    if isinstance(names_or_specs, str):
        names_or_specs = [names_or_specs]
    entries: list[dict[str, Any]] = []
    for i, item in enumerate(names_or_specs):
        if isinstance(item, str):
            entries.append({"fn": item, "name": item})
        elif isinstance(item, Mapping):
            if "fn" not in item and "name" not in item:
                raise ValueError(f"reward.fns[{i}] = {item!r} needs 'fn' (a registered reward_fn name)")
            unknown = sorted(set(item) - {"fn", "name", "weight", "args"})
            if unknown:
                raise ValueError(f"reward.fns[{i}] has unknown key(s) {unknown}. Valid: fn, name, weight, args")
            entry = dict(item)
            entry.setdefault("fn", entry.get("name"))
            entry.setdefault("name", entry["fn"])
            entries.append(entry)
        else:
            raise TypeError(f"reward.fns[{i}] must be a name or a mapping, got {type(item).__name__}: {item!r}")
    names = [e["name"] for e in entries]
    if isinstance(weights, Sequence) and not isinstance(weights, str):
        if len(weights) != len(entries):
            raise ValueError(
                f"reward.weights has {len(weights)} entries for {len(entries)} reward functions {names}; "
                f"give one weight per function, or a mapping by name"
            )
        for entry, weight in zip(entries, weights):
            entry["weight"] = weight
    elif isinstance(weights, Mapping):
        unknown = sorted(set(weights) - set(names))
        if unknown:
            raise ValueError(f"reward.weights names unknown reward(s) {unknown}. Valid: {', '.join(names)}")
        for entry in entries:
            if entry["name"] in weights:
                entry["weight"] = weights[entry["name"]]
    elif weights is not None:
        raise TypeError(f"reward.weights must be a list or a mapping, got {type(weights).__name__}")
    unknown = sorted(set(args) - set(names))
    if unknown:
        raise ValueError(f"reward.args names unknown reward(s) {unknown}. Valid: {', '.join(names)}")
    specs = []
    for entry in entries:
        fn = rltk.get_component("reward_fn", entry["fn"])
        merged = {**(entry.get("args") or {}), **(args.get(entry["name"]) or {})}
        specs.append(RewardSpec(entry["name"], fn, entry.get("weight", 1.0), merged))
    return RewardComposer(specs, fallback=fallback, timeout_s=timeout_s)


def _as_score(name: str, result: Any) -> tuple[float, dict[str, float]]:
    details: dict[str, float] = {}
    if isinstance(result, Mapping):
        for key, value in result.items():
            if not _is_finite_number(value):
                raise TypeError(f"reward '{name}' returned {key}={value!r}, not a finite number")
            details[f"{name}/{key}"] = float(value)
        if "score" in result:
            score = float(result["score"])
            details.pop(f"{name}/score")
        else:
            score = sum(float(v) for v in result.values())
        return score, details
    if not _is_finite_number(result):
        raise TypeError(f"reward '{name}' returned {result!r}; expected a finite float or a dict of them")
    return float(result), details


def _accepted_sample_fields(fn: Callable) -> frozenset[str]:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return frozenset(PROVIDED_ARGS)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return frozenset(PROVIDED_ARGS)
    return frozenset(a for a in PROVIDED_ARGS if a in params)


def _check_count(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"RewardComposer.load_state_dict: state['{key}'] = {value!r} must be an integer >= 0")


def _is_finite_number(value: Any) -> bool:
    if isinstance(value, (str, bytes)):
        return False
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def _plain(value: Any) -> Any:
    """OmegaConf containers as plain Python, anything else unchanged."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        return value
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value
