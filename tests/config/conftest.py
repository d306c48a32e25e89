"""The config tests run as one process, whatever an earlier in-process test of the same worker left in the
environment: the checks read WORLD_SIZE, and an in-process DeepSpeed test sets the launcher's variables."""

import pytest


@pytest.fixture(autouse=True)
def _not_launched(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
