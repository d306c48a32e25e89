"""Logger ``console``: a progress line on stderr with the numbers a researcher watches.

    step 40/200 (20%) | reward 0.4375 | acc 0.31 | kl 0.0012 | entropy 1.23 | tok/s 5.1k | 0.52s/step | ETA 1m23s

On a terminal the line is redrawn in place as a bar; elsewhere (CI, a log file)
one plain line is printed every ``every`` steps, plus the first and last step.
Values stick: ``acc`` keeps showing the last evaluation until the next one.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import IO, Callable

from rltk.loggers.base import scalar_metrics

# label shown -> metric keys looked up in order (the first one logged wins)
DEFAULT_FIELDS: dict[str, tuple[str, ...]] = {
    "reward": ("reward", "reward/mean"),
    "acc": ("eval/accuracy", "accuracy"),
    "kl": ("kl", "actor/kl"),
    "entropy": ("entropy", "actor/entropy"),
}


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


class ConsoleLogger:
    """Progress on stderr: step/total, reward, accuracy, KL, entropy, tokens/s and ETA.

    Args:
        run_dir, config: accepted for the common logger signature; unused.
        total_steps: the step count the bar and the ETA aim for.
        every: print every ``every`` steps when not on a terminal.
        resume_step: the step a resumed run starts after; the ETA counts only
            steps run by this process.
        fields: ``{label: metric key or list of keys}`` replacing
            :data:`DEFAULT_FIELDS`.
        stream: where to write (default ``sys.stderr``).
        tty: force terminal (``True``) or line (``False``) mode; default asks the stream.
        bar_width: characters of the terminal bar.
        clock: seconds source for rates and ETA (tests pass a fake one).

    Throughput: a ``tokens_per_s`` metric is shown as is; otherwise a ``tokens``
    metric (tokens processed in that step) is summed and divided by the wall
    time between printed lines. The ETA is the mean wall time per step since
    this logger was built times the steps left.
    """

    def __init__(self, *, run_dir: str | Path | None = None, config: dict | None = None, total_steps: int,
                 every: int = 10, resume_step: int | None = None, fields: dict | None = None,
                 stream: IO[str] | None = None, tty: bool | None = None, bar_width: int = 24,
                 clock: Callable[[], float] = time.monotonic):
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
            raise ValueError(f"console logger: total_steps={total_steps!r} must be an integer >= 1.")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"console logger: every={every!r} must be an integer >= 1 (print every N steps).")
        self.total_steps = total_steps
        self.every = every
        self.start_step = int(resume_step or 0)
        raw_fields = DEFAULT_FIELDS if fields is None else fields
        self.fields = {label: (keys,) if isinstance(keys, str) else tuple(keys) for label, keys in raw_fields.items()}
        self.stream = stream if stream is not None else sys.stderr
        self.tty = tty if tty is not None else bool(getattr(self.stream, "isatty", lambda: False)())
        self.bar_width = bar_width
        self.latest: dict[str, float] = {}
        self._clock = clock
        self._started = self._clock()
        self._last_print_time = self._started
        self._tokens_since_print = 0.0
        self._last_step: int | None = None
        self._line_open = False

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Remember ``metrics`` and print or redraw the progress line when due."""
        values = scalar_metrics(metrics)
        self.latest.update(values)
        self._tokens_since_print += values.get("tokens", 0.0)
        is_new_step = step != self._last_step
        self._last_step = step
        if self.tty:
            self._draw(step)
        elif is_new_step and (step % self.every == 0 or step >= self.total_steps or step == self.start_step + 1):
            self._print(step)

    def line(self, step: int) -> str:
        """The progress text for ``step`` (without bar or newline); also updates throughput bookkeeping."""
        now = self._clock()
        parts = [f"step {step}/{self.total_steps} ({100 * step / self.total_steps:.0f}%)"]
        for label, keys in self.fields.items():
            key = next((k for k in keys if k in self.latest), None)
            if key is not None:
                parts.append(f"{label} {self.latest[key]:.4g}")
        interval = now - self._last_print_time
        if "tokens_per_s" in self.latest:
            parts.append(f"tok/s {format_count(self.latest['tokens_per_s'])}")
        elif self._tokens_since_print > 0 and interval > 0:
            parts.append(f"tok/s {format_count(self._tokens_since_print / interval)}")
        self._tokens_since_print = 0.0
        self._last_print_time = now
        steps_done = step - self.start_step
        if steps_done > 0:
            per_step = (now - self._started) / steps_done
            parts.append(f"{per_step:.2f}s/step")
            parts.append(f"ETA {format_duration(per_step * max(0, self.total_steps - step))}")
        return " | ".join(parts)

    def _print(self, step: int) -> None:
        self.stream.write(self.line(step) + "\n")
        self.stream.flush()

    def _draw(self, step: int) -> None:
        filled = min(self.bar_width, int(self.bar_width * step / self.total_steps))
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
