"""Resident memory of this process from /proc (Linux): what the memory benchmarks measure.

Each benchmark runs one case per fresh process, resets the peak with :func:`reset_peak` once the
process is set up, and reads ``VmHWM`` (the peak resident set since then) against ``VmRSS`` at
the start, so a case's figure is its own allocations alone. Imported by the benchmark scripts,
which run from this folder (a script's folder is first on ``sys.path``, children included).
"""

from __future__ import annotations


def memory_kib() -> dict[str, int]:
    """``{"VmRSS": current, "VmHWM": peak}`` resident memory of this process, in KiB."""
    values = {}
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
                values[key] = int(value.split()[0])
    return values


def reset_peak() -> None:
    """Restart ``VmHWM`` from the current resident set."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
