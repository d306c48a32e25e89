"""`rltk export` writes a tokenizer that `AutoTokenizer` reads token for token as the run trained with it."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from rltk.models.loading import load_tokenizer
from rltk.models.tiny import build_char_tokenizer, build_tiny_model
from rltk.models.loading import make_auto_tokenizer_exact

TEXTS = ["a b", "12 + 30 = 42", "<|user|>3 km to m<|eos|><|assistant|>"]


def tiny_folder(path, tool_role=False):
    tokenizer = build_char_tokenizer(tool_role=tool_role)
    build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                     intermediate_size=64).save_pretrained(path)
    tokenizer.save_pretrained(path)  # what a run saves at <output_dir>/tokenizer, copied by the export
    return tokenizer


def test_before_the_fix_auto_tokenizer_drops_the_char_tokenizers_spaces(tmp_path):
    trained = tiny_folder(tmp_path)
    assert trained("a b")["input_ids"] == [25, 17, 26]
    # the failure the export fixes: transformers puts Qwen2Tokenizer (byte-level) in place of tokenizer.json
    assert AutoTokenizer.from_pretrained(tmp_path)("a b")["input_ids"] == [25, 26]


@pytest.mark.parametrize("trust_remote_code", [False, True])
def test_auto_tokenizer_reads_the_exported_tokenizer_exactly(tmp_path, trust_remote_code):
    trained = tiny_folder(tmp_path, tool_role=True)
    written = make_auto_tokenizer_exact(tmp_path)
    assert sorted(p.name for p in written) == ["tokenization_rltk.py", "tokenizer_config.json"]
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "TokenizersBackend"
    loaded = AutoTokenizer.from_pretrained(tmp_path, trust_remote_code=trust_remote_code)
    for text in TEXTS:
        assert loaded(text)["input_ids"] == trained(text)["input_ids"], text
    assert loaded.get_vocab() == trained.get_vocab()
    assert (loaded.eos_token_id, loaded.pad_token_id) == (trained.eos_token_id, trained.pad_token_id)
    messages = [{"role": "user", "content": "3 km to m"}]
    assert loaded.apply_chat_template(messages, tokenize=False) == trained.apply_chat_template(messages, tokenize=False)
    # rltk's own loader reads the folder as before
    assert load_tokenizer(tmp_path)("a b")["input_ids"] == [25, 17, 26]


def test_a_model_specific_tokenizer_class_is_left_alone(tmp_path):
    tiny_folder(tmp_path)
    config_file = tmp_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "Qwen2Tokenizer"  # a real Qwen folder: rltk loaded it through AutoTokenizer too
    config_file.write_text(json.dumps(config))
    assert make_auto_tokenizer_exact(tmp_path) == []
    assert "auto_map" not in json.loads(config_file.read_text())
