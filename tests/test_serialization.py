"""rltk.serialization: checkpoint files are read without running code, and damage is told from payloads."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from rltk.serialization import (
    FORCE_WEIGHTS_ONLY_VARIABLE,
    DamagedCheckpointError,
    UnsafeCheckpointError,
    check_file,
    check_json,
    check_safetensors,
    check_torch_files,
    torch_load,
    weights_only_everywhere,
)


class Payload:
    """Unpickling this runs a shell command that creates ``marker``: what a planted checkpoint would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch '{self.marker}'",)


@dataclasses.dataclass
class Record:
    """A harmless class a strategy could allow-list (as DeepSpeed's loss scaler is)."""

    scale: float


def plant(path: Path, marker: Path, *, raw: bool = False) -> None:
    """Replace ``path`` with a pickle whose loading runs a command: torch's zip format, or a bare pickle."""
    if raw:
        path.write_bytes(pickle.dumps({"state": Payload(marker)}, protocol=2))
    else:
        torch.save({"state": Payload(marker), "weights": torch.zeros(3)}, path)


@pytest.mark.parametrize("raw", [False, True], ids=["torch-zip", "bare-pickle"])
def test_a_planted_payload_is_refused_naming_the_file_and_never_runs(tmp_path, raw):
    marker = tmp_path / "MARKER"
    path = tmp_path / "optimizer.pt"
    plant(path, marker, raw=raw)
    for mmap in (False, True):
        with pytest.raises(UnsafeCheckpointError) as caught:
            torch_load(path, mmap=mmap)
        assert caught.value.path == path
        assert str(path) in str(caught.value) and "could run arbitrary code" in str(caught.value)
        assert "system" in str(caught.value)  # the global the file asked for
    assert not marker.exists()


def test_tensors_and_plain_containers_load_and_allow_listed_classes_only_when_allowed(tmp_path):
    path = tmp_path / "state.pt"
    torch.save({"w": torch.arange(4.0), "meta": [1, "a", (2.5, None)], "scaler": Record(0.5)}, path)
    with pytest.raises(UnsafeCheckpointError, match=r"asks the unpickler for .*Record"):
        torch_load(path)
    loaded = torch_load(path, allowed_globals=[Record])
    assert torch.equal(loaded["w"], torch.arange(4.0)) and loaded["meta"] == [1, "a", (2.5, None)]
    assert loaded["scaler"] == Record(0.5)
    # The allow-list lasts for the call only.
    with pytest.raises(UnsafeCheckpointError):
        torch_load(path)


def test_missing_empty_and_foreign_files_are_damage_not_payloads(tmp_path):
    with pytest.raises(DamagedCheckpointError, match="the file is missing"):
        torch_load(tmp_path / "absent.pt")
    (tmp_path / "empty.pt").write_bytes(b"")
    (tmp_path / "text.pt").write_text("not a torch file at all")
    for name in ("empty.pt", "text.pt"):
        with pytest.raises(DamagedCheckpointError, match="not a readable torch file") as caught:
            check_file(tmp_path / name)
        assert caught.value.path == tmp_path / name


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_any_strict_prefix_of_a_torch_file_is_damaged(data):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "scheduler.pt"
        torch.save({"last_epoch": 3, "base_lrs": [0.1], "t": torch.arange(64.0)}, path)
        whole = path.read_bytes()
        cut = data.draw(st.integers(0, len(whole) - 1))
        path.write_bytes(whole[:cut])
        with pytest.raises(DamagedCheckpointError) as caught:
            check_file(path)
        assert caught.value.path == path


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_a_safetensors_file_cut_or_extended_anywhere_is_damaged(data):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "model.safetensors"
        save_file({"a": torch.arange(10.0), "b": torch.ones(2, 3)}, str(path))
        whole = path.read_bytes()
        check_safetensors(path)  # intact
        cut = data.draw(st.integers(0, len(whole) - 1))
        extra = data.draw(st.binary(min_size=1, max_size=8))
        for damaged in (whole[:cut], whole + extra):
            path.write_bytes(damaged)
            with pytest.raises(DamagedCheckpointError, match="not a complete safetensors file") as caught:
                check_file(path)
            assert caught.value.path == path


def test_json_must_parse(tmp_path):
    path = tmp_path / "state.json"
    path.write_text(json.dumps({"step": 3}))
    assert check_json(path) == {"step": 3}
    path.write_text('{"step": 3, "sta')
    with pytest.raises(DamagedCheckpointError, match=r"state.json: it is not valid JSON"):
        check_file(path)
    path.write_bytes(b"\x80\x04\x95 pickle bytes")
    with pytest.raises(DamagedCheckpointError, match="not valid JSON"):
        check_json(path)


def test_weights_only_everywhere_overrides_an_explicit_weights_only_false(tmp_path, monkeypatch):
    """What DeepSpeed's readers do: torch.load(..., weights_only=False). Inside the guard it is refused."""
    monkeypatch.delenv(FORCE_WEIGHTS_ONLY_VARIABLE, raising=False)
    marker = tmp_path / "MARKER"
    plant(tmp_path / "evil.pt", marker)
    torch.save({"scaler": Record(2.0)}, tmp_path / "record.pt")
    with weights_only_everywhere([Record]):
        with pytest.raises(pickle.UnpicklingError, match="system"):
            torch.load(tmp_path / "evil.pt", weights_only=False)
        assert torch.load(tmp_path / "record.pt", weights_only=False) == {"scaler": Record(2.0)}
        with weights_only_everywhere():  # nested: the outer allow-list and the forcing survive the inner exit
            pass
        assert os.environ[FORCE_WEIGHTS_ONLY_VARIABLE] == "1"
        assert torch.load(tmp_path / "record.pt", weights_only=False) == {"scaler": Record(2.0)}
    assert not marker.exists()
    assert FORCE_WEIGHTS_ONLY_VARIABLE not in os.environ  # restored, so the process is as before
    assert Record not in torch.serialization.get_safe_globals()


def test_weights_only_everywhere_restores_a_previous_setting_after_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv(FORCE_WEIGHTS_ONLY_VARIABLE, "0")
    with pytest.raises(RuntimeError, match="boom"):
        with weights_only_everywhere([Record]):
            raise RuntimeError("boom")
    assert os.environ[FORCE_WEIGHTS_ONLY_VARIABLE] == "0"
    assert Record not in torch.serialization.get_safe_globals()


def test_check_torch_files_names_the_first_bad_file_under_a_folder(tmp_path):
    marker = tmp_path / "MARKER"
    (tmp_path / "state" / "deep").mkdir(parents=True)
    torch.save({"w": torch.ones(2)}, tmp_path / "state" / "a_model_states.pt")
    torch.save({"scaler": Record(1.0)}, tmp_path / "state" / "b_optim_states.pt")
    (tmp_path / "state" / "notes.txt").write_text("not checked")
    check_torch_files(tmp_path, allowed_globals=[Record])
    plant(tmp_path / "state" / "deep" / "c.pt", marker)
    with pytest.raises(UnsafeCheckpointError) as caught:
        check_torch_files(tmp_path, allowed_globals=[Record])
    assert caught.value.path == tmp_path / "state" / "deep" / "c.pt"
    assert not marker.exists()
