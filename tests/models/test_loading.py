import json
import logging

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from rltk.models.loading import ensure_pad_token, load_model, load_tokenizer
from rltk.models.tiny import build_char_tokenizer, build_tiny_model, save_pretrained_dir

# Spaces, newlines and tabs are exactly what a Qwen-style pre-tokenizer rewrites.
TRICKY_TEXT = "  17 + 25 =\n42\t#### 7  \\boxed{3/4} <answer>(1+2)*3</answer>\n\n"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, seed=1)
    folder = save_pretrained_dir(model, tokenizer, tmp_path_factory.mktemp("tiny"))
    return folder, tokenizer, model


def test_tokenizer_ids_round_trip_beside_a_qwen2_config(tiny_dir):
    folder, original, _ = tiny_dir
    assert json.loads((folder / "config.json").read_text())["model_type"] == "qwen2"
    loaded = load_tokenizer(folder)
    expected = original(TRICKY_TEXT, add_special_tokens=False)["input_ids"]
    assert len(expected) == len(TRICKY_TEXT)
    assert loaded(TRICKY_TEXT, add_special_tokens=False)["input_ids"] == expected
    assert loaded.decode(expected) == TRICKY_TEXT
    assert (loaded.pad_token_id, loaded.eos_token_id, loaded.bos_token_id, loaded.unk_token_id) == (0, 1, 2, 3)
    assert len(loaded) == len(original)


def test_loaded_tokenizer_keeps_the_chat_template(tiny_dir):
    folder, _, _ = tiny_dir
    text = load_tokenizer(folder).apply_chat_template(
        [{"role": "user", "content": "1+2="}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|user|>1+2=<|eos|><|assistant|>"


def test_model_specific_tokenizer_class_goes_through_auto_tokenizer(tiny_dir, tmp_path, caplog):
    # A folder declaring Qwen2Tokenizer gets Qwen's class, as real model folders must;
    # here that class disagrees with tokenizer.json, which is reported.
    folder, _, _ = tiny_dir
    for name in ("tokenizer.json", "config.json"):
        (tmp_path / name).write_text((folder / name).read_text())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "Qwen2Tokenizer"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING, logger="rltk.models.loading"):
        loaded = load_tokenizer(tmp_path)
    assert type(loaded).__name__ == "Qwen2Tokenizer"
    assert "encodes differently" in caplog.text


def test_generic_tokenizer_without_model_config_loads_exactly(tiny_dir, tmp_path):
    folder, original, _ = tiny_dir
    (tmp_path / "tokenizer.json").write_text((folder / "tokenizer.json").read_text())
    loaded = load_tokenizer(tmp_path)
    assert isinstance(loaded, PreTrainedTokenizerFast)
    assert loaded(TRICKY_TEXT)["input_ids"] == original(TRICKY_TEXT, add_special_tokens=False)["input_ids"]


def test_model_round_trips_bit_for_bit(tiny_dir):
    folder, _, model = tiny_dir
    loaded = load_model(folder)
    ids = torch.tensor([[8, 9, 18, 10, 22]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert next(loaded.parameters()).dtype == torch.float32


def test_model_dtype_option(tiny_dir):
    folder, _, _ = tiny_dir
    assert next(load_model(folder, dtype="bf16").parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"model.dtype='float8'.*Valid: float32"):
        load_model(folder, dtype="float8")


def test_missing_folder_error_names_the_config_key_and_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match=rf"model.path='{missing}': the folder does not exist"):
        load_model(missing)
    with pytest.raises(FileNotFoundError, match=r"policy.path=.*does not exist"):
        load_tokenizer(missing, config_key="policy.path")


def test_folder_without_config_is_not_a_model_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(FileNotFoundError, match=r"not a Hugging Face model folder: it has no config.json.*notes.txt"):
        load_model(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"holds no tokenizer"):
        load_tokenizer(tmp_path)


def test_ensure_pad_token_uses_eos():
    tokenizer = build_char_tokenizer()
    tokenizer.pad_token = None
    assert tokenizer.pad_token_id is None
    assert ensure_pad_token(tokenizer).pad_token_id == tokenizer.eos_token_id == 1
    already = build_char_tokenizer()
    assert ensure_pad_token(already).pad_token_id == 0


def test_ensure_pad_token_without_eos_is_an_error():
    tokenizer = build_char_tokenizer()
    tokenizer.pad_token = None
    tokenizer.eos_token = None
    with pytest.raises(ValueError, match="neither a pad nor an eos token"):
        ensure_pad_token(tokenizer)
