"""The tokenizer the Tinker service serves loads, through plain ``AutoTokenizer``, to exactly the
served tokenizer: the tiny model's character tokenizer beside a ``qwen2`` config.json (where
transformers otherwise builds a ``Qwen2Tokenizer`` that drops every space)."""

from __future__ import annotations

import pytest

from rltk.models.tiny import build_char_tokenizer, build_tiny_model

TEXTS = ["next a", "1 + 2 = 3", "a\tb\nc  d", "  12 +  7 =\n19\t"]


def test_the_served_folder_loads_through_auto_tokenizer_to_the_same_ids(tmp_path):
    from transformers import AutoTokenizer

    from rltk.tinker_service.hub import ServedTokenizer

    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer)
    served = ServedTokenizer.write("tiny", tokenizer, model.config, tmp_path / "served")
    assert '"model_type": "qwen2"' in served.files["config.json"].decode()
    loaded = AutoTokenizer.from_pretrained(str(served.folder))
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert loaded.encode(text, add_special_tokens=False) == ids, text
        assert loaded.decode(ids) == text
    assert ServedTokenizer.write("tiny", tokenizer, model.config, tmp_path / "again").commit == served.commit
    assert len(served.commit) == 40


def test_the_hub_routes_name_what_they_do_not_serve(tmp_path):
    pytest.importorskip("fastapi")
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from rltk.tinker_service.hub import ServedTokenizer, add_hub_routes

    tokenizer = build_char_tokenizer()
    served = ServedTokenizer.write("tiny", tokenizer, None, tmp_path / "served")
    app = FastAPI()
    add_hub_routes(app, served)
    client = TestClient(app)
    ok = client.head("/hub/tiny/resolve/main/tokenizer.json")
    assert ok.status_code == 200 and ok.headers["x-repo-commit"] == served.commit
    assert client.get("/hub/tiny/resolve/main/tokenizer.json").content == served.files["tokenizer.json"]
    missing = client.head("/hub/tiny/resolve/main/vocab.txt")
    assert (missing.status_code, missing.headers["x-error-code"]) == (404, "EntryNotFound")
    other = client.get("/hub/Qwen/Qwen3-8B/resolve/main/config.json")
    assert other.headers["x-error-code"] == "RepoNotFound"
    assert "serves the tokenizer of 'tiny' only" in other.json()["error"]
    info = client.get("/hub/api/models/tiny/revision/main").json()
    assert info["sha"] == served.commit and {"rfilename": "tokenizer.json"} in info["siblings"]
