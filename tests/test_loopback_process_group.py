"""A process group started on a loopback MASTER_ADDR listens on the loopback only (torch's own store
listens on every interface), and still works: two plain processes all-reduce through it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from rltk.distributed import free_local_port, is_loopback_address
from tests.waits import scaled

psutil = pytest.importorskip("psutil")

RANK_PROGRAM = textwrap.dedent("""
    import json, os, sys
    import psutil, torch, torch.distributed as dist
    from rltk.distributed import start_loopback_process_group
    started = start_loopback_process_group(timeout_s=float(sys.argv[1]))
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    listening = [c.laddr.ip for c in psutil.Process().net_connections("inet") if c.status == psutil.CONN_LISTEN]
    dist.barrier()
    print(json.dumps({"started": started, "sum": total.item(), "listening": listening}), flush=True)
    dist.destroy_process_group()
""")

DEEPSPEED_PROGRAM = textwrap.dedent("""
    import json, psutil
    from rltk.strategies.deepspeed_strategy import DeepSpeedStrategy
    strategy = DeepSpeedStrategy()
    print(json.dumps([c.laddr.ip for c in psutil.Process().net_connections("inet")
                      if c.status == psutil.CONN_LISTEN]), flush=True)
""")


def _clean_env(**extra) -> dict[str, str]:
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")
    return {**{k: v for k, v in os.environ.items() if k not in launcher}, "OMP_NUM_THREADS": "1", **extra}


@pytest.mark.parametrize("host,expected", [("127.0.0.1", True), ("127.0.1.1", True), ("localhost", True),
                                           ("::1", True), ("[::1]", True), ("10.0.0.2", False),
                                           ("node-3.cluster", False)])
def test_loopback_addresses_are_told_apart(host, expected):
    assert is_loopback_address(host) is expected


def test_two_processes_rendezvous_on_the_loopback_and_listen_nowhere_else():
    port = str(free_local_port())
    ranks = [subprocess.Popen([sys.executable, "-c", RANK_PROGRAM, str(scaled(60))], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=_clean_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                                             MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for rank in range(2)]
    results = []
    for proc in ranks:
        out, err = proc.communicate(timeout=scaled(120))
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert [r["started"] for r in results] == [True, True]
    assert [r["sum"] for r in results] == [3.0, 3.0]
    assert results[0]["listening"], "rank 0 holds the store: it listens"
    for result in results:
        assert all(is_loopback_address(ip) for ip in result["listening"]), result["listening"]


@pytest.mark.slow  # a process that imports DeepSpeed: ~15 s on a quiet 2-core machine
def test_a_one_process_deepspeed_strategy_listens_on_the_loopback_only():
    pytest.importorskip("deepspeed")
    out = subprocess.run([sys.executable, "-c", DEEPSPEED_PROGRAM], capture_output=True, text=True,
                         env=_clean_env(), timeout=scaled(180))
    assert out.returncode == 0, out.stderr[-3000:]
    listening = json.loads(out.stdout.strip().splitlines()[-1])
    assert listening and all(is_loopback_address(ip) for ip in listening), listening


def test_nothing_is_started_for_another_machines_address_or_under_torchrun(monkeypatch):
    from rltk.distributed import start_loopback_process_group

    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    assert start_loopback_process_group() is False
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert start_loopback_process_group() is False
