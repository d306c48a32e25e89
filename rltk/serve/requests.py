"""Reading a request body into what the engine gets: validation, chat rendering, tokenization.

Everything here is synchronous and CPU-bound; the routes run :func:`prepare_chat` and
:func:`prepare_completion` in a worker thread, so a long prompt never holds the event
loop (``/health`` and every other request keep being answered). The cheap checks come
first: the request's shape and numbers, the counts of :class:`~rltk.serve.limits.Limits`
and the prompt's characters are checked before anything is tokenized.

Numbers are checked against what the engine can do, each refusal a 400 naming the field:
``temperature`` 0 (greedy) or in [0.01, 2] (below 0.01 the logits divided by it overflow
to inf/nan probabilities), ``top_p`` in (0, 1], ``top_k`` an integer in [-1, 2^31 - 1],
``seed`` a 64-bit signed integer, ``n`` in [1, 128], ``max_tokens`` in [1, the budget].
``presence_penalty``, ``frequency_penalty`` and ``logit_bias`` are not applied by the
engines, so anything but their neutral value is refused rather than ignored.

Tools follow OpenAI's rules: a list of at most 128 ``{"type": "function", "function":
{"name", "description"?, "parameters"?, "strict"?}}``, names of 1-64 letters, digits,
``_`` or ``-``, unique, ``parameters`` a JSON-Schema object (a dict). ``tool_choice``
may be ``"none"`` or ``"auto"``; ``"required"`` and a named function would need
constrained decoding, which the engines do not do, so they are refused (400) rather
than answered with plain text, and a named function that is not among the tools is
named in the refusal.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from typing import Any

from rltk.rollout.base import SamplingParams
from rltk.serve.errors import APIError
from rltk.serve.sessions import tool_results_sent

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_N = 128  # more choices than this in one request is almost certainly a mistake
MIN_TEMPERATURE = 0.01
MAX_TEMPERATURE = 2.0
MAX_TOP_K = 2**31 - 1
SEED_RANGE = (-(2**63), 2**63 - 1)
MAX_TOOLS = 128
TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


@dataclass
class Prepared:
    """A validated request: its prompts' ids, sampling, stop strings and what the response needs."""

    prompts: list[list[int]]
    params: SamplingParams
    stops: list[str]
    tools: list[dict] | None = None
    tool_choice: Any = None
    logprobs: Any = None
    top_logprobs: int = 0
    # the tool messages the request sent back after its last assistant turn, and how many are errors
    # (rltk.serve.sessions.tool_results_sent): recorded for the agentic workflow's tool metrics
    tool_results: tuple[int, int] = (0, 0)
    # vLLM's extension: each choice also carries its exact token ids and the weight version of each token
    return_token_ids: bool = False


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_model(state, model: Any) -> None:
    if model is None:
        raise APIError(400, "'model' is required; this endpoint serves " + repr(state.model_name), param="model")
    if model != state.model_name:
        raise APIError(404, f"The model {str(model)[:200]!r} does not exist; this endpoint serves "
                            f"{state.model_name!r} (GET /v1/models lists it)", param="model", code="model_not_found")


def _neutral_extras(body: dict) -> None:
    for key in ("presence_penalty", "frequency_penalty"):
        value = body.get(key)
        if value is not None and (not _is_number(value) or value != 0):
            raise APIError(400, f"'{key}' is not supported by this endpoint's engines; leave it out or send 0 "
                                f"(got {str(value)[:40]})", param=key)
    if body.get("logit_bias"):
        raise APIError(400, "'logit_bias' is not supported by this endpoint's engines; leave it out",
                       param="logit_bias")


def _stop_token_ids(body: dict, default: list[int] | None) -> list[int] | None:
    """vLLM's extension ``stop_token_ids``: the token ids that end a completion (``[]``: only ``max_tokens``),
    in place of the tokenizer's end-of-text; a server engine sends the trainer's own."""
    ids = body.get("stop_token_ids")
    if ids is None:
        return default
    if not isinstance(ids, list) or len(ids) > 64 or not all(_is_int(t) and t >= 0 for t in ids):
        raise APIError(400, f"'stop_token_ids' must be a list of at most 64 token ids >= 0, got {str(ids)[:80]}",
                       param="stop_token_ids")
    return list(ids)


def sampling(state, body: dict, prompt_lengths: list[int]) -> tuple[SamplingParams, list[str]]:
    """The request's :class:`SamplingParams` and stop strings, or a 400 naming the field."""
    limits = state.limits
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise APIError(400, f"'stream' must be true or false, got {stream!r}", param="stream")
    n = body.get("n", 1)
    n = 1 if n is None else n
    if not _is_int(n) or n < 1 or n > MAX_N:
        raise APIError(400, f"'n' must be an integer in [1, {MAX_N}], got {str(n)[:40]}", param="n")
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise APIError(400, f"'best_of' other than n is not supported (got best_of={str(best_of)[:40]}, n={n})",
                       param="best_of")
    choices = n * len(prompt_lengths)
    if choices > limits.max_choices:
        raise APIError(400, f"the request asks for {choices} choices ({len(prompt_lengths)} prompts x n={n}), over "
                            f"this endpoint's limit of {limits.max_choices} (--max-choices)", param="n",
                       code="too_many_choices")
    temperature = body.get("temperature")
    if temperature is not None and (not _is_number(temperature) or not (
            temperature == 0 or MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE)):
        raise APIError(400, f"'temperature' must be 0 (greedy) or a number in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}] "
                            f"(below {MIN_TEMPERATURE} the scaled logits overflow), got {str(temperature)[:40]}",
                       param="temperature")
    top_p = body.get("top_p")
    if top_p is not None and (not _is_number(top_p) or not 0 < top_p <= 1):
        raise APIError(400, f"'top_p' must be a number in (0, 1], got {str(top_p)[:40]}", param="top_p")
    top_k = body.get("top_k")
    if top_k is not None and (not _is_int(top_k) or not -1 <= top_k <= MAX_TOP_K):
        raise APIError(400, f"'top_k' must be an integer in [-1, {MAX_TOP_K}] (0 or -1 turn it off), got "
                            f"{str(top_k)[:40]}", param="top_k")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]):
        raise APIError(400, f"'seed' must be a 64-bit signed integer in [-2^63, 2^63 - 1], got {str(seed)[:40]}",
                       param="seed")
    _neutral_extras(body)

    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(key)
    longest = max(prompt_lengths)
    room = None if state.max_model_len is None else state.max_model_len - longest
    if room is not None and room < 1:
        raise APIError(400, f"the prompt is {longest} tokens, which leaves no room for a completion in the "
                            f"model's context of {state.max_model_len} tokens; shorten the conversation",
                       param="messages" if "messages" in body else "prompt", code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(state.defaults.max_new_tokens, state.max_tokens_limit, room or state.max_tokens_limit)
    elif not _is_int(max_tokens) or max_tokens < 1:
        raise APIError(400, f"'{key}' must be an integer >= 1, got {str(max_tokens)[:40]}", param=key)
    elif max_tokens > state.max_tokens_limit:
        raise APIError(400, f"'{key}'={max_tokens} is more than this endpoint's budget of {state.max_tokens_limit} "
                            f"new tokens per request; ask for at most {state.max_tokens_limit}", param=key,
                       code="max_tokens_exceeded")
    elif room is not None and max_tokens > room:
        raise APIError(400, f"the prompt is {longest} tokens and '{key}' asks for {max_tokens} more, over the "
                            f"model's context of {state.max_model_len} tokens; ask for at most {room} or shorten "
                            "the prompt", param=key, code="context_length_exceeded")
    if choices * max_tokens > limits.max_request_tokens:
        raise APIError(400, f"the request may make {choices} choices x {max_tokens} tokens = {choices * max_tokens} "
                            f"new tokens, over this endpoint's limit of {limits.max_request_tokens} per request "
                            "(--max-request-tokens); lower n, the prompts or max_tokens", param=key,
                       code="request_too_large")

    stop = body.get("stop")
    if stop is None:
        stops = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise APIError(400, f"'stop' must be a string or a list of at most 4 strings, got {str(stop)[:80]}",
                       param="stop")
    stops = [s for s in stops if s]

    fields = {"n": n, "max_new_tokens": max_tokens, "seed": seed,
              "temperature": state.defaults.temperature, "top_p": state.defaults.top_p,
              "top_k": state.defaults.top_k, "greedy": False,
              "stop_token_ids": _stop_token_ids(body, state.defaults.stop_token_ids)}
    if temperature is not None:
        if temperature == 0:
            fields["greedy"] = True
        else:
            fields["temperature"] = float(temperature)
    if top_p is not None:
        fields["top_p"] = float(top_p)
    if top_k is not None:
        fields["top_k"] = max(top_k, 0)
    if state.sampling_override:
        fields.update(state.sampling_override)
    try:
        params = replace(state.defaults, **fields)
    except ValueError as exc:
        raise APIError(400, str(exc)) from None
    return params, stops


def _text_of(content: Any, where: str) -> str | None:
    """A message's content as text: a string, ``None``, or a list of ``{"type": "text", "text": ...}`` parts."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for number, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"{where}[{number}]: only text parts ({{'type': 'text', 'text': ...}}) are "
                                    f"supported, got {str(part)[:200]}", param=where)
            texts.append(part["text"])
        return "".join(texts)
    raise APIError(400, f"{where} must be a string or a list of text parts, got {type(content).__name__}", param=where)


def messages_of(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, f"'messages' must be a non-empty list of messages, got {str(messages)[:200]}",
                       param="messages")
    out = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise APIError(400, f"{where} must be an object with 'role' and 'content', got {str(message)[:200]}",
                           param=where)
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise APIError(400, f"{where}.role={str(role)[:40]!r} is not a valid role; valid roles: {list(CHAT_ROLES)}",
                           param=f"{where}.role")
        rendered = {key: value for key, value in message.items() if key not in ("content", "tool_calls")}
        rendered["content"] = _text_of(message.get("content"), f"{where}.content")
        if rendered["content"] is None and role != "assistant":
            raise APIError(400, f"{where} (role {role!r}) needs a 'content'", param=f"{where}.content")
        if rendered["content"] is None:
            rendered["content"] = ""
        if message.get("tool_calls"):
            rendered["tool_calls"] = _template_tool_calls(message["tool_calls"], f"{where}.tool_calls")
        out.append(rendered)
    return out


def _template_tool_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's OpenAI ``tool_calls`` in the form chat templates read (arguments as a dict)."""
    if not isinstance(calls, list):
        raise APIError(400, f"{where} must be a list, got {type(calls).__name__}", param=where)
    out = []
    for number, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise APIError(400, f"{where}[{number}] must be {{'type': 'function', 'function': {{'name', "
                                f"'arguments'}}}}, got {str(call)[:200]}", param=f"{where}[{number}]")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except (ValueError, RecursionError) as exc:
                raise APIError(400, f"{where}[{number}].function.arguments is not valid JSON: {exc}",
                               param=f"{where}[{number}].function.arguments") from None
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out


def tools_of(body: dict) -> list[dict] | None:
    """The request's ``tools``, checked against OpenAI's rules (see the module docstring)."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise APIError(400, f"'tools' must be a list of function tools, got {type(tools).__name__}", param="tools")
    if len(tools) > MAX_TOOLS:
        raise APIError(400, f"'tools' holds {len(tools)} tools; at most {MAX_TOOLS} are allowed", param="tools")
    names = set()
    for number, item in enumerate(tools):
        where = f"tools[{number}]"
        function = item.get("function") if isinstance(item, dict) else None
        if not isinstance(item, dict) or item.get("type") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str):
            raise APIError(400, f"{where} must be {{'type': 'function', 'function': {{'name', "
                                f"'description', 'parameters'}}}}, got {str(item)[:200]}", param=where)
        name = function["name"]
        if not TOOL_NAME.match(name):
            raise APIError(400, f"{where}.function.name={name[:80]!r} must be 1-64 letters, digits, '_' or '-'",
                           param=f"{where}.function.name")
        if name in names:
            raise APIError(400, f"{where}.function.name={name!r} names a second tool; tool names must be unique",
                           param=f"{where}.function.name")
        names.add(name)
        if "description" in function and not isinstance(function["description"], str):
            raise APIError(400, f"{where}.function.description must be a string, got "
                                f"{type(function['description']).__name__}", param=f"{where}.function.description")
        if "parameters" in function and not isinstance(function["parameters"], dict):
            raise APIError(400, f"{where}.function.parameters must be a JSON Schema object (a dict), got "
                                f"{type(function['parameters']).__name__}", param=f"{where}.function.parameters")
        if "strict" in function and function["strict"] is not None and not isinstance(function["strict"], bool):
            raise APIError(400, f"{where}.function.strict must be true or false", param=f"{where}.function.strict")
    return tools or None


def tool_choice_of(body: dict, tools: list[dict] | None) -> str:
    """``"none"`` or ``"auto"``; anything else is a 400 (see the module docstring)."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("none", "auto"):
        return choice
    names = [t["function"]["name"] for t in tools or []]
    if choice == "required":
        raise APIError(400, "tool_choice='required' is not supported: this endpoint cannot force a tool call "
                            "(its engines do not constrain decoding); use 'auto'", param="tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict) \
            and isinstance(choice["function"].get("name"), str):
        name = choice["function"]["name"]
        if name not in names:
            raise APIError(400, f"tool_choice names the function {name[:80]!r}, which is not among the request's "
                                f"tools {names}", param="tool_choice")
        raise APIError(400, f"tool_choice naming a function ({name!r}) is not supported: this endpoint cannot "
                            "force a tool call (its engines do not constrain decoding); use 'auto'",
                       param="tool_choice")
    raise APIError(400, "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                        f"{{'name': ...}}}}, got {str(choice)[:200]}", param="tool_choice")


def _chat_chars(messages: list[dict], tools: list[dict] | None) -> int:
    chars = sum(len(m["content"]) for m in messages)
    chars += sum(len(json.dumps(m["tool_calls"])) for m in messages if m.get("tool_calls"))
    return chars + (len(json.dumps(tools)) if tools else 0)


def _check_chars(state, chars: int, param: str) -> None:
    limit = state.limits.max_prompt_chars
    if chars > limit:
        raise APIError(400, f"the prompt is {chars} characters, over this endpoint's limit of {limit} characters "
                            "(--max-prompt-chars); it was not tokenized", param=param, code="prompt_too_long")


def render_chat(state, messages: list[dict], tools: list[dict] | None) -> list[int]:
    tokenizer = state.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "the served model's tokenizer has no chat template; use /v1/completions with a "
                            "prompt instead", param="messages")
    from rltk.data.chat import render_ids

    try:  # the rendering multi_turn opens its episodes with, so both give one prompt the same ids
        ids = render_ids(tokenizer, messages, tools=tools)
    except ValueError as exc:  # the template refused them (jinja's TemplateError or its own raise_exception)
        raise APIError(400, str(exc), param="messages") from None
    if not ids:
        raise APIError(400, "the messages render to no tokens", param="messages")
    return list(ids)


def prepare_chat(state, body: dict) -> Prepared:
    """Validate a chat request, then render and tokenize it (call it off the event loop)."""
    check_model(state, body.get("model"))
    messages = messages_of(body)
    tools = tools_of(body)
    tool_choice = tool_choice_of(body, tools)
    logprobs = body.get("logprobs") or False
    if not isinstance(logprobs, bool):
        raise APIError(400, f"'logprobs' must be true or false, got {str(logprobs)[:40]}", param="logprobs")
    top_logprobs = body.get("top_logprobs") or 0
    if not _is_int(top_logprobs) or not 0 <= top_logprobs <= 20:
        raise APIError(400, f"'top_logprobs' must be an integer in [0, 20], got {str(top_logprobs)[:40]}",
                       param="top_logprobs")
    _check_chars(state, _chat_chars(messages, tools), "messages")
    prompt_ids = render_chat(state, messages, tools)
    params, stops = sampling(state, body, [len(prompt_ids)])
    return Prepared([prompt_ids], params, stops, tools, tool_choice, logprobs, top_logprobs,
                    tool_results_sent(messages))


def prompts_of(state, body: dict) -> list[list[int]]:
    """``prompt`` as token-id lists: a text, a list of texts, a token-id list, or a list of those.

    The prompt count and the characters are checked before any text is tokenized.
    """
    prompt = body.get("prompt")
    limits = state.limits

    def count(number: int) -> None:
        if number > limits.max_prompts:
            raise APIError(400, f"'prompt' holds {number} prompts, over this endpoint's limit of {limits.max_prompts} "
                                "per request (--max-prompts)", param="prompt", code="too_many_prompts")

    def encode(text: str, where: str) -> list[int]:
        ids = state.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise APIError(400, f"{where} is empty; a prompt needs at least one token", param="prompt")
        return list(ids)

    def token_ids(ids: list, where: str) -> list[int]:
        vocab = len(state.tokenizer)
        if not ids or not all(_is_int(t) and 0 <= t < vocab for t in ids):
            raise APIError(400, f"{where} must be a non-empty list of token ids in [0, {vocab}), got "
                                f"{str(ids[:8])[:200]}", param="prompt")
        return list(ids)

    if isinstance(prompt, str):
        _check_chars(state, len(prompt), "prompt")
        return [encode(prompt, "prompt")]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            count(len(prompt))
            _check_chars(state, sum(len(p) for p in prompt), "prompt")
            return [encode(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
        if all(_is_int(t) for t in prompt):
            return [token_ids(prompt, "prompt")]
        if all(isinstance(p, list) for p in prompt):
            count(len(prompt))
            return [token_ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    raise APIError(400, "'prompt' must be a string, a list of strings, a list of token ids or a list of token-id "
                        f"lists, got {str(prompt)[:200]}", param="prompt")


def prepare_completion(state, body: dict) -> Prepared:
    """Validate a completions request, then tokenize its prompts (call it off the event loop)."""
    check_model(state, body.get("model"))
    if body.get("echo"):
        raise APIError(400, "echo=true is not supported by this endpoint", param="echo")
    if body.get("suffix"):
        raise APIError(400, "'suffix' is not supported by this endpoint", param="suffix")
    logprobs = body.get("logprobs")
    if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= 5):
        raise APIError(400, f"'logprobs' must be an integer in [0, 5] or null, got {str(logprobs)[:40]}",
                       param="logprobs")
    return_token_ids = body.get("return_token_ids") or False
    if not isinstance(return_token_ids, bool):
        raise APIError(400, f"'return_token_ids' must be true or false, got {str(return_token_ids)[:40]}",
                       param="return_token_ids")
    prompts = prompts_of(state, body)
    params, stops = sampling(state, body, [len(p) for p in prompts])
    return Prepared(prompts, params, stops, logprobs=logprobs, return_token_ids=return_token_ids)
