"""limit_torch_threads: never more intra-op threads than the cores a process may use."""

from __future__ import annotations

import pytest
import torch

from rltk import distributed


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_threads_are_capped_at_the_affinity_mask_shared_by_local_processes(monkeypatch, restore_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(distributed, "available_cores", lambda: 4)
    torch.set_num_threads(8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two training processes on this node: 2 cores each
    assert distributed.limit_torch_threads() == 2 == torch.get_num_threads()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # more processes than cores: still one thread each
    assert distributed.limit_torch_threads() == 1


def test_fewer_threads_than_cores_are_not_raised(monkeypatch, restore_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(distributed, "available_cores", lambda: 4)
    torch.set_num_threads(1)
    assert distributed.limit_torch_threads() == 1


def test_omp_num_threads_is_the_user_s_choice(monkeypatch, restore_threads):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setattr(distributed, "available_cores", lambda: 1)
    torch.set_num_threads(3)
    assert distributed.limit_torch_threads() == 3


def test_available_cores_is_within_the_affinity_mask():
    import os

    assert 1 <= distributed.available_cores() <= len(os.sched_getaffinity(0))
