"""Run a command in a process of its own, as the distributed and DeepSpeed tests need.

torch.distributed and DeepSpeed keep process-wide state (a process group, the
accelerator choice), so tests that start them launch a fresh process; this is
the one place that builds its environment.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.waits import scaled

RENDEZVOUS_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def run_isolated(command: list[str], *, expect: int = 0, timeout: int = 600,
                 extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``command`` with one OpenMP thread, no inherited rendezvous variables and DeepSpeed's
    compiled-op cache in a stable folder; assert its exit code is ``expect``, showing its output if not.
    ``timeout`` is a hang guard for a quiet machine (:func:`tests.waits.scaled` stretches it)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(extra_env or {})}
    # DeepSpeed compiles a shared-memory op on first use (~1-2 min); a stable folder lets CI reuse it.
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "rltk" / "torch_extensions"))
    for name in RENDEZVOUS_VARIABLES:
        env.pop(name, None)
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=scaled(timeout))
    assert out.returncode == expect, (f"{' '.join(command[-4:])} exited {out.returncode}, expected {expect}:\n"
                                      f"{out.stdout[-3000:]}\n{out.stderr[-6000:]}")
    return out


def load_worker(path: Path, name: str):
    """The worker script at ``path`` (which its test also launches in processes of its own) as a module, so the
    test's one-process reference runs the very code the processes run."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
