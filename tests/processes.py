"""Looking at processes from a test (Linux ``/proc``): whether one runs, waiting for some to end, a group's
members, and the vLLM server processes among them."""

from __future__ import annotations

import time
from pathlib import Path

from tests.waits import scaled


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state first), or None if there is no such."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie no one reaped has ended)."""
    fields = _stat(pid)
    return fields is not None and fields[0] not in "ZX"


def gone_within(pids, timeout_s: float) -> bool:
    """Wait until none of ``pids`` runs; False if some still run after ``timeout_s`` (:func:`tests.waits.scaled`)."""
    deadline = time.monotonic() + scaled(timeout_s)
    while any(running(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def group_members(pgid: int) -> dict[int, str]:
    """pid -> command line of each running process in process group ``pgid``."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) and fields[0] not in "ZX" \
                and int(fields[2]) == pgid:
            try:
                out[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip() \
                    or (entry / "comm").read_text().strip()
            except (FileNotFoundError, ProcessLookupError):
                continue
    return out


def vllm_processes(pgid: int) -> dict[str, list[int]]:
    """The processes of a launched vLLM server's group: ``tether``, ``api_server``, ``engine_core`` (and its
    ``worker``s), by what each runs."""
    kinds: dict[str, list[int]] = {"tether": [], "api_server": [], "engine_core": [], "worker": [], "other": []}
    for pid, command in group_members(pgid).items():
        kind = ("tether" if "rltk.rollout.tether" in command else "api_server"
                if "vllm.entrypoints.openai.api_server" in command else "engine_core"
                if command.startswith("VLLM::EngineCore") else "worker" if command.startswith("VLLM::Worker")
                else "other")
        kinds[kind].append(pid)
    return kinds


def running_tethers() -> list[int]:
    """The pids of every running tether (:mod:`rltk.rollout.tether`) on this machine."""
    out = []
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes() if entry.name.isdigit() else b""
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if b"-m\0rltk.rollout.tether\0" in command and running(int(entry.name)):
            out.append(int(entry.name))
    return out
