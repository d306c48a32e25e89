"""Chat-message rows: checking, splitting transcripts, and tokenizing them with the loss on assistant turns."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rltk.data.chat import check_messages, render_text, split_transcript, tokenize_transcript
from rltk.data.multi_turn_tasks import calculator_arithmetic, guess_number
from rltk.models.tiny import build_char_tokenizer
from rltk.training.updates.sft import sft_batch

CALCULATOR = {"type": "function", "function": {"name": "calculator", "description": "Evaluate.",
                                               "parameters": {"properties": {"expression": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer(tool_role=True)


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ----------------------------------------------------------------- checking and splitting


def test_check_messages_normalises_tool_calls():
    checked = check_messages([
        {"role": "user", "content": "1+2="},
        {"role": "assistant", "content": None,
         "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "1+2"}'}},
                        {"name": "calculator", "arguments": {"expression": "3"}}]},
        {"role": "tool", "content": "3", "tool_call_id": "c1"},
    ], "x.jsonl: row 0")
    assert checked[1]["content"] == ""
    assert [c["function"] for c in checked[1]["tool_calls"]] == [
        {"name": "calculator", "arguments": {"expression": "1+2"}}, {"name": "calculator", "arguments": {"expression": "3"}}]
    assert checked[2]["tool_call_id"] == "c1"  # other keys are kept


@pytest.mark.parametrize("messages, message", [
    ("hi", r"x: messages must be a non-empty list of \{'role', 'content'\} objects, got str"),
    ([], r"x: messages must be a non-empty list"),
    (["hi"], r"x: message 0 is a str, expected an object with 'role' and 'content'"),
    ([{"role": "bot", "content": "a"}], r"x: message 0 has role 'bot'; valid roles: system, user, assistant, tool"),
    ([{"role": "user"}], r"x: message 0 \(user\) has content None; content must be a string"),
    ([{"role": "user", "content": 3}], r"message 0 \(user\) has content 3"),
    ([{"role": "user", "content": "a", "tool_calls": []}], r"message 0 \(user\) has tool_calls; only assistant"),
    ([{"role": "assistant", "content": "", "tool_calls": {"name": "f"}}], r"tool_calls must be a list of calls, got dict"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"arguments": {}}]}], r"message 0: tool call 0 must be"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": "{x"}]}],
     r"tool call 0 \('f'\): arguments are not valid JSON"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": [1]}]}],
     r"tool call 0 \('f'\): arguments must be an object of named values, got \[1\]"),
])
def test_bad_messages_name_the_place_and_what_is_valid(messages, message):
    with pytest.raises(ValueError, match=message):
        check_messages(messages, "x")


def test_split_transcript_opens_with_what_precedes_the_first_assistant_turn():
    user, reply = {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}
    assert split_transcript([user, reply, user, reply]) == ([user], [user, reply, user, reply])
    assert split_transcript([user, reply, user]) == ([user, reply, user], None)  # a conversation to continue
    with pytest.raises(ValueError, match="start with an assistant message"):
        split_transcript([reply])


# ----------------------------------------------------------------- tokenizing transcripts


def test_guessing_transcript_ids_and_mask_by_hand(tokenizer):
    # ids: <|eos|> 1, <|user|> 5, <|assistant|> 6; digits from 7 ('2' 9, '4' 11); 'a' is 25 after digits and " +-*/=()"
    transcript = [{"role": "user", "content": "g"}, {"role": "assistant", "content": "4"},
                  {"role": "user", "content": "lower"}, {"role": "assistant", "content": "2"}]
    prompt, response, mask = tokenize_transcript(transcript, tokenizer)
    g, l, o, w, e, r = (25 + "abcdefghijklmnopqrstuvwxyz".index(c) for c in "glower")
    assert prompt == [5, g, 1, 6]
    assert response == [11, 1, 5, l, o, w, e, r, 1, 6, 9, 1]
    assert mask == [1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1]  # "4<eos>" and "2<eos>"; the feedback and <|assistant|> not


def test_tool_transcript_teaches_the_call_and_the_answer_not_the_result(tokenizer):
    row = calculator_arithmetic("train", 1, 0)[0]
    a, b = row["extras"]["a"], row["extras"]["b"]
    prompt, response, mask = tokenize_transcript(row["sft_messages"], tokenizer, tools=[CALCULATOR])
    call = f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{a}+{b}"}}}}</tool_call><|eos|>'
    result = f"<|tool|>{a + b}<|eos|><|assistant|>"
    answer = f"{a + b}<|eos|>"
    assert prompt == ids(tokenizer, f"<|system|>tools: calculator(expression)<|eos|><|user|>{a}+{b}=<|eos|><|assistant|>")
    assert response == ids(tokenizer, call + result + answer)
    n_call, n_result = len(ids(tokenizer, call)), len(ids(tokenizer, result))
    assert mask == [1] * n_call + [0] * n_result + [1] * len(ids(tokenizer, answer))


def test_the_loss_stops_at_eos_when_the_template_writes_more_after_it(tokenizer):
    # a Qwen-like template ends each turn with eos and a newline: the newline is the template's, not the model's
    class NewlineAfterEos:
        eos_token_id = tokenizer.eos_token_id

        def __call__(self, text, add_special_tokens=False):
            return tokenizer(text, add_special_tokens=add_special_tokens)

        def apply_chat_template(self, messages, tools=None, tokenize=False, add_generation_prompt=False):
            text = "".join(f"<|{m['role']}|>{m['content']}<|eos|>\n" for m in messages)
            return text + ("<|assistant|>" if add_generation_prompt else "")

    transcript = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"},
                  {"role": "user", "content": "3"}, {"role": "assistant", "content": "4"}]
    _, response, mask = tokenize_transcript(transcript, NewlineAfterEos())
    nl = ids(tokenizer, "\n")[0]
    assert response == [9, 1, nl, 5, 10, 1, nl, 6, 11, 1, nl]
    assert mask == [1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 0]


def test_two_assistant_turns_in_a_row_do_not_teach_the_second_generation_prompt(tokenizer):
    transcript = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"},
                  {"role": "assistant", "content": "3"}]
    _, response, mask = tokenize_transcript(transcript, tokenizer)
    assert response == [9, 1, 6, 10, 1] and mask == [1, 1, 0, 1, 1]


def test_a_template_that_rewrites_earlier_turns_is_refused(tokenizer):
    class DropsPastAnswers:  # renders only the last assistant answer, as reasoning templates do with thoughts
        eos_token_id = tokenizer.eos_token_id

        def __call__(self, text, add_special_tokens=False):
            return tokenizer(text, add_special_tokens=add_special_tokens)

        def apply_chat_template(self, messages, tools=None, tokenize=False, add_generation_prompt=False):
            last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
            text = "".join(f"<|{m['role']}|>{m['content'] if m['role'] != 'assistant' or i == last else ''}<|eos|>"
                           for i, m in enumerate(messages))
            return text + ("<|assistant|>" if add_generation_prompt else "")

    transcript = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"},
                  {"role": "user", "content": "3"}, {"role": "assistant", "content": "4"}]
    with pytest.raises(ValueError, match=r"message 3, assistant, changes what came before"):
        tokenize_transcript(transcript, DropsPastAnswers())


@pytest.mark.parametrize("transcript, message", [
    ([{"role": "user", "content": "1"}], "ends with an assistant message"),
    ([{"role": "assistant", "content": "1"}], "starts with an assistant message"),
])
def test_transcripts_that_teach_nothing_are_refused(tokenizer, transcript, message):
    with pytest.raises(ValueError, match=message):
        tokenize_transcript(transcript, tokenizer)


_contents = st.text(alphabet="0123456789+=? abc", max_size=6)


@st.composite
def transcripts(draw):
    messages = [{"role": draw(st.sampled_from(["system", "user"])), "content": draw(_contents)}]
    for _ in range(draw(st.integers(1, 4))):
        for _ in range(draw(st.integers(0, 2))):
            messages.append({"role": draw(st.sampled_from(["user", "tool"])), "content": draw(_contents)})
        turn = {"role": "assistant", "content": draw(_contents)}
        if draw(st.booleans()):
            turn["tool_calls"] = [{"name": "calculator", "arguments": {"expression": draw(_contents)}}]
        messages.append(turn)
    return messages


@settings(max_examples=60, deadline=None)
@given(transcripts(), st.booleans())
def test_the_pieces_are_the_whole_rendering_and_the_mask_is_the_assistant_turns(tokenizer, transcript, with_tools):
    tools = [CALCULATOR] if with_tools and transcript[0]["role"] != "system" else None
    prompt, response, mask = tokenize_transcript(transcript, tokenizer, tools=tools)
    # a character tokenizer tokenizes the whole like its pieces: the deltas add up to the full rendering
    assert prompt + response == ids(tokenizer, render_text(tokenizer, transcript, tools=tools, add_generation_prompt=False))
    assert len(mask) == len(response)
    # the taught tokens are exactly each assistant turn as the template renders it after <|assistant|>, with eos
    taught = [t for t, m in zip(response, mask) if m]
    expected = []
    for turn in (m for m in transcript if m["role"] == "assistant"):
        expected += ids(tokenizer, render_text(tokenizer, [turn], add_generation_prompt=False)[len("<|assistant|>"):])
    assert taught == expected
    assert tokenizer.convert_tokens_to_ids("<|assistant|>") not in taught


# ----------------------------------------------------------------- the SFT batch


def test_sft_batch_masks_everything_but_the_assistant_tokens(tokenizer):
    transcript = [{"role": "user", "content": "g"}, {"role": "assistant", "content": "4"},
                  {"role": "user", "content": "lower"}, {"role": "assistant", "content": "2"}]
    example = tokenize_transcript(transcript, tokenizer)
    plain = ([5, 7], [8, 1])  # a (prompt, completion) pair: the whole completion is taught
    batch = sft_batch([example, plain], tokenizer.pad_token_id)
    # prompts left-padded to 4 columns, responses right-padded to 12
    assert batch["input_ids"][0].tolist() == example[0] + example[1]
    assert batch["input_ids"][1].tolist() == [0, 0, 5, 7, 8, 1] + [0] * 10
    assert batch["response_mask"].tolist() == [
        [1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1],
        [1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    ]


def test_the_sft_step_loss_is_the_mean_nll_of_the_assistant_tokens_only(tokenizer):
    from rltk.models.tiny import build_tiny_model
    from rltk.strategies.accelerate_strategy import AccelerateStrategy
    from rltk.training.updates.sft import sft_step

    model = build_tiny_model(tokenizer, seed=0)
    rows = guess_number("train", 2, 0)
    examples = [tokenize_transcript(row["sft_messages"], tokenizer) for row in rows]
    # by hand, before the step: the log-softmax of each unpadded sequence at its assistant tokens, nothing else
    nll, count = 0.0, 0
    with torch.no_grad():
        for prompt, response, mask in examples:
            logits = model(torch.tensor([prompt + response])).logits[0].log_softmax(-1)
            for t, m in enumerate(mask):
                if m:
                    nll -= logits[len(prompt) + t - 1, response[t]].item()
                    count += 1
    strategy = AccelerateStrategy(cpu=True)
    strategy.setup(model, lr=1e-3, total_steps=1, weight_decay=0.0, warmup_steps=0, lr_schedule="constant",
                   grad_clip=1.0)
    info = sft_step(strategy, sft_batch(examples, tokenizer.pad_token_id), micro_batch_size=1, impl="naive")
    assert info["sft_loss"] == pytest.approx(nll / count, abs=1e-5)
    guesses = [m["content"] for row in rows for m in row["sft_messages"] if m["role"] == "assistant"]
    assert count == sum(len(g) + 1 for g in guesses)  # each guess's digits and its eos


def test_sft_pairs_tokenize_demonstrations_and_plain_rows(tokenizer):
    from rltk.errors import ConfigError
    from rltk.training.scaffold.rows import sft_pairs

    demo = guess_number("train", 1, 0)[0]
    plain = {"prompt": "1+2=", "ground_truth": "3", "extras": {}, "id": "p"}
    pairs = sft_pairs([demo, plain], tokenizer)
    assert pairs[0] == tokenize_transcript(demo["sft_messages"], tokenizer)
    assert pairs[1] == (ids(tokenizer, "1+2="), ids(tokenizer, "3") + [1], [1, 1])
    broken = {**demo, "id": "b", "sft_messages": demo["sft_messages"][:1]}  # nothing to teach
    with pytest.raises(ConfigError, match=r"row 'b': its demonstration \(sft_messages\) cannot be tokenized: .*ends "
                                          r"with an assistant message"):
        sft_pairs([broken], tokenizer)
