"""Logger ``console``: a progress line on stderr with the numbers a researcher watches.

    [warmup 40/1200] step 40/1400 (3%) | sft loss 0.5312 | 0.05s/step | warmup ETA 58s, then grpo ?
    [grpo 25/200] step 1225/1400 (88%) | train reward 0.4 acc 0.31 | held-out greedy 0.52 sampled 0.31 | kl 0.0012 | ...

A warm-up that stops once it reaches an accuracy target (``sft.stop_at_accuracy``)
has a cap, not a length: it usually stops long before. Its line says so, with
the time to the cap as an upper bound, and a run with such a stage counts each
stage's steps on their own (the run's total is not known):

    [warmup 40, up to 6000] | sft loss 0.5312 probe acc 0.1 | 0.05s/step | warmup at most 4m58s, then grpo ?
    [grpo 1/200] (0%) | train reward 0.4 acc 0.31 | ... | 2.00s/step | ETA 6m38s

On a terminal the line is redrawn in place as a bar; elsewhere (CI, a log file)
one plain line is printed every ``every`` steps, plus the first and last step
of the run and of each stage. Values stick: the held-out numbers keep showing
the last evaluation until the next one.

Stages run at very different speeds (a supervised step is a forward and
backward; an RL step also samples), so the step time and the ETA are the
current stage's own: its seconds per step times its steps left. A later stage
has not been timed yet, so it shows ``?`` instead of a number borrowed from
another stage. Without stages (a logger built outside a recipe) the whole run
is one span.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import IO, Callable, Mapping, Sequence

from rltk.loggers.base import Logger, StageSpan, scalar_metrics

# label shown -> metric keys looked up in order (the first one logged wins), or a group
# {label: {sub-label: keys}} shown as "label sub a | ..." -> "train reward 0.4 acc 0.31".
# Training numbers (on the prompts just sampled) and held-out numbers are grouped apart:
# they answer different questions and differ by tens of points.
DEFAULT_FIELDS: dict[str, tuple[str, ...] | dict[str, tuple[str, ...]]] = {
    "sft": {"loss": ("sft/sft_loss",), "probe acc": ("sft/train_accuracy",),
            "truncated": ("sft/probe_truncated_fraction",)},
    "train": {"reward": ("reward", "reward/mean"), "acc": ("accuracy",)},
    "held-out": {"greedy": ("eval/accuracy",), "sampled": ("eval/sampled_accuracy",)},
    "kl": ("kl", "actor/kl"),
    "entropy": ("entropy", "actor/entropy"),
}

# Metrics that describe the model rather than the stage's own steps: they stay shown across a
# stage change (the evaluation before the first RL step is logged at the warm-up's last step).
STAGE_INDEPENDENT_PREFIXES = ("eval/",)


def _keys(keys: str | Sequence[str]) -> tuple[str, ...]:
    return (keys,) if isinstance(keys, str) else tuple(keys)


def format_duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``; ``?`` when unknown."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def format_count(value: float) -> str:
    """``950``, ``5.1k``, ``2.3M``: compact throughput."""
    for threshold, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= threshold:
            return f"{value / threshold:.1f}{suffix}"
    return f"{value:.0f}"


class ConsoleLogger(Logger):
    """Progress on stderr: stage, step/total, the watched metrics, tokens/s and the stage's ETA.

    Args:
        run_dir, config: accepted for the common logger signature; unused.
        total_steps: the step count the bar aims for.
        every: print every ``every`` steps when not on a terminal.
        resume_step: the step a resumed run starts after; rates count only
            steps run by this process.
        fields: ``{label: metric key or list of keys}`` (or a group
            ``{label: {sub-label: keys}}``) replacing :data:`DEFAULT_FIELDS`.
        stream: where to write (default ``sys.stderr``).
        tty: force terminal (``True``) or line (``False``) mode; default asks the stream.
        bar_width: characters of the terminal bar.
        clock: seconds source for rates and ETA (tests pass a fake one).

    Throughput: a ``tokens_per_s`` metric is shown as is; otherwise a ``tokens``
    metric (tokens processed in that step) is summed and divided by the wall
    time between printed lines.

    Time per step: wall time since the current stage's clock started, over the
    stage's steps run since. The clock starts when the stage does (at the last
    metric logged before its first step, so the warm-up's final evaluation and
    the strategy set-up do not count as RL time) and restarts on any metric
    logged at or before the stage's first step (an opening evaluation).
    Stages come from :meth:`set_stages`, which recipes call.
    """

    def __init__(self, *, run_dir: str | Path | None = None, config: dict | None = None, total_steps: int,
                 every: int = 10, resume_step: int | None = None, fields: dict | None = None,
                 stream: IO[str] | None = None, tty: bool | None = None, bar_width: int = 24,
                 clock: Callable[[], float] = time.monotonic):
        # 0: a run with no training steps (`stages=[]`, an evaluation only), whose evaluation logs at step 0
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 0:
            raise ValueError(f"console logger: total_steps={total_steps!r} must be an integer >= 0.")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"console logger: every={every!r} must be an integer >= 1 (print every N steps).")
        self.total_steps = total_steps
        self.every = every
        self.start_step = int(resume_step or 0)
        raw_fields = DEFAULT_FIELDS if fields is None else fields
        self.fields = {
            label: {sub: _keys(k) for sub, k in keys.items()} if isinstance(keys, Mapping) else _keys(keys)
            for label, keys in raw_fields.items()
        }
        self.stream = stream if stream is not None else sys.stderr
        self.tty = tty if tty is not None else bool(getattr(self.stream, "isatty", lambda: False)())
        self.bar_width = bar_width
        self.stages: list[StageSpan] = []
        self.latest: dict[str, float] = {}
        self._clock = clock
        self._started = self._clock()
        self._last_print_time = self._started
        self._last_log_time = self._started
        self._tokens_since_print = 0.0
        self._last_step: int | None = None
        self._line_open = False
        self._stage: int | None = None  # index into self.stages of the stage being logged
        self._clock_step = self.start_step  # the step the current stage's clock counts from
        self._clock_time = self._started

    def set_stages(self, stages: Sequence[StageSpan]) -> None:
        """The run's stages as global step spans (see :class:`rltk.loggers.base.StageSpan`); the run ends where
        the last one does (given again after a stage stopped early, the total shrinks with it)."""
        self.stages = list(stages)
        if self.stages:
            self.total_steps = self.stages[-1].last_step

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Remember ``metrics`` and print or redraw the progress line when due."""
        values = scalar_metrics(metrics)
        now = self._clock()
        opening = self._opens_next_stage(step)
        self._follow_stage(step, self.stage_index(step) + 1 if opening else None)
        if step <= self._clock_step:  # logged before the stage's first step: its steps start after this
            self._clock_time = now
        self._last_log_time = now
        self.latest.update(values)
        self._tokens_since_print += values.get("tokens", 0.0)
        is_new_step = step != self._last_step
        self._last_step = step
        if opening:  # not a step of the stage that owns the number: nothing to show until the next one's first
            return
        if self.tty:
            self._draw(step)
        elif is_new_step and self._due(step):
            self._print(step)

    def _opens_next_stage(self, step: int) -> bool:
        """Whether ``step`` is the last step of a stage that stopped before its cap, logged by the next stage (its
        opening evaluation, at the global step before its first): the stage itself never ran it."""
        index = self.stage_index(step)
        if index is None or index + 1 >= len(self.stages) or self._last_step is None:
            return False
        stage = self.stages[index]
        return stage.cap and step == stage.last_step and self._last_step < step - 1

    def _due(self, step: int) -> bool:
        if step % self.every == 0 or step >= self.total_steps or step == self.start_step + 1:
            return True
        return any(step in (s.first_step + 1, s.last_step) for s in self.stages if s.steps > 0)

    def stage_index(self, step: int) -> int | None:
        """The index of the stage that owns ``step`` (the first one for steps before any); None without stages."""
        if not self.stages:
            return None
        for i, stage in enumerate(self.stages):
            if stage.steps > 0 and step <= stage.last_step:
                return i
        return len(self.stages) - 1

    def _follow_stage(self, step: int, index: int | None = None) -> None:
        index = self.stage_index(step) if index is None else index
        if index is None or index == self._stage:
            return
        stage = self.stages[index]
        if self._stage is None:  # this process's first metric: a fresh run, or one resumed mid-way
            self._clock_step = max(self.start_step, stage.first_step)
        else:  # a new stage: its numbers and its speed are its own
            self.latest = {k: v for k, v in self.latest.items() if k.startswith(STAGE_INDEPENDENT_PREFIXES)}
            self._clock_step, self._clock_time = stage.first_step, self._last_log_time
            self._tokens_since_print = 0.0
        self._stage = index

    def line(self, step: int) -> str:
        """The progress text for ``step`` (without bar or newline); also updates throughput bookkeeping."""
        now = self._clock()
        index = self.stage_index(step)
        stage = self.stages[index] if index is not None else None
        head = f"step {step}/{self.total_steps} ({100 * step / max(1, self.total_steps):.0f}%)"
        if stage is not None:
            counted = [s for s in self.stages if s.steps > 0]
            done = max(0, step - stage.first_step)
            if stage.cap:
                head = f"[{stage.name} {done}, up to {stage.steps}]"
            elif any(s.cap for s in counted):  # the run's length is unknown: the stage's own count
                head = f"[{stage.name} {done}/{stage.steps}] ({100 * done / max(1, stage.steps):.0f}%)"
            else:
                where = stage.name if len(counted) <= 1 else f"{stage.name} {done}/{stage.steps}"
                head = f"[{where}] {head}"
        parts = [head]
        for label, keys in self.fields.items():
            if isinstance(keys, dict):
                shown = [f"{sub} {self.latest[k]:.4g}" for sub, k in
                         ((sub, self._first_logged(ks)) for sub, ks in keys.items()) if k is not None]
                if shown:
                    parts.append(f"{label} {' '.join(shown)}")
            else:
                key = self._first_logged(keys)
                if key is not None:
                    parts.append(f"{label} {self.latest[key]:.4g}")
        interval = now - self._last_print_time
        if "tokens_per_s" in self.latest:
            parts.append(f"tok/s {format_count(self.latest['tokens_per_s'])}")
        elif self._tokens_since_print > 0 and interval > 0:
            parts.append(f"tok/s {format_count(self._tokens_since_print / interval)}")
        self._tokens_since_print = 0.0
        self._last_print_time = now
        steps_done = step - self._clock_step
        if steps_done > 0:
            per_step = (now - self._clock_time) / steps_done
            parts.append(f"{per_step:.2f}s/step")
            parts.append(self._eta(step, per_step, index))
        return " | ".join(parts)

    def _first_logged(self, keys: tuple[str, ...]) -> str | None:
        return next((k for k in keys if k in self.latest), None)

    def _eta(self, step: int, per_step: float, index: int | None) -> str:
        if index is None:
            return f"ETA {format_duration(per_step * max(0, self.total_steps - step))}"
        stage = self.stages[index]
        left = format_duration(per_step * max(0, stage.last_step - step))
        later = [s.name for s in self.stages[index + 1:] if s.steps > 0]
        # a stage that may stop early: the time to its cap is all that is known, an upper bound
        eta = f"at most {left}" if stage.cap else f"ETA {left}"
        if not later:  # the last stage: its time left is the run's
            return f"{stage.name} {eta}" if stage.cap else eta
        # later stages run at their own, not yet measured, speed
        return f"{stage.name} {eta}, then {', '.join(name + ' ?' for name in later)}"

    def _print(self, step: int) -> None:
        self.stream.write(self.line(step) + "\n")
        self.stream.flush()

    def _draw(self, step: int) -> None:
        index = self.stage_index(step)
        if index is not None and any(s.cap for s in self.stages):  # the stage's share; the run's is unknown
            stage = self.stages[index]
            fraction = (step - stage.first_step) / max(1, stage.steps)
        else:
            fraction = step / max(1, self.total_steps)
        filled = max(0, min(self.bar_width, int(self.bar_width * fraction)))
        bar = "#" * filled + "." * (self.bar_width - filled)
        # \r returns to the line start, \x1b[K clears what a longer previous line left behind.
        self.stream.write(f"\r[{bar}] {self.line(step)}\x1b[K")
        self.stream.flush()
        self._line_open = True

    def close(self) -> None:
        """End the in-place line so later output starts on a fresh line."""
        if self._line_open:
            self.stream.write("\n")
            self.stream.flush()
            self._line_open = False
