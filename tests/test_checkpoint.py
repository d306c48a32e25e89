"""CheckpointManager: atomic layout, discovery, pruning, exact RNG restore and bitwise resume."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers

from rltk.checkpoint import CheckpointManager, capture_rng_state, restore_rng_state
from rltk.strategies.accelerate_strategy import AccelerateStrategy

@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models on a shared 2-core machine run ~100x faster on one thread than with OpenMP contention."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


SETUP = dict(lr=1e-2, total_steps=6, warmup_steps=2, lr_schedule="cosine", weight_decay=0.1, grad_clip=1.0)


def tiny_qwen2(seed: int) -> transformers.Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, vocab_size=50,
                                      attention_dropout=0.1)  # dropout: the forward pass draws from torch's RNG
    return transformers.Qwen2ForCausalLM(config).train()


def new_strategy(seed: int = 0) -> AccelerateStrategy:
    strategy = AccelerateStrategy(cpu=True)
    strategy.setup(tiny_qwen2(seed), **SETUP)
    return strategy


def train_step(strategy: AccelerateStrategy) -> float:
    """One step on data drawn from the global RNGs (python picks the batch size, torch the tokens)."""
    rows = random.randint(2, 3)
    length = int(np.random.randint(4, 8))
    ids = torch.randint(0, 50, (rows, length))
    logits = strategy.model(input_ids=ids).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, 50), ids[:, 1:].reshape(-1))
    strategy.backward(loss)
    strategy.step()
    return loss.item()


def draws() -> tuple:
    return random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), torch.rand(3).tolist()


def test_rng_state_round_trip_is_exact_and_weights_only_loadable(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in python's state
    np.random.standard_normal()
    torch.save(capture_rng_state(), tmp_path / "rng.pt")
    expected = draws()
    draws()
    restore_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert draws() == expected


def test_save_writes_a_complete_step_folder_and_returns_it(tmp_path):
    manager = CheckpointManager(tmp_path / "ckpt")
    strategy = new_strategy()
    path = manager.save(12, strategy, {"step": 12, "data": {"epoch": 1, "offset": 40}})
    assert path == tmp_path / "ckpt" / "step_000012"
    assert sorted(p.name for p in path.iterdir()) == [
        "manifest.json", "model", "optimizer.pt", "rng", "scheduler.pt", "state.json", "strategy.json"]
    assert [p.name for p in (path / "rng").iterdir()] == ["rank_00000.pt"]
    # The manifest lists every other file with its size on disk.
    files = json.loads((path / "manifest.json").read_text())["files"]
    on_disk = {p.relative_to(path).as_posix(): p.stat().st_size for p in path.rglob("*") if p.is_file()}
    assert files == {k: v for k, v in on_disk.items() if k != "manifest.json"}
    assert {"state.json", "optimizer.pt", "rng/rank_00000.pt", "model/model.safetensors"} <= set(files)
    payload = json.loads((path / "state.json").read_text())
    assert payload["state"] == {"step": 12, "data": {"epoch": 1, "offset": 40}} and payload["world_size"] == 1
    assert manager.latest() == path
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["step_000012"]  # no temporary folder left


def test_latest_ignores_interrupted_and_incomplete_folders(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(3, None, {"step": 3})
    (tmp_path / ".tmp-step_000009").mkdir()  # a save killed before its rename
    (tmp_path / ".tmp-step_000009" / "state.json").write_text("{}")
    (tmp_path / "step_000010").mkdir()  # no state.json: not written by the manager
    (tmp_path / "step_notanumber").mkdir()
    (tmp_path / "step_000011.txt").write_text("a file")
    assert manager.latest() == tmp_path / "step_000003"
    assert [step for step, _ in manager.checkpoints()] == [3]
    manager.save(4, None, {"step": 4})
    assert not (tmp_path / ".tmp-step_000009").exists()  # stale temporary folders are cleaned on save
    assert manager.latest() == tmp_path / "step_000004"


def test_latest_orders_by_step_number_not_by_name(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=None)
    for step in (999_999, 1_000_000, 5):
        manager.save(step, None, {})
    assert manager.latest().name == "step_1000000"


def test_keeps_only_the_last_k_checkpoints(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in range(1, 6):
        manager.save(step, None, {"step": step})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000004", "step_000005"]


def test_saving_a_step_again_replaces_it(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(2, None, {"version": "first"})
    manager.save(2, None, {"version": "second"})
    assert manager.load(manager.latest(), None) == {"version": "second"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002"]


def test_load_restores_rng_so_draws_continue_as_after_save(tmp_path):
    manager = CheckpointManager(tmp_path)
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    manager.save(1, None, {})
    after_save = draws()
    draws()
    manager.load(manager.latest(), None)
    assert draws() == after_save


def test_load_restores_model_and_optimizer_state_into_fresh_objects(tmp_path):
    torch.manual_seed(0)
    strategy = new_strategy(seed=0)
    for _ in range(2):
        train_step(strategy)
    manager = CheckpointManager(tmp_path)
    path = manager.save(2, strategy, {"step": 2})

    fresh = new_strategy(seed=1)
    assert manager.load(path, fresh) == {"step": 2}
    for (name, a), b in zip(strategy.unwrap().named_parameters(), fresh.unwrap().parameters()):
        assert torch.equal(a, b), name
        for key, value in strategy.optimizer.state[a].items():
            assert torch.equal(value, fresh.optimizer.state[b][key]), (name, key)
    assert fresh.scheduler.state_dict() == strategy.scheduler.state_dict()


@pytest.mark.parametrize("k", [1, 3])
def test_resume_is_bitwise_identical_to_an_uninterrupted_run(tmp_path, k):
    n = 5
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    straight = new_strategy(seed=0)
    straight_losses = [train_step(straight) for _ in range(n)]

    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    first = new_strategy(seed=0)
    losses = [train_step(first) for _ in range(k)]
    manager = CheckpointManager(tmp_path)
    manager.save(k, first, {"step": k})
    del first
    random.seed(123), np.random.seed(123), torch.manual_seed(123)  # a new process starts elsewhere

    resumed = new_strategy(seed=1)
    state = CheckpointManager(tmp_path).load(CheckpointManager(tmp_path).latest(), resumed)
    assert state["step"] == k
    losses += [train_step(resumed) for _ in range(n - k)]

    assert losses == straight_losses
    for a, b in zip(straight.unwrap().parameters(), resumed.unwrap().parameters()):
        assert torch.equal(a, b)


def test_state_that_is_not_json_names_the_offending_key(tmp_path):
    manager = CheckpointManager(tmp_path)
    with pytest.raises(TypeError, match=r"state\['data'\]\['order'\] = Tensor is not JSON-serialisable"):
        manager.save(1, None, {"data": {"order": torch.arange(3)}})
    assert not any(tmp_path.iterdir())


def test_loading_a_folder_that_is_not_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a complete rltk checkpoint"):
        CheckpointManager(tmp_path).load(tmp_path, None)


def test_missing_rng_file_for_this_rank_warns(tmp_path):
    manager = CheckpointManager(tmp_path)
    path = manager.save(1, None, {})
    (path / "rng" / "rank_00000.pt").unlink()
    # As if saved by processes that did not include this rank: the manifest does not list its file.
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["files"]["rng/rank_00000.pt"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.warns(UserWarning, match="no RNG state for rank 0.*not bitwise reproducible"):
        manager.load(path, None)


@pytest.mark.parametrize("keep_last", [0, -1, 1.5, True])
def test_invalid_keep_last(tmp_path, keep_last):
    with pytest.raises(ValueError, match=f"keep_last={keep_last!r} must be an integer >= 1, or None"):
        CheckpointManager(tmp_path, keep_last=keep_last)
