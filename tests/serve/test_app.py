"""The endpoint through the official ``openai`` client: routes, log-probs, n, batching, recording, tool calls,
and every refused request as an OpenAI-style error."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from rltk.rollout.base import SamplingParams
from rltk.rollout.hf import HFRolloutEngine
from rltk.serve.app import BackgroundServer, create_app
from rltk.serve.sessions import SessionStore
from tests.serve.helpers import ScriptedEngine, SpyEngine, tiny_chat_model
from tests.waits import scaled

MODEL = "tiny"


@pytest.fixture(scope="module")
def live():
    """A real hf engine on the tiny model, behind a spy, served in this process."""
    tokenizer, model = tiny_chat_model()
    engine = SpyEngine(HFRolloutEngine(model, tokenizer), delay_s=0.05)
    app = create_app(engine, tokenizer, model_name=MODEL, defaults=SamplingParams(max_new_tokens=6),
                     max_tokens_limit=16, max_model_len=128, window_s=0.05, store=SessionStore())
    with BackgroundServer(app) as server:
        yield server, engine, tokenizer


def client_for(server, session=None):
    headers = {"X-Session-Id": session} if session else None
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, default_headers=headers)


def test_models_lists_the_served_model(live):
    server, _, _ = live
    models = client_for(server).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client_for(server).models.retrieve(MODEL).id == MODEL


def test_chat_with_n_and_logprobs_returns_what_the_engine_produced_and_records_it_exactly(live):
    server, engine, tokenizer = live
    engine.calls.clear()
    reply = client_for(server, "chat-1").chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "12+7="}], n=3, logprobs=True, max_tokens=5)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "12+7="}], add_generation_prompt=True,
                                           tokenize=False)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    [(prompts, params, outputs)] = engine.calls
    assert prompts == [prompt_ids] * 3 and params.n == 1 and params.max_new_tokens == 5
    records = server.app.state.rltk.store.get("chat-1")
    assert len(reply.choices) == 3 and len(records) == 3
    for choice, record, [completion] in zip(reply.choices, records, outputs):
        assert record.prompt_ids == tuple(prompt_ids)
        assert record.completion_ids == tuple(completion.token_ids)
        assert record.logprobs == pytest.approx(completion.logprobs, abs=0)
        assert [t.logprob for t in choice.logprobs.content] == list(record.logprobs)
        assert choice.message.content == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        assert choice.finish_reason == completion.finish_reason
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert reply.usage.completion_tokens == sum(len(r.completion_ids) for r in records)


def test_completions_take_text_and_token_ids_and_number_choices_prompt_major(live):
    server, engine, tokenizer = live
    engine.calls.clear()
    reply = client_for(server, "cmpl-1").completions.create(model=MODEL, prompt=[[10, 11, 12], [13]], n=2,
                                                            max_tokens=4, logprobs=0)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    records = server.app.state.rltk.store.get("cmpl-1")
    assert [r.prompt_ids for r in records] == [(10, 11, 12)] * 2 + [(13,)] * 2
    for choice, record in zip(reply.choices, records):
        assert choice.logprobs.token_logprobs == list(record.logprobs)
        assert len(choice.logprobs.tokens) == len(record.completion_ids) <= 4
    text = client_for(server).completions.create(model=MODEL, prompt="1+1=", max_tokens=3)
    assert len(text.choices) == 1 and text.choices[0].finish_reason in ("stop", "length")


def test_greedy_is_temperature_zero_and_repeats_exactly(live):
    server, _, _ = live
    client = client_for(server)
    ask = lambda: client.completions.create(model=MODEL, prompt="7*8=", max_tokens=6, temperature=0, n=2)
    first, second = ask(), ask()
    texts = [c.text for c in first.choices + second.choices]
    assert len(set(texts)) == 1


def test_concurrent_requests_are_coalesced_into_fewer_engine_calls(live):
    server, engine, _ = live
    engine.calls.clear()
    client = client_for(server)
    with ThreadPoolExecutor(12) as pool:
        replies = list(pool.map(lambda k: client.completions.create(model=MODEL, prompt=f"{k}+1=", max_tokens=3),
                                range(12)))
    assert len(replies) == 12
    assert 1 <= len(engine.calls) < 12
    assert sum(len(prompts) for prompts, _, _ in engine.calls) == 12
    assert engine.threads == {"rltk-serve-batcher"}


def test_the_session_id_comes_from_the_header_never_the_user_field_and_is_readable_back(live):
    server, _, _ = live
    store = server.app.state.rltk.store
    before = len(store.get("default"))
    client_for(server).completions.create(model=MODEL, prompt="1=", max_tokens=2, user="from-user-field")
    assert store.get("from-user-field") == [] and len(store.get("default")) == before + 1
    client_for(server, "hdr").completions.create(model=MODEL, prompt="1=", max_tokens=2, user="ignored")
    assert len(store.get("hdr")) == 1 and store.get("ignored") == []
    body = httpx.get(server.base_url.removesuffix("/v1") + "/rltk/sessions/hdr").json()
    # 7 special tokens, then "0123456789 +-*/=": "1" is 7 + 1, "=" is 7 + 15
    assert body["records"][0]["prompt_ids"] == [8, 22]


# ---------------------------------------------------------------------- errors


def chat(server, **body):
    return httpx.post(server.base_url + "/chat/completions", json={"model": MODEL, **body}, timeout=scaled(30))


BAD_CHAT = [
    ({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}, 404, "model", "model_not_found"),
    ({"messages": []}, 400, "messages", None),
    ({"messages": "hello"}, 400, "messages", None),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", None),
    ({"messages": [{"role": "user", "content": "x"}], "n": 0}, 400, "n", None),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": -0.5}, 400, "temperature", None),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, 400, "top_p", None),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 17}, 400, "max_tokens", "max_tokens_exceeded"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens", None),
    ({"messages": [{"role": "user", "content": "x" * 130}]}, 400, "messages", "context_length_exceeded"),
    ({"messages": [{"role": "user", "content": "x" * 120}], "max_tokens": 16}, 400, "max_tokens",
     "context_length_exceeded"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, 400, "stream", None),
    ({"messages": [{"role": "user", "content": "x"}], "stop": 5}, 400, "stop", None),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "bad"}]}, 400, "tools[0]", None),
]


@pytest.mark.parametrize("body, status, param, code", BAD_CHAT,
                         ids=[f"{b[2]}-{b[1]}-{i}" for i, b in enumerate(BAD_CHAT)])
def test_bad_chat_requests_get_openai_style_errors(live, body, status, param, code):
    server, _, _ = live
    response = chat(server, **body)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["code"] == code
    assert error["type"] == "invalid_request_error" and len(error["message"]) > 20


def test_the_openai_client_raises_its_own_error_classes_with_the_message(live):
    server, _, _ = live
    client = client_for(server)
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert "'nope' does not exist" in missing.value.body["message"] and MODEL in missing.value.body["message"]
    with pytest.raises(openai.BadRequestError) as budget:
        client.completions.create(model=MODEL, prompt="1", max_tokens=99)
    assert "budget of 16" in budget.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "x"}])


@pytest.mark.parametrize("body, param", [
    ({"prompt": ""}, "prompt"), ({"prompt": [["a"]]}, "prompt"), ({"prompt": [999999]}, "prompt"),
    ({"prompt": "x", "n": 0}, "n"), ({"prompt": "x", "echo": True}, "echo"), ({"prompt": "x", "logprobs": 9}, "logprobs"),
])
def test_bad_completion_requests_get_400(live, body, param):
    server, _, _ = live
    response = httpx.post(server.base_url + "/completions", json={"model": MODEL, **body}, timeout=scaled(30))
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_malformed_json_and_unknown_routes_are_openai_style_too(live):
    server, _, _ = live
    bad = httpx.post(server.base_url + "/chat/completions", content=b"{not json", timeout=scaled(30),
                     headers={"content-type": "application/json"})
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
    missing = httpx.get(server.base_url + "/embeddings", timeout=scaled(30))
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


# ---------------------------------------------------------------------- scripted engine: tool calls, stop strings


@pytest.fixture(scope="module")
def scripted():
    tokenizer, _ = tiny_chat_model()

    def script(prompt_text):
        # "broken" first: with tools= the prompt also holds the tool line, "tools: get_weather(city)"
        if "broken" in prompt_text:
            return '<tool_call>{"name": oops}</tool_call>'
        if "weather" in prompt_text:
            return 'Let me see.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
        return "one. two. three"

    engine = ScriptedEngine(tokenizer, script)
    app = create_app(engine, tokenizer, model_name=MODEL, defaults=SamplingParams(max_new_tokens=120),
                     max_model_len=None, store=SessionStore())
    with BackgroundServer(app) as server:
        yield server, engine, tokenizer


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


def test_tool_calls_are_parsed_with_the_named_parser(scripted):
    server, _, _ = scripted
    reply = client_for(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "weather?"}], tools=TOOLS)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me see."
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
    assert call.id.startswith("call_")


def test_unparseable_tool_calls_and_tool_choice_none_leave_the_text_as_content(scripted):
    server, _, _ = scripted
    client = client_for(server)
    broken = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "broken"}],
                                            tools=TOOLS).choices[0]
    assert broken.message.tool_calls is None and broken.message.content.startswith("<tool_call>")
    assert broken.finish_reason == "stop"
    unparsed = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "weather"}],
                                              tools=TOOLS, tool_choice="none").choices[0]
    assert unparsed.message.tool_calls is None and "<tool_call>" in unparsed.message.content


def test_a_stop_string_cuts_text_and_recorded_ids_at_its_first_occurrence(scripted):
    server, _, tokenizer = scripted
    reply = client_for(server, "stop-1").completions.create(model=MODEL, prompt="go", stop=["two", "."],
                                                            logprobs=0)
    choice = reply.choices[0]
    assert choice.text == "one" and choice.finish_reason == "stop"
    [record] = server.app.state.rltk.store.get("stop-1")
    # the tokens up to and including the stop string ".", with their own log-probs
    assert tokenizer.decode(list(record.completion_ids)) == "one."
    assert record.logprobs == (-0.1, -0.2, -0.3, -0.4)
    assert choice.logprobs.token_logprobs == [-0.1, -0.2, -0.3, -0.4]


def test_messages_the_chat_template_refuses_are_a_400_naming_the_roles(live):
    # the tiny template raises on a second system message when tools are given (every role renders)
    server, _, _ = live
    messages = [{"role": "system", "content": "a"}, {"role": "user", "content": "x"}, {"role": "system", "content": "b"}]
    response = chat(server, messages=messages, tools=TOOLS)
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "cannot render messages with roles ['system', 'user', 'system']" in message
    assert "only the first message may be a system message" in message


def test_streaming_clients_get_the_whole_completion_as_chunks(scripted):
    server, _, _ = scripted
    client = client_for(server, "stream-1")
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "weather?"}],
                                                 tools=TOOLS, stream=True, n=2,
                                                 stream_options={"include_usage": True}))
    by_index = {}
    for chunk in chunks:
        for choice in chunk.choices:
            entry = by_index.setdefault(choice.index, {"content": "", "calls": [], "finish": None})
            entry["content"] += choice.delta.content or ""
            entry["calls"] += choice.delta.tool_calls or []
            entry["finish"] = choice.finish_reason or entry["finish"]
    assert sorted(by_index) == [0, 1]
    for entry in by_index.values():
        assert entry["content"] == "Let me see." and entry["finish"] == "tool_calls"
        assert [c.function.name for c in entry["calls"]] == ["get_weather"]
    assert chunks[-1].usage.completion_tokens == 2 * len(server.app.state.rltk.store.get("stream-1")[0].completion_ids)
    texts = [c.choices[0].text for c in client.completions.create(model=MODEL, prompt="go", stream=True) if c.choices]
    assert "".join(texts) == "one. two. three"
