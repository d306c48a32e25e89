import os

import pytest

# Tests never talk to the network or to a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# How far every wait of the suite stretches (CONTRIBUTING.md, "Waiting in a test, and a loaded machine"):
# measured here, in the process xdist starts its workers from, so they and their subprocesses share one value.
import tests.waits  # noqa: E402,F401


def pytest_configure(config):
    import torch

    # Tiny models run far faster on one thread than on two contended ones.
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    import torch

    # Slow end-to-end tests first: with one worker per core (-n auto), a long test that starts last
    # is what the whole run waits for. A stable sort keeps every other order as collected.
    items.sort(key=lambda item: "slow" not in item.keywords)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is present on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fresh_registry():
    """Reload the registry from entry points before and after a test that changes it."""
    from rltk.registry import get_registry

    get_registry(reload=True)
    yield
    get_registry(reload=True)


@pytest.fixture
def batches(monkeypatch):
    """Every batch a recipe run hands to the advantage estimator, as it was after the estimator ran.

    Patches ``rltk.training.step.estimator.Estimator.__call__``, the advantage pass every recipe runs.
    """
    import rltk.training.step.estimator as estimator

    seen = []
    estimate = estimator.Estimator.__call__

    def recording(self, batch, strategy=None):
        advantages, returns = estimate(self, batch, strategy)
        seen.append({**{k: v.clone() for k, v in batch.items()}, "advantages": advantages, "returns": returns})
        return advantages, returns

    monkeypatch.setattr(estimator.Estimator, "__call__", recording)
    return seen
