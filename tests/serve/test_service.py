"""The endpoint as a service (issue 28), each problem reproduced against a real server on loopback:
keys and private sessions (1), recording only where used, bounded, read without stalling (2), limits
checked before the work (3), and 400s naming the field for bad numbers and tool schemas (5)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from rltk.rollout.base import SamplingParams
from rltk.rollout.hf import HFRolloutEngine
from rltk.serve.app import BackgroundServer, create_app
from rltk.serve.auth import exposure_warning
from rltk.serve.limits import Limits
from rltk.serve.sessions import SessionStore
from tests.serve.helpers import SpyEngine, tiny_chat_model
from tests.waits import scaled

MODEL = "tiny"
KEYS = ["key-alice", "key-bob"]


def serve(store=None, keys=None, limits=None, docs=False):
    tokenizer, model = tiny_chat_model()
    engine = SpyEngine(HFRolloutEngine(model, tokenizer))
    app = create_app(engine, tokenizer, model_name=MODEL, defaults=SamplingParams(max_new_tokens=4),
                     max_tokens_limit=16, max_model_len=128, window_s=0.01, store=store, api_keys=keys,
                     limits=limits, docs=docs)
    return BackgroundServer(app), engine


@pytest.fixture(scope="module")
def keyed():
    server, engine = serve(store=SessionStore(), keys=KEYS)
    with server:
        yield server


@pytest.fixture(scope="module")
def limited():
    limits = Limits(max_body_bytes=64 << 10, max_prompt_chars=1000, max_prompts=8, max_choices=16,
                    max_request_tokens=64)
    server, engine = serve(limits=limits)
    with server:
        yield server, engine


def root(server) -> str:
    return server.base_url.removesuffix("/v1")


def client(server, key, session=None):
    headers = {"X-Session-Id": session} if session else None
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, default_headers=headers)


# ---------------------------------------------------------------------- 1. keys and private sessions


def test_a_missing_or_wrong_key_is_a_401_on_every_route_but_health(keyed):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic key-alice"}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/rltk/sessions/default")):
            response = httpx.request(method, root(keyed) + path, headers=headers, json={}, timeout=scaled(10))
            assert response.status_code == 401, (headers, path)
            assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(root(keyed) + "/health", timeout=scaled(10)).status_code == 200
    with pytest.raises(openai.AuthenticationError, match="Incorrect API key"):
        client(keyed, "wrong").models.list()
    assert [m.id for m in client(keyed, "key-bob").models.list().data] == [MODEL]


def test_docs_and_the_openapi_schema_are_off_unless_asked_for(keyed):
    for path in ("/docs", "/openapi.json", "/redoc"):
        response = httpx.get(root(keyed) + path, headers={"Authorization": "Bearer key-alice"}, timeout=scaled(10))
        assert response.status_code == 404
    server, _ = serve(docs=True)
    with server:
        assert httpx.get(root(server) + "/openapi.json", timeout=scaled(10)).json()["info"]["title"] == "rltk"


def test_one_key_never_reads_another_keys_prompts_even_under_the_same_session_id(keyed):
    secret = "my password is hunter2"
    for session in (None, "shared-id"):  # no X-Session-Id: "default", which every client without one uses
        client(keyed, "key-alice", session).completions.create(model=MODEL, prompt=secret, max_tokens=2)
        client(keyed, "key-bob", session).completions.create(model=MODEL, prompt="hello", max_tokens=2)
        sid = session or "default"
        for key, text in (("key-alice", secret), ("key-bob", "hello")):
            body = httpx.get(f"{root(keyed)}/rltk/sessions/{sid}", headers={"Authorization": f"Bearer {key}"},
                             timeout=scaled(10)).json()
            tokenizer = keyed.app.state.rltk.tokenizer
            prompts = {tokenizer.decode(r["prompt_ids"]) for r in body["records"]}
            assert prompts == {text}, (key, sid)


def test_the_user_field_is_not_a_session_id(keyed):
    client(keyed, "key-alice").completions.create(model=MODEL, prompt="1", max_tokens=1, user="victim")
    store = keyed.app.state.rltk.store
    assert all(store.get("victim", owner) == [] for owner in {None, *(o for o, _ in store._sessions)})


def test_listening_beyond_loopback_without_a_key_warns_and_loopback_or_a_key_does_not():
    assert "without an API key" in exposure_warning("0.0.0.0", [])
    assert "without an API key" in exposure_warning("example.org", [])
    assert exposure_warning("0.0.0.0", ["k"]) is None
    assert exposure_warning("127.0.0.1", []) is None and exposure_warning("::1", []) is None
    assert exposure_warning("localhost", []) is None


# ---------------------------------------------------------------------- 2. recording only where used, bounded


def test_without_a_store_nothing_is_recorded_and_sessions_are_not_served():
    server, _ = serve()
    with server:
        client(server, "unused").completions.create(model=MODEL, prompt="12", max_tokens=2)
        assert server.app.state.rltk.store is None
        response = httpx.get(root(server) + "/rltk/sessions/default", timeout=scaled(10))
        assert response.status_code == 404 and "--record-sessions" in response.json()["error"]["message"]


def test_every_session_default_included_is_bounded_in_records_and_bytes():
    store = SessionStore(max_records=5, max_bytes=10_000)
    server, _ = serve(store=store)
    with server:
        for k in range(12):
            client(server, "unused").completions.create(model=MODEL, prompt=f"{k}+1=", max_tokens=2)
        long = "9" * 120  # 120 prompt ids: 8 * 120 + ... bytes a record
        for _ in range(12):
            client(server, "unused", "long").completions.create(model=MODEL, prompt=long, max_tokens=2)
    records = store.get("default")
    assert len(records) == 5 and store.evicted("default") == 7 and store.requests("default") == 12
    # the five newest: prompts "7+1=" .. "11+1="
    tokenizer = server.app.state.rltk.tokenizer
    assert [tokenizer.decode(r.prompt_ids) for r in records] == [f"{k}+1=" for k in range(7, 12)]
    # a "long" record is about 8 * 122 + 200 + text bytes: 10 000 bytes hold 5 of them at most
    assert 1 <= len(store.get("long")) <= 5 and store.evicted("long") >= 7


def test_reading_a_large_session_does_not_stall_the_server():
    store = SessionStore(max_records=None, max_bytes=None, max_total_bytes=None)
    ids = list(range(40, 1000)) * 2
    for k in range(1000):  # ~3900 ids a record: a response of about 10 MB
        store.add("big", f"r{k}", 0, ids, ids[:8], [-0.5] * 8, "stop", "x", "completions")
    server, _ = serve(store=store)
    with server:
        done = {}

        def read():
            start = time.monotonic()
            response = httpx.get(root(server) + "/rltk/sessions/big", timeout=scaled(120))
            done["seconds"] = time.monotonic() - start
            done["content"] = response.content  # parsed after the /health loop: 30 MB of json.loads holds this GIL

        reader = threading.Thread(target=read)
        reader.start()
        time.sleep(0.1)
        waits = []
        while reader.is_alive() and len(waits) < 20:
            start = time.monotonic()
            assert httpx.get(root(server) + "/health", timeout=scaled(30)).status_code == 200
            waits.append(time.monotonic() - start)
            time.sleep(0.02)
        reader.join()
    assert len(json.loads(done["content"])["records"]) == 1000
    assert waits, "the session was read before /health could be asked"
    assert max(waits) < scaled(max(0.5, done["seconds"] / 3)), (waits, done)


# ---------------------------------------------------------------------- 3. limits before the work


def test_a_body_over_the_limit_is_a_413_with_or_without_a_content_length(limited):
    server, engine = limited
    calls = len(engine.calls)
    big = json.dumps({"model": MODEL, "prompt": "x" * 100_000}).encode()
    response = httpx.post(server.base_url + "/completions", content=big, timeout=scaled(30),
                          headers={"content-type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "body_too_large"
    assert "65536 bytes" in response.json()["error"]["message"]

    def chunks():  # chunked transfer: no Content-Length to refuse early, the bytes are counted instead
        for start in range(0, len(big), 8192):
            yield big[start:start + 8192]

    response = httpx.post(server.base_url + "/completions", content=chunks(), timeout=scaled(30),
                          headers={"content-type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "body_too_large"
    assert len(engine.calls) == calls


def test_a_long_prompt_is_refused_by_its_characters_before_it_is_tokenized(limited):
    server, _ = limited
    start = time.monotonic()
    response = httpx.post(server.base_url + "/completions", json={"model": MODEL, "prompt": "1" * 50_000},
                          timeout=scaled(30))
    assert response.status_code == 400 and response.json()["error"]["code"] == "prompt_too_long"
    message = response.json()["error"]["message"]
    assert "50000 characters" in message and "not tokenized" in message
    chat = httpx.post(server.base_url + "/chat/completions", timeout=scaled(30),
                      json={"model": MODEL, "messages": [{"role": "user", "content": "2" * 600}] * 2})
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "prompt_too_long"
    assert time.monotonic() - start < scaled(5)


@pytest.mark.parametrize("depth", [40, 100_000])
def test_json_nested_too_deep_is_a_400_not_a_500(limited, depth):
    server, _ = limited
    body = b'{"model": "tiny", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
    if len(body) > 60_000:
        server2, _ = serve()  # the default 4 MiB body limit, so the depth is what is refused
        with server2:
            response = httpx.post(server2.base_url + "/completions", content=body, timeout=scaled(30),
                                  headers={"content-type": "application/json"})
    else:
        response = httpx.post(server.base_url + "/completions", content=body, timeout=scaled(30),
                              headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "json_too_deep"


def test_prompts_and_choices_times_tokens_per_request_are_capped_before_the_engine_runs(limited):
    server, engine = limited
    calls = len(engine.calls)
    many = httpx.post(server.base_url + "/completions", json={"model": MODEL, "prompt": [[10]] * 10_000}, timeout=scaled(30))
    assert many.status_code == 400 and many.json()["error"]["code"] == "too_many_prompts"
    assert "10000 prompts" in many.json()["error"]["message"] and "limit of 8" in many.json()["error"]["message"]
    wide = httpx.post(server.base_url + "/completions", json={"model": MODEL, "prompt": [[10]] * 4, "n": 8}, timeout=scaled(30))
    assert wide.status_code == 400 and wide.json()["error"]["code"] == "too_many_choices"
    costly = httpx.post(server.base_url + "/completions", timeout=scaled(30),
                        json={"model": MODEL, "prompt": "1", "n": 8, "max_tokens": 16})
    assert costly.status_code == 400 and costly.json()["error"]["code"] == "request_too_large"
    assert "8 choices x 16 tokens = 128" in costly.json()["error"]["message"]
    assert len(engine.calls) == calls
    fine = httpx.post(server.base_url + "/completions", json={"model": MODEL, "prompt": "1", "n": 8, "max_tokens": 8},
                      timeout=scaled(30))
    assert fine.status_code == 200 and len(fine.json()["choices"]) == 8


def test_tokenizing_a_long_prompt_does_not_hold_the_event_loop():
    server, _ = serve(limits=Limits(max_body_bytes=16 << 20, max_prompt_chars=1_000_000))
    with server:
        result = {}

        def send():
            result["response"] = httpx.post(server.base_url + "/completions", timeout=scaled(120),
                                            json={"model": MODEL, "prompt": "12+" * 200_000})

        sender = threading.Thread(target=send)
        sender.start()
        time.sleep(0.2)
        waits = []
        while sender.is_alive() and len(waits) < 10:
            start = time.monotonic()
            httpx.get(root(server) + "/health", timeout=scaled(60))
            waits.append(time.monotonic() - start)
        sender.join()
    assert result["response"].json()["error"]["code"] == "context_length_exceeded"  # tokenized, then refused
    assert not waits or max(waits) < scaled(1.0), waits


# ---------------------------------------------------------------------- 5. numbers and tools: 400s naming the field

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("extra, param", [
    ({"temperature": 1e-40}, "temperature"),
    ({"temperature": 3}, "temperature"),
    ({"seed": 2**70}, "seed"),
    ({"top_k": 2**40}, "top_k"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [TOOL, TOOL]}, "tools[1].function.name"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "missing_fn"}}}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": "required"}, "tool_choice"),
], ids=lambda v: str(v)[:30] if isinstance(v, dict) else v)
def test_bad_numbers_and_tool_schemas_are_400s_naming_the_field(limited, extra, param):
    server, _ = limited
    response = httpx.post(server.base_url + "/chat/completions", timeout=scaled(30),
                          json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    if "tool_choice" in extra and isinstance(extra["tool_choice"], dict):
        assert "'missing_fn'" in error["message"] and "get_weather" not in error["param"]


def test_an_integer_of_5001_digits_is_a_400(limited):
    server, _ = limited
    body = b'{"model": "tiny", "prompt": "1", "seed": ' + b"9" * 5001 + b"}"
    response = httpx.post(server.base_url + "/completions", content=body, timeout=scaled(30),
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]


def test_the_smallest_allowed_temperature_samples_finite_log_probs(limited):
    server, _ = limited
    reply = client(server, "unused").completions.create(model=MODEL, prompt="12", max_tokens=4, temperature=0.01,
                                                        logprobs=0)
    assert all(lp <= 0 and lp == lp for lp in reply.choices[0].logprobs.token_logprobs)
