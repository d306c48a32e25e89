"""Weighted combinations of reward functions that survive a failing or hanging component.

:class:`RewardComposer` scores one sample with several reward functions and
returns the weighted sum plus each component's score, so the recipe can log
every component. A component that raises, returns something that is not a
finite number, or runs longer than ``timeout_s`` gives that sample the
``fallback`` score for that component; the failure is counted, warned about
once per component, and training goes on.

How components run (the speed and the safety of a step):

* A builtin, or any function marked :func:`rltk.rewards.bounded`
  (its work is capped on any input), runs in this process: one plain call per
  sample in a single pass over the step's samples, no timeout, no thread.
* Any other function runs in a pool of ``workers`` worker processes
  (:class:`rltk.rewards.pool.RewardWorkerPool`) under ``timeout_s`` per call:
  all samples of a step are submitted at once and timed in parallel, and a
  call that overruns has its process killed and replaced, so it stops using
  CPU at once and one hung sample costs at most one timeout per step. A
  worker that crashes fails the sample it was scoring. The pool starts on the
  first call and is reused by every later one; :meth:`RewardComposer.close`
  (or interpreter exit, or Ctrl-C during scoring) stops it.
* A function marked :func:`rltk.rewards.batched` (a reward model, an LLM
  judge: its cost is per call, and it caps its own time) runs in this process
  too, called once per :meth:`RewardComposer.score_batch` with every sample.
* ``timeout_s=None`` runs every function in-process with no timeout, for
  rewards you trust.

Worker processes get each function by reference (pickle), so an unmarked
function must be defined at the top level of an importable module; a lambda
or a closure is refused when the composer is built, naming the reward (mark
it bounded, move it to module level, or set ``timeout_s=None``). Its
configured arguments must pickle too.
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

from rltk.rewards.marks import is_batched, is_bounded
from rltk.rewards.pool import CallOutcome, RewardWorkerError, RewardWorkerPool, picklable_error

PROVIDED_ARGS = ("prompt", "response", "ground_truth", "extras")


@dataclass
class RewardSpec:
    """One component of a composed reward: a named function, its weight and its arguments."""

    name: str
    fn: Callable[..., Any]
    weight: float = 1.0
    args: dict[str, Any] = field(default_factory=dict)


class RewardTimeout(TimeoutError):
    """A reward function ran longer than the composer's ``timeout_s``.

    Its name is what the failure warning reports for such a call; the call's
    worker process has been killed by then, so nothing of it keeps running.
    """


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
        timeout_s: longest a component not marked bounded may run on one
            sample (seconds), counted from when a worker process takes the
            call; ``None`` runs every component in-process with no timeout.
        workers: worker processes for the components not marked bounded
            (started on first use, only if there are such components).

    Raises ``ValueError`` at construction for duplicate names, non-finite
    weights, arguments the function does not accept, arguments the caller
    provides (``prompt``, ``response``, ``ground_truth``, ``extras``) and
    missing required arguments, each naming the reward and its valid args,
    and for a component that must run in a worker process but cannot be
    pickled (a lambda, a closure), naming the reward and the ways out.

    Example::

        composer = RewardComposer([("math", math_answer, 1.0, {}),
                                   ("format", format_tags, 0.1, {"tags": ["answer"]})])
        score, details = composer(prompt, response, ground_truth, extras)
        # details == {"math": 1.0, "format": 0.0}; score == 1.0
        results = composer.score_batch([{"prompt": ..., "response": ..., ...}, ...])
        composer.close()  # stop worker processes, if any were started
    """

    def __init__(
        self,
        specs: Sequence[RewardSpec | tuple],
        *,
        fallback: float = 0.0,
        timeout_s: float | None = 5.0,
        workers: int = 4,
    ):
        self.specs = [spec if isinstance(spec, RewardSpec) else RewardSpec(*spec) for spec in specs]
        if not self.specs:
            raise ValueError("RewardComposer needs at least one reward function")
        if not _is_finite_number(fallback):
            raise ValueError(f"reward fallback must be a finite number, got {fallback!r}")
        if timeout_s is not None and not (_is_finite_number(timeout_s) and timeout_s > 0):
            raise ValueError(f"reward timeout_s must be a positive number of seconds or None, got {timeout_s!r}")
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise ValueError(
                f"reward.workers must be an integer >= 1 (worker processes for rewards not marked bounded), "
                f"got {workers!r}"
            )
        self.fallback = float(fallback)
        self.timeout_s = timeout_s
        self.workers = workers
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
        self._batched = [is_batched(spec.fn) for spec in self.specs]
        # Which components need a worker process: unbounded ones, when there is a timeout to enforce
        # (a batched one caps its own time: it runs here, once per batch).
        self._isolated = [timeout_s is not None and not batched and not is_bounded(spec.fn, spec.args)
                          for spec, batched in zip(self.specs, self._batched)]
        for spec, isolated in zip(self.specs, self._isolated):
            if isolated:
                _check_picklable(spec)
        self._pool: RewardWorkerPool | None = None
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self.worker_restarts = 0
        self.failures: dict[str, int] = {}
        self.timeouts: dict[str, int] = {}
        self.calls = 0
        self.reset_stats()

    @property
    def names(self) -> list[str]:
        """Component names, in order."""
        return [spec.name for spec in self.specs]

    @property
    def in_process(self) -> list[str]:
        """Names of the components called in this process (bounded ones, or all when ``timeout_s`` is None)."""
        return [spec.name for spec, isolated in zip(self.specs, self._isolated) if not isolated]

    def __call__(
        self, prompt: str, response: str, ground_truth: str, extras: dict | None = None
    ) -> tuple[float, dict[str, float]]:
        """Score one sample: ``(weighted sum, {component name: its score, ...})``.

        Scoring a step's samples one by one gives up the parallel timeouts; a
        workflow should call :meth:`score_batch` once per step instead.
        """
        return self.score_batch([{"prompt": prompt, "response": response, "ground_truth": ground_truth,
                                  "extras": extras}])[0]

    def score_batch(self, samples: Sequence[Mapping[str, Any]]) -> list[tuple[float, dict[str, float]]]:
        """Score many samples at once: ``[(weighted sum, details), ...]``, in order.

        Each sample is a mapping with ``prompt``, ``response``,
        ``ground_truth`` and optionally ``extras``. Components in worker
        processes get every sample submitted together, and in-process
        components are computed while those run, so a step pays one round of
        worker latency and at most one ``timeout_s`` for its hung calls.

        Raises :class:`rltk.rewards.pool.RewardWorkerError` if an isolated
        component cannot be loaded in a worker process (a configuration
        error, not a bad sample).
        """
        out = []
        for per_spec in self.outcomes(samples):
            total = 0.0
            details: dict[str, float] = {}
            for spec, outcome in zip(self.specs, per_spec):
                score, extra_details = self._from_outcome(spec, outcome)
                details[spec.name] = score
                details.update(extra_details)
                total += spec.weight * score
            out.append((total, details))
        with self._lock:
            self.calls += len(samples)
        return out

    def outcomes(self, samples: Sequence[Mapping[str, Any]]) -> list[list[CallOutcome]]:
        """What each component's call made of each sample, before scoring: ``[sample][component]``.

        :meth:`score_batch` turns them into scores (a failed call into ``fallback``, counted); a reward
        service on another machine (:mod:`rltk.rewards.ray_service`) sends them back as they are, so the
        composer that asked counts its failures and timeouts as its own.
        """
        rows = [
            {"prompt": s["prompt"], "response": s["response"], "ground_truth": s["ground_truth"],
             "extras": s.get("extras") or {}}
            for s in samples
        ]
        results: list[list[CallOutcome | None]] = [[None] * len(self.specs) for _ in rows]

        def in_process() -> None:
            for j, (spec, isolated) in enumerate(zip(self.specs, self._isolated)):
                if isolated:
                    continue
                if self._batched[j]:
                    for i, outcome in enumerate(self._call_batched(spec, rows)):
                        results[i][j] = outcome
                    continue
                for i, sample in enumerate(rows):
                    results[i][j] = self._call_in_process(spec, sample)

        calls = [(j, i) for j, isolated in enumerate(self._isolated) if isolated for i in range(len(rows))]
        if calls:
            outcomes = self._worker_pool().run(
                [(j, self._kwargs(self.specs[j], rows[i])) for j, i in calls], while_waiting=in_process)
            for (j, i), outcome in zip(calls, outcomes):
                results[i][j] = outcome
            self._sync_restarts()
        else:
            in_process()
        return results  # type: ignore[return-value]

    def start(self) -> None:
        """Start the worker processes now rather than on the first call (no-op without isolated components)."""
        if any(self._isolated):
            self._worker_pool().start()

    def close(self) -> None:
        """Stop the worker processes (they restart if the composer is called again). Idempotent."""
        if self._pool is not None:
            self._sync_restarts()
            self._pool.close()

    def __enter__(self) -> "RewardComposer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, float]:
        """Counts since the last :meth:`reset_stats`, flat for a metrics logger.

        ``calls`` (samples scored), ``failures/<name>``, ``timeouts/<name>``
        (timeouts are also counted as failures) and ``worker_restarts``
        (worker processes killed after a timeout or found dead, and replaced).
        """
        self._sync_restarts()
        with self._lock:
            out: dict[str, float] = {"calls": float(self.calls)}
            for name in self.names:
                out[f"failures/{name}"] = float(self.failures[name])
                out[f"timeouts/{name}"] = float(self.timeouts[name])
            out["worker_restarts"] = float(self.worker_restarts)
            return out

    def reset_stats(self) -> None:
        """Zero the call, failure, timeout and restart counts (e.g. after logging them)."""
        self._sync_restarts()
        with self._lock:
            self.worker_restarts = 0
            self.calls = 0
            self.failures = {name: 0 for name in self.names}
            self.timeouts = {name: 0 for name in self.names}

    def state_dict(self) -> dict[str, Any]:
        """The cumulative counters, JSON-able, for a checkpoint.

        ``{"calls": int, "failures": {name: int}, "timeouts": {name: int},
        "worker_restarts": int}``. A resumed run that loads this with
        :meth:`load_state_dict` counts on from where the interrupted one
        stopped, so the logged ``reward_fn/*`` numbers equal those of a run
        that was never interrupted.
        """
        self._sync_restarts()
        with self._lock:
            return {"calls": int(self.calls), "failures": dict(self.failures), "timeouts": dict(self.timeouts),
                    "worker_restarts": int(self.worker_restarts)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue counting from ``state``, a :meth:`state_dict` of a composer with the same components.

        Raises ``ValueError`` naming the offending entry when ``state`` lacks a
        counter, holds a count that is not an integer >= 0, or names other
        components than this composer's (counts of another reward setup would
        be logged under the wrong names).
        """
        keys = {"calls", "failures", "timeouts", "worker_restarts"}
        if not isinstance(state, Mapping) or set(state) != keys:
            got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"RewardComposer.load_state_dict: expected the keys {sorted(keys)} of "
                             f"RewardComposer.state_dict(), got {got}")
        _check_count("calls", state["calls"])
        _check_count("worker_restarts", state["worker_restarts"])
        for kind in ("failures", "timeouts"):
            counts = state[kind]
            if not isinstance(counts, Mapping) or set(counts) != set(self.names):
                got = sorted(counts) if isinstance(counts, Mapping) else repr(counts)
                raise ValueError(f"RewardComposer.load_state_dict: state['{kind}'] counts the reward(s) {got}, "
                                 f"but this composer's are {self.names}; the counts of another reward setup "
                                 f"cannot continue here")
            for name, count in counts.items():
                _check_count(f"{kind}['{name}']", count)
        self._sync_restarts()  # restarts the pool counted before the load belong to no run: dropped below
        with self._lock:
            self.calls = int(state["calls"])
            self.failures = {name: int(state["failures"][name]) for name in self.names}
            self.timeouts = {name: int(state["timeouts"][name]) for name in self.names}
            self.worker_restarts = int(state["worker_restarts"])

    def _kwargs(self, spec: RewardSpec, sample: dict) -> dict[str, Any]:
        kwargs = {k: v for k, v in sample.items() if k in self._sample_fields[spec.name]}
        kwargs.update(spec.args)
        return kwargs

    def _call_in_process(self, spec: RewardSpec, sample: dict) -> CallOutcome:
        try:
            return CallOutcome(ok=True, value=spec.fn(**self._kwargs(spec, sample)))
        except BaseException as exc:  # even sys.exit() in a reward must not end training
            if isinstance(exc, KeyboardInterrupt):
                raise
            return _failed(exc)

    def _call_batched(self, spec: RewardSpec, rows: list[dict]) -> list[CallOutcome]:
        """One call with every sample. A batched function returns one value per sample, where a sample's
        value may be the exception it failed with, or (a reward service's) a :class:`CallOutcome`."""
        if not rows:
            return []
        fields = self._sample_fields[spec.name]
        kwargs: dict[str, Any] = {k: [row[k] for row in rows] for k in PROVIDED_ARGS if k in fields}
        kwargs.update(spec.args)
        try:
            values = list(spec.fn(**kwargs))
            if len(values) != len(rows):
                raise ValueError(f"batched reward '{spec.name}' returned {len(values)} scores for {len(rows)} samples")
        except BaseException as exc:  # as for a per-sample call: the batch fails, training goes on
            if isinstance(exc, (KeyboardInterrupt, RewardWorkerError)):  # stop training: not a bad sample
                raise
            return [_failed(exc)] * len(rows)
        return [value if isinstance(value, CallOutcome) else _failed(value) if isinstance(value, BaseException)
                else CallOutcome(ok=True, value=value) for value in values]

    def _from_outcome(self, spec: RewardSpec, outcome: CallOutcome) -> tuple[float, dict[str, float]]:
        if outcome.ok:
            try:
                return _as_score(spec.name, outcome.value)
            except Exception as exc:
                self._record_failure(spec.name, type(exc).__name__, str(exc), "")
                return self.fallback, {}
        if outcome.timed_out:
            with self._lock:
                self.timeouts[spec.name] += 1
        self._record_failure(spec.name, outcome.error_type, outcome.error, outcome.where)
        return self.fallback, {}

    def _worker_pool(self) -> RewardWorkerPool:
        if self._pool is None:
            # Only isolated functions travel (an in-process one may be a lambda); indices stay aligned.
            functions = [(spec.name, spec.fn if isolated else None)
                         for spec, isolated in zip(self.specs, self._isolated)]
            self._pool = RewardWorkerPool(functions, size=self.workers, timeout_s=self.timeout_s)
        return self._pool

    def _sync_restarts(self) -> None:
        # The pool counts since it was created; the composer since its last reset.
        if self._pool is not None:
            with self._lock:
                self.worker_restarts += self._pool.restarts
                self._pool.restarts = 0

    def _record_failure(self, name: str, error_type: str, error: str, where: str) -> None:
        with self._lock:
            self.failures[name] += 1
            first = name not in self._warned
            self._warned.add(name)
        if first:
            warnings.warn(
                f"reward '{name}' failed on a sample ({error_type}: {error}); that sample gets "
                f"fallback={self.fallback} for '{name}' and training continues. Further failures are "
                f"counted in stats()['failures/{name}'] without a warning.\n{where}",
                RuntimeWarning,
                stacklevel=2,
            )


def validate_reward_args(name: str, fn: Callable, args: Mapping[str, Any]) -> None:
    """Check ``args`` against ``fn``'s signature; raise ``ValueError`` naming the reward and its valid args.

    A function with a ``check_args(args)`` attribute (e.g. ``reward_model``: exactly one of ``path`` and
    ``url``) has it called too; the ``ValueError`` it raises is reported under the reward's name.
    """
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
    check_args = getattr(fn, "check_args", None)
    if callable(check_args):
        try:
            check_args(dict(args))
        except ValueError as exc:
            raise ValueError(f"reward '{name}': {exc}") from None


def build_reward_composer(
    names_or_specs: str | Sequence[str | Mapping[str, Any]],
    weights: Sequence[float] | Mapping[str, float] | None = None,
    args: Mapping[str, Mapping[str, Any]] | None = None,
    fallback: float = 0.0,
    timeout_s: float | None = 5.0,
    workers: int = 4,
    stand_ins: Mapping[str, Callable[..., Any]] | None = None,
) -> RewardComposer:
    """A :class:`RewardComposer` over registered reward functions (kind ``reward_fn``).

    Components are given by registered name (``"math_answer"`` or
    ``["math_answer", "format_tags"]``) or as mappings ``{"fn":
    "format_tags", "name": "strict_format", "weight": 0.1, "args": {...}}``
    (``name`` defaults to ``fn``; use it to register one function twice with
    different args). ``weights`` is a list in component order or a mapping
    by name (missing names weigh 1.0); ``args`` maps a component name to its
    arguments. ``fallback``, ``timeout_s`` and ``workers`` are passed to
    :class:`RewardComposer`. OmegaConf containers are accepted as they are.
    ``stand_ins`` maps a component name to a callable that scores in its function's place (a reward
    service elsewhere, :class:`rltk.rewards.ray_service.RemoteReward`): the function's arguments are
    checked here and travel with the service, so the stand-in is called without them.
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
        if entry["name"] in (stand_ins or {}):
            validate_reward_args(entry["name"], fn, merged)
            fn, merged = stand_ins[entry["name"]], {}
        specs.append(RewardSpec(entry["name"], fn, entry.get("weight", 1.0), merged))
    return RewardComposer(specs, fallback=fallback, timeout_s=timeout_s, workers=workers)


def _check_picklable(spec: RewardSpec) -> None:
    """Refuse, at build time, a component that cannot be sent to a worker process."""
    for what, value in (("function", spec.fn), ("args", spec.args)):
        problem = picklable_error(value)
        if problem is not None:
            qualname = getattr(spec.fn, "__qualname__", type(spec.fn).__name__)
            module = getattr(spec.fn, "__module__", "?")
            raise ValueError(
                f"reward '{spec.name}' ({module}.{qualname}) must run in a worker process, where a timeout "
                f"can stop it, but its {what} cannot be sent there ({problem}). Workers import reward "
                f"functions by reference: define it at the top level of a module (not a lambda or a nested "
                f"function), or mark it @bounded (from rltk.rewards import bounded) if its work is bounded on "
                f"any input (it then runs in-process), or set reward.timeout_s=null to run every reward "
                f"in-process without a timeout."
            )


def _failed(exc: BaseException) -> CallOutcome:
    """The outcome of a call that raised ``exc`` (a ``TimeoutError`` counts as a timeout)."""
    return CallOutcome(ok=False, error_type=type(exc).__name__, error=str(exc), timed_out=isinstance(exc, TimeoutError),
                       where="".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-3)))


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
