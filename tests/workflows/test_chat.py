import pytest

from rltk.models.tiny import build_char_tokenizer
from rltk.workflows.chat import TurnRenderer, render_ids, render_text, row_messages
from tests.workflows.multi_turn_helpers import tool_tokenizer

# A Qwen-like closing: the stop token (<|eos|>) is followed by a newline the model never generates.
NEWLINE_TEMPLATE = (
    "{%- for message in messages -%}<|{{ message['role'] }}|>{{ message['content'] }}<|eos|>{{ '\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)
# A template that rewrites earlier assistant turns once a later message exists (like templates that
# drop earlier reasoning): appending a message changes earlier text.
REWRITING_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' and not loop.last -%}<|assistant|>[old]<|eos|>"
    "{%- else -%}<|{{ message['role'] }}|>{{ message['content'] }}<|eos|>{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_render_ids_is_apply_chat_template():
    tok = build_char_tokenizer()
    messages = [{"role": "user", "content": "1+2="}]
    assert render_ids(tok, messages) == [5, 8, 18, 9, 22, 1, 6]  # <|user|> 1 + 2 = <|eos|> <|assistant|>
    assert render_ids(tok, messages, add_generation_prompt=False) == [5, 8, 18, 9, 22, 1]


def test_tools_reach_the_template():
    tok = tool_tokenizer()
    schema = [{"type": "function", "function": {"name": "calc", "description": "", "parameters": {}}}]
    text = render_text(tok, [{"role": "user", "content": "hi"}], tools=schema)
    assert text == "<|system|>tools: calc<|eos|><|user|>hi<|eos|><|assistant|>"


def test_delta_after_a_stopped_turn_is_only_the_new_messages_and_generation_prompt():
    tok = build_char_tokenizer()
    renderer = TurnRenderer(tok)
    assert renderer.assistant_close == "<|eos|>"
    turn = ids(tok, "42") + [tok.eos_token_id]
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "42"}]
    delta = renderer.delta_ids(messages, [{"role": "user", "content": "no"}], turn, "stop")
    assert delta == ids(tok, "<|user|>no<|eos|><|assistant|>")


def test_delta_after_a_length_cut_turn_closes_it_first():
    tok = build_char_tokenizer()
    renderer = TurnRenderer(tok)
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "42"}]
    delta = renderer.delta_ids(messages, [{"role": "user", "content": "no"}], ids(tok, "42"), "length")
    assert delta == ids(tok, "<|eos|><|user|>no<|eos|><|assistant|>")


def test_delta_adds_the_rest_of_a_closing_the_model_stopped_inside():
    tok = build_char_tokenizer()
    tok.chat_template = NEWLINE_TEMPLATE
    renderer = TurnRenderer(tok)
    assert renderer.assistant_close == "<|eos|>\n"
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "7"}]
    stopped = renderer.delta_ids(messages, [{"role": "user", "content": "ok"}], ids(tok, "7") + [1], "stop")
    assert stopped == ids(tok, "\n<|user|>ok<|eos|>\n<|assistant|>")
    cut = renderer.delta_ids(messages, [{"role": "user", "content": "ok"}], ids(tok, "7"), "length")
    assert cut == ids(tok, "<|eos|>\n<|user|>ok<|eos|>\n<|assistant|>")
    # the transcript the ids spell out is exactly the template's rendering of the conversation
    opening = renderer.opening_ids(messages[:1])
    full = opening + ids(tok, "7") + [1] + stopped
    assert tok.decode(full) == render_text(tok, messages + [{"role": "user", "content": "ok"}])


def test_a_template_that_rewrites_earlier_turns_is_an_error_naming_it():
    tok = build_char_tokenizer()
    tok.chat_template = REWRITING_TEMPLATE
    renderer = TurnRenderer(tok)
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "7"}]
    with pytest.raises(ValueError, match="chat template of tokenizer.*re-renders earlier turns.*'7<|eos|>"):
        renderer.delta_ids(messages, [{"role": "user", "content": "ok"}], ids(tok, "7") + [1], "stop")


def test_a_role_the_template_refuses_is_an_error_naming_the_roles():
    tok = build_char_tokenizer()  # the shipped tiny template (before mt-data) knows no tool role
    with pytest.raises(ValueError, match=r"cannot render messages with roles \['user', 'tool'\]"):
        render_ids(tok, [{"role": "user", "content": "q"}, {"role": "tool", "content": "1"}])


def test_delta_needs_the_assistant_turn_last():
    renderer = TurnRenderer(build_char_tokenizer())
    with pytest.raises(ValueError, match="must end with the assistant turn"):
        renderer.delta_ids([{"role": "user", "content": "q"}], [], [1])


def test_row_messages():
    assert row_messages({"prompt": "hi"}) == [{"role": "user", "content": "hi"}]
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert row_messages({"prompt": "ignored", "messages": chat}) == chat
    with pytest.raises(KeyError, match="neither 'messages'.*nor a text 'prompt'"):
        row_messages({"question": "x"}, "row 3")
    with pytest.raises(ValueError, match="'messages' must be a non-empty list"):
        row_messages({"messages": [{"role": "user"}]})
