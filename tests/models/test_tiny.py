import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rltk.models.tiny import (
    ALPHABET,
    LATE_SPECIAL_TOKENS,
    SPECIAL_TOKENS,
    build_char_tokenizer,
    build_tiny_model,
    save_pretrained_dir,
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def tool_tokenizer():
    return build_char_tokenizer(tool_role=True)


def test_special_tokens_have_fixed_ids(tokenizer, tool_tokenizer):
    for tok in (tokenizer, tool_tokenizer):
        assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
        assert tok.convert_tokens_to_ids(["<|system|>", "<|user|>", "<|assistant|>"]) == [4, 5, 6]
    # the default keeps the 104 tokens its learning was measured with; "<|tool|>" is characters there
    assert len(tokenizer) == len(SPECIAL_TOKENS) + len(ALPHABET) == 104
    assert len(tokenizer("<|tool|>", add_special_tokens=False)["input_ids"]) == len("<|tool|>")
    # the tool role came later: its id is after every symbol, so no earlier id moved
    assert len(tool_tokenizer) == len(SPECIAL_TOKENS) + len(ALPHABET) + len(LATE_SPECIAL_TOKENS) == 105
    assert tool_tokenizer.convert_tokens_to_ids("<|tool|>") == 104


def test_every_symbol_is_one_token_in_alphabet_order(tokenizer):
    ids = tokenizer(ALPHABET, add_special_tokens=False)["input_ids"]
    assert ids == list(range(len(SPECIAL_TOKENS), len(SPECIAL_TOKENS) + len(ALPHABET)))
    assert tokenizer.decode(ids) == ALPHABET


def test_arithmetic_ids_by_hand(tokenizer):
    # digits start at id 7; "+" is 7 + 10 + 1 (after "0".."9" and " "), "=" is 7 + 10 + 5.
    assert tokenizer("17+25=", add_special_tokens=False)["input_ids"] == [8, 14, 18, 9, 12, 22]


def test_answer_format_characters_round_trip(tokenizer):
    text = "Q: 3/4?\n#### 7\t\\boxed{1}<answer>(1+2)*3</answer>"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text


def test_unknown_characters_become_one_unk_each(tokenizer):
    ids = tokenizer("1é€2", add_special_tokens=False)["input_ids"]
    assert ids == [8, 3, 3, 9]


def test_no_special_tokens_are_added_around_text(tokenizer):
    assert tokenizer("12")["input_ids"] == tokenizer("12", add_special_tokens=False)["input_ids"] == [8, 9]


def test_special_token_text_encodes_to_its_id_and_is_skipped_on_decode(tokenizer):
    ids = tokenizer("42<|eos|>", add_special_tokens=False)["input_ids"]
    assert ids == [11, 9, 1]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "42"


def test_extra_chars_extend_the_vocabulary_after_the_alphabet():
    tokenizer = build_char_tokenizer(extra_chars="é1é", tool_role=True)  # "1" is already known; "é" once
    base = len(SPECIAL_TOKENS) + len(ALPHABET)
    assert len(tokenizer) == base + 2
    assert tokenizer("é1", add_special_tokens=False)["input_ids"] == [base, 8]
    assert tokenizer.convert_tokens_to_ids("<|tool|>") == base + 1  # late special tokens come last of all
    assert len(build_char_tokenizer(extra_chars="é")) == base + 1


def test_chat_template_renders_roles_and_generation_prompt(tokenizer):
    messages = [
        {"role": "system", "content": "Add."},
        {"role": "user", "content": "1+2="},
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": "2+2="},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|system|>Add.<|eos|><|user|>1+2=<|eos|><|assistant|>3<|eos|><|user|>2+2=<|eos|><|assistant|>"
    without = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=False)
    assert without == "<|system|>Add.<|eos|><|user|>1+2=<|eos|>"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[:1] == [4] and ids[-1] == 6


def test_chat_template_rejects_unknown_roles(tokenizer, tool_tokenizer):
    with pytest.raises(Exception, match="role must be system, user, assistant or tool, got function"):
        tool_tokenizer.apply_chat_template([{"role": "function", "content": "x"}], tokenize=False)
    # without the <|tool|> token a tool message says how to get the role
    with pytest.raises(Exception, match=r"role must be system, user or assistant \(a tool message needs the tool "
                                        r"role: model.tiny.tool_role=true.*got tool"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "4"}], tokenize=False)


def test_tiny_model_shapes_and_parameter_count_by_hand(tokenizer):
    model = build_tiny_model(tokenizer)
    cfg = model.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (len(tokenizer), 64, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size) == (4, 2, 256)
    assert (cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id) == (0, 1, 2)
    assert model.generation_config.eos_token_id == 1 and model.generation_config.pad_token_id == 0
    V, H, I, kv = len(tokenizer), 64, 256, 2 * (64 // 4)
    per_layer = (
        (H * H + H) + 2 * (H * kv + kv)  # q, k, v projections (Qwen2 has biases on them)
        + H * H  # o projection
        + 3 * H * I  # gate, up, down
        + 2 * H  # two RMSNorms
    )
    expected = V * H + 2 * per_layer + H  # tied embedding, layers, final norm
    assert sum(p.numel() for p in model.parameters()) == expected == 130112
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    logits = model(torch.tensor([[8, 9, 10]])).logits
    assert logits.shape == (1, 3, V)


def test_init_is_deterministic_and_leaves_global_rng_alone(tokenizer):
    before = torch.get_rng_state()
    a = build_tiny_model(tokenizer, seed=3)
    assert torch.equal(torch.get_rng_state(), before)
    b = build_tiny_model(tokenizer, seed=3)
    c = build_tiny_model(tokenizer, seed=4)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.model.layers[0].self_attn.q_proj.weight, c.model.layers[0].self_attn.q_proj.weight)


def test_untied_model_has_its_own_output_projection(tokenizer):
    model = build_tiny_model(tokenizer, tie_word_embeddings=False)
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"hidden_size": 30, "num_heads": 4}, "hidden_size=30 must be divisible by num_heads=4"),
        ({"hidden_size": 12, "num_heads": 4, "num_kv_heads": 2}, "even head size"),
        ({"num_heads": 4, "num_kv_heads": 3}, "num_heads=4 must be a multiple of num_kv_heads=3"),
        ({"num_layers": 0}, "num_layers must be a positive integer, got 0"),
    ],
)
def test_bad_shapes_are_named(tokenizer, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_tiny_model(tokenizer, **kwargs)


def test_save_pretrained_dir_writes_a_hugging_face_folder(tokenizer, tmp_path):
    folder = save_pretrained_dir(build_tiny_model(tokenizer), tokenizer, tmp_path / "tiny")
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names


CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def test_tool_role_and_tool_calls_render_in_hermes_form(tool_tokenizer):
    tokenizer = tool_tokenizer
    messages = [
        {"role": "user", "content": "12+34?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12+34"}}}]},
        {"role": "tool", "content": "46"},
        {"role": "assistant", "content": "46"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<|user|>12+34?<|eos|>"
        '<|assistant|><tool_call>{"name": "calculator", "arguments": {"expression": "12+34"}}</tool_call><|eos|>'
        "<|tool|>46<|eos|><|assistant|>46<|eos|>"
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids.count(104) == 1 and tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text


def test_tool_call_arguments_as_json_text_and_bare_calls_render_alike(tokenizer):
    openai_style = {"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "1+2"}'}}
    bare = {"name": "calculator", "arguments": {"expression": "1+2"}}
    texts = [tokenizer.apply_chat_template([{"role": "assistant", "content": "ok", "tool_calls": [call, call]}],
                                           tokenize=False) for call in (openai_style, bare)]
    one = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>'
    assert texts[0] == texts[1] == f"<|assistant|>ok{one}{one}<|eos|>"


def test_tools_render_as_one_short_signature_line(tokenizer):
    search = {"name": "search", "parameters": {"properties": {"query": {}, "k": {}}}}
    user = [{"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(user, tools=[CALCULATOR, search], tokenize=False, add_generation_prompt=True)
    assert text == "<|system|>tools: calculator(expression);search(query,k)<|eos|><|user|>hi<|eos|><|assistant|>"
    with_system = [{"role": "system", "content": "Be brief."}, *user]
    text = tokenizer.apply_chat_template(with_system, tools=[CALCULATOR], tokenize=False)
    assert text == "<|system|>Be brief.\ntools: calculator(expression)<|eos|><|user|>hi<|eos|>"
    # a schema's description never reaches the 256-position model
    assert "Evaluate" not in text


def test_a_second_system_message_with_tools_is_refused(tokenizer):
    messages = [{"role": "system", "content": "a"}, {"role": "user", "content": "b"}, {"role": "system", "content": "c"}]
    with pytest.raises(Exception, match="only the first message may be a system message"):
        tokenizer.apply_chat_template(messages, tools=[CALCULATOR], tokenize=False)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["user", "assistant", "tool"]), st.text(alphabet="0123456789+=? ab", max_size=8)),
                min_size=1, max_size=6),
       st.booleans())
def test_rendering_a_prefix_gives_a_prefix_of_the_whole(tool_tokenizer, turns, with_tools):
    tokenizer = tool_tokenizer
    # what lets a multi-turn rollout append each new message's tokens instead of re-tokenizing
    messages = [{"role": role, "content": content} for role, content in turns]
    tools = [CALCULATOR] if with_tools else None
    whole = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    for k in range(1, len(messages)):
        part = tokenizer.apply_chat_template(messages[:k], tools=tools, tokenize=False)
        assert whole.startswith(part)
        if messages[k]["role"] == "assistant":
            prompt = tokenizer.apply_chat_template(messages[:k], tools=tools, tokenize=False, add_generation_prompt=True)
            assert whole.startswith(prompt)
