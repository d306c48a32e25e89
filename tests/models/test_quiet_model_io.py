"""quiet_model_io: no transformers progress bars and no DeepSpeed probe inside, the user's settings after;
give_default_mode: files rltk writes follow the umask."""

from __future__ import annotations

import os
import stat
import sys

import pytest
from transformers.utils import logging as hf_logging

from rltk.io import default_file_mode, give_default_mode
from rltk.models.loading import load_model, quiet_model_io
from rltk.models.tiny import build_char_tokenizer, build_tiny_model, save_pretrained_dir


@pytest.mark.parametrize("user_enabled", [True, False])
def test_progress_bars_are_off_inside_and_as_the_user_left_them_after(monkeypatch, user_enabled):
    monkeypatch.setattr(hf_logging, "_tqdm_active", user_enabled)
    with quiet_model_io():
        assert not hf_logging.is_progress_bar_enabled()
    assert hf_logging.is_progress_bar_enabled() is user_enabled  # a user's "off" is not turned back on


def test_accelerate_sees_no_deepspeed_only_inside_and_only_before_it_is_imported(monkeypatch):
    from accelerate.utils import other

    original = other.is_deepspeed_available
    monkeypatch.delitem(sys.modules, "deepspeed", raising=False)
    with quiet_model_io():
        assert other.is_deepspeed_available() is False
    assert other.is_deepspeed_available is original
    monkeypatch.setitem(sys.modules, "deepspeed", object())  # imported: its engines may exist, so ask accelerate
    with quiet_model_io():
        assert other.is_deepspeed_available is original


def test_loading_and_saving_a_model_prints_no_bar(tmp_path, capfd):
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                             intermediate_size=64)
    folder = save_pretrained_dir(model, tokenizer, tmp_path / "tiny")
    load_model(folder)
    err = capfd.readouterr().err
    assert "Writing model shards" not in err and "Loading weights" not in err
    assert stat.S_IMODE((folder / "model.safetensors").stat().st_mode) == default_file_mode()


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)])
def test_give_default_mode_follows_the_umask(tmp_path, umask, mode):
    path = tmp_path / "weights.safetensors"
    path.write_bytes(b"x")
    path.chmod(0o600)
    previous = os.umask(umask)
    try:
        assert default_file_mode() == mode
        give_default_mode([path])
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.stat().st_mode) == mode
