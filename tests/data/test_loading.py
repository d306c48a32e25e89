import csv
import json
import logging

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, processors
from transformers import PreTrainedTokenizerFast

from rltk.data.loading import DataError, format_prompts, load_rows
from rltk.models.tiny import build_char_tokenizer

RECORDS = [
    {"question": "17+25=", "answer": "42", "level": 1},
    {"question": "3*4=", "answer": "12", "level": 2},
    {"question": "9-9=", "answer": "0", "level": 1},
]
EXPECTED = [
    {"prompt": "17+25=", "ground_truth": "42", "extras": {"level": 1}, "id": "{stem}-0"},
    {"prompt": "3*4=", "ground_truth": "12", "extras": {"level": 2}, "id": "{stem}-1"},
    {"prompt": "9-9=", "ground_truth": "0", "extras": {"level": 1}, "id": "{stem}-2"},
]


def expected(stem, level_as=int):
    return [
        {**row, "id": row["id"].format(stem=stem), "extras": {"level": level_as(row["extras"]["level"])}}
        for row in EXPECTED
    ]


def load(path, **kwargs):
    return load_rows(path, prompt_key="question", answer_key="answer", **kwargs)


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


# ----------------------------------------------------------------- file formats


def test_json_list(tmp_path):
    path = tmp_path / "gsm.json"
    path.write_text(json.dumps(RECORDS))
    assert load(path) == expected("gsm")


def test_json_with_data_key(tmp_path):
    path = tmp_path / "gsm.json"
    path.write_text(json.dumps({"version": 2, "data": RECORDS}))
    assert load(path) == expected("gsm")


def test_jsonl_skips_blank_lines(tmp_path):
    path = tmp_path / "gsm.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in RECORDS[:2]) + "\n\n" + json.dumps(RECORDS[2]) + "\n")
    assert load(path) == expected("gsm")


def test_parquet(tmp_path):
    path = tmp_path / "gsm.parquet"
    pq.write_table(pa.Table.from_pylist(RECORDS), path)
    assert load(path) == expected("gsm")


def test_csv_keeps_values_as_written(tmp_path):
    path = tmp_path / "gsm.csv"
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["question", "answer", "level"])
        writer.writeheader()
        writer.writerows(RECORDS)
        writer.writerow({"question": "0+7=", "answer": "007", "level": 3})
    rows = load(path)
    assert rows[:3] == expected("gsm", level_as=str)
    assert rows[3]["ground_truth"] == "007"  # not 7: answers are compared as written


def test_saved_dataset_folder(tmp_path):
    datasets.Dataset.from_list(RECORDS).save_to_disk(str(tmp_path / "ds"))
    assert load(tmp_path / "ds") == expected("ds")


def test_saved_dataset_dict_splits(tmp_path):
    folder = tmp_path / "dsd"
    datasets.DatasetDict({
        "train": datasets.Dataset.from_list(RECORDS[:2]),
        "test": datasets.Dataset.from_list(RECORDS[2:]),
    }).save_to_disk(str(folder))
    assert [r["prompt"] for r in load(folder)] == ["17+25=", "3*4="]  # train by default
    assert [r["prompt"] for r in load(folder, split="test")] == ["9-9="]
    with pytest.raises(DataError, match=r"data.split='dev': the dataset at .* has splits \['train', 'test'\]"):
        load(folder, split="dev")


def test_folder_of_split_files(tmp_path):
    (tmp_path / "data").mkdir()
    pq.write_table(pa.Table.from_pylist(RECORDS[:2]), tmp_path / "data" / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(RECORDS[2:]), tmp_path / "data" / "test-00000-of-00001.parquet")
    assert [r["prompt"] for r in load(tmp_path)] == ["17+25=", "3*4="]
    assert [r["prompt"] for r in load(tmp_path, split="test")] == ["9-9="]
    with pytest.raises(DataError, match=r"data.split='dev': no file .* Files: \['data/test-00000"):
        load(tmp_path, split="dev")


def test_files_in_a_split_folder(tmp_path):
    (tmp_path / "validation").mkdir()
    (tmp_path / "validation" / "part.jsonl").write_text(json.dumps(RECORDS[0]))
    assert [r["prompt"] for r in load(tmp_path, split="validation")] == ["17+25="]


# ----------------------------------------------------------------- columns and ids


def test_ids_from_an_id_column_and_chosen_extras(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text("\n".join(json.dumps({**r, "id": f"q{i}", "numbers": [i, 2]}) for i, r in enumerate(RECORDS)))
    rows = load(path, extras_keys=["numbers"])
    assert [r["id"] for r in rows] == ["q0", "q1", "q2"]
    assert rows[1]["extras"] == {"numbers": [1, 2]}


def test_non_string_answers_become_text(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps([{"prompt": "p", "answer": 3.5}, {"prompt": "q", "answer": [1, 2]}]))
    assert [r["ground_truth"] for r in load_rows(path)] == ["3.5", "[1, 2]"]


def test_no_answer_column(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps([{"prompt": "p"}]))
    assert load_rows(path, answer_key=None) == [{"prompt": "p", "ground_truth": "", "extras": {}, "id": "x-0"}]


def test_chat_message_prompts_are_kept(tmp_path):
    path = tmp_path / "chat.jsonl"
    messages = [{"role": "user", "content": "1+2="}]
    path.write_text(json.dumps({"prompt": messages, "answer": "3"}))
    assert load_rows(path)[0]["prompt"] == messages


# ----------------------------------------------------------------- bad inputs


def test_missing_prompt_key_names_config_key_and_columns(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps(RECORDS))
    with pytest.raises(DataError, match=r"data.prompt_key='prompt' is not a column of '.*x.json'. Columns: question, answer, level"):
        load_rows(path)
    with pytest.raises(DataError, match=r"data.answer_key='solution'"):
        load_rows(path, prompt_key="question", answer_key="solution")
    with pytest.raises(DataError, match=r"data.extras_keys='numbers'"):
        load(path, extras_keys=["numbers"])


def test_missing_key_in_a_later_row_names_the_row(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps(RECORDS[0]) + "\n" + json.dumps({"question": "2+2="}))
    with pytest.raises(DataError, match=r"x.jsonl: row 1 has no 'answer'"):
        load(path)


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("empty.json", "[]", r"empty.json' holds no rows"),
        ("empty.jsonl", "\n\n", r"empty.jsonl' holds no rows"),
        ("bad.json", "{not json", r"bad.json: not valid JSON"),
        ("bad.jsonl", '{"prompt": "a"}\n{oops}\n', r"bad.jsonl: line 2 is not valid JSON"),
        ("obj.json", '{"rows": []}', r"obj.json: expected a list of rows or \{\"data\": \[rows\]\}, found an object with keys \['rows'\]"),
        ("str.json", '"hello"', r"str.json: expected a list of rows .* found str"),
        ("num.json", "[1, 2]", r"num.json: row 0 is a int, expected an object"),
        ("type.json", '[{"prompt": 5, "answer": "5"}]', r"type.json: row 0: prompt .* must be a string or a list of .* got int"),
        ("dup.json", '[{"prompt": "a", "answer": "1", "id": 7}, {"prompt": "b", "answer": "2", "id": 7}]',
         r"dup.json: row 1: id '7' .* appears more than once"),
        ("data.txt", "hello", r"unsupported file type '.txt'"),
    ],
)
def test_bad_files_are_named(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DataError, match=message):
        load_rows(path)


def test_missing_path_and_empty_folder(tmp_path):
    with pytest.raises(DataError, match=r"data.path='.*nope.jsonl' does not exist"):
        load_rows(tmp_path / "nope.jsonl")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"folder with no .json, .jsonl, .parquet, .csv files"):
        load_rows(tmp_path / "empty")
    with pytest.raises(DataError, match=r"eval_data.path="):
        load_rows(tmp_path / "nope.jsonl", config_prefix="eval_data")


# ----------------------------------------------------------------- format_prompts

ROWS = [
    {"prompt": "17+25=", "ground_truth": "42", "extras": {"level": 1}, "id": "a"},
    {"prompt": "3*4=", "ground_truth": "12", "extras": {"level": 2}, "id": "b"},
]


def test_plain_prompts_pass_through_unchanged(tokenizer):
    out = format_prompts(ROWS, tokenizer)
    assert out == ROWS and out[0] is not ROWS[0]


def test_prompt_template_uses_prompt_and_extras(tokenizer):
    out = format_prompts(ROWS, tokenizer, prompt_template="L{level}: {prompt}")
    assert [r["prompt"] for r in out] == ["L1: 17+25=", "L2: 3*4="]
    with pytest.raises(ValueError, match=r"data.prompt_template='\{question\}' uses field 'question' that row 'a' does not have. Available: level, prompt"):
        format_prompts(ROWS, tokenizer, prompt_template="{question}")


def test_chat_template_with_system_prompt(tokenizer):
    out = format_prompts(ROWS, tokenizer, system_prompt="Add.", use_chat_template=True)
    assert out[0]["prompt"] == "<|system|>Add.<|eos|><|user|>17+25=<|eos|><|assistant|>"
    assert out[0]["ground_truth"] == "42" and out[0]["id"] == "a"


def test_system_prompt_without_chat_template_goes_first(tokenizer):
    assert format_prompts(ROWS[:1], tokenizer, system_prompt="Add.")[0]["prompt"] == "Add.\n17+25="


def test_message_list_prompts_need_the_chat_template(tokenizer):
    rows = [{"prompt": [{"role": "user", "content": "1+2="}], "ground_truth": "3", "extras": {}, "id": "m"}]
    out = format_prompts(rows, tokenizer, system_prompt="S", use_chat_template=True)
    assert out[0]["prompt"] == "<|system|>S<|eos|><|user|>1+2=<|eos|><|assistant|>"
    with pytest.raises(ValueError, match=r"row 'm': the prompt is a list of chat messages, which needs data.use_chat_template=true"):
        format_prompts(rows, tokenizer)


def test_tokenizer_without_chat_template_is_an_error(tokenizer):
    bare = build_char_tokenizer()
    bare.chat_template = None
    with pytest.raises(ValueError, match=r"data.use_chat_template=true but tokenizer .* has no chat template"):
        format_prompts(ROWS, bare, use_chat_template=True)


def test_too_long_prompts_are_filtered_with_a_count(tokenizer, caplog):
    # "17+25=" is 6 characters = 6 tokens, "3*4=" is 4.
    with caplog.at_level(logging.WARNING, logger="rltk.data.loading"):
        out = format_prompts(ROWS, tokenizer, max_prompt_tokens=5)
    assert [r["id"] for r in out] == ["b"]
    assert "dropped 1 of 2 prompts longer than data.max_prompt_tokens=5 (first ids: a)" in caplog.text
    assert len(format_prompts(ROWS, tokenizer, max_prompt_tokens=6)) == 2


def test_too_long_prompts_can_be_rejected(tokenizer):
    with pytest.raises(ValueError, match=r"row 'a': the prompt is 6 tokens, more than data.max_prompt_tokens=5"):
        format_prompts(ROWS, tokenizer, max_prompt_tokens=5, on_too_long="error")
    # the chat template's tokens count too: <|user|> 17+25= <|eos|> <|assistant|> is 9
    with pytest.raises(ValueError, match=r"the prompt is 9 tokens"):
        format_prompts(ROWS, tokenizer, max_prompt_tokens=8, on_too_long="error", use_chat_template=True)


def test_filtering_everything_is_an_error(tokenizer):
    with pytest.raises(ValueError, match=r"all 2 prompts are longer than data.max_prompt_tokens=3"):
        format_prompts(ROWS, tokenizer, max_prompt_tokens=3)


def test_bad_options(tokenizer):
    with pytest.raises(ValueError, match=r"data.on_too_long='truncate' is not valid. Valid: filter, error"):
        format_prompts(ROWS, tokenizer, on_too_long="truncate")
    with pytest.raises(ValueError, match=r"data.max_prompt_tokens must be a positive integer"):
        format_prompts(ROWS, tokenizer, max_prompt_tokens=0)


def test_bos_is_written_for_tokenizers_that_add_it():
    backend = Tokenizer(models.WordLevel({"<s>": 0, "<unk>": 1, "hi": 2}, unk_token="<unk>"))
    backend.add_special_tokens(["<s>"])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", unk_token="<unk>")
    out = format_prompts([{"prompt": "hi", "ground_truth": "", "extras": {}, "id": "x"}], tokenizer)
    assert out[0]["prompt"] == "<s>hi"
    assert tokenizer(out[0]["prompt"], add_special_tokens=False)["input_ids"] == [0, 2]


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".csv"])
def test_non_utf8_file_error_names_the_file_byte_and_line(tmp_path, suffix):
    path = tmp_path / f"latin1{suffix}"
    body = {".json": '[{"prompt": "caf\xe9", "answer": "1"}]',
            ".jsonl": '{"prompt": "a", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "2"}\n',
            ".csv": 'prompt,answer\na,1\ncaf\xe9,2\n'}[suffix]
    data = body.encode("latin-1")
    path.write_bytes(data)
    offset, line = data.index(b"\xe9"), data[: data.index(b"\xe9")].count(b"\n") + 1
    with pytest.raises(DataError) as info:
        load_rows(path)
    assert str(info.value).startswith(f"{path}: not UTF-8 text (byte b'\\xe9' at offset {offset}, line {line})")
    assert "iconv" in str(info.value)


def test_non_utf8_offset_is_of_the_file_across_read_chunks(tmp_path):
    # Past the first megabyte a text stream reports offsets within its buffer; the error must not.
    path = tmp_path / "big.jsonl"
    good = ('{"prompt": "\u00e9t\u00e9", "answer": "1"}\n' * 40_000).encode("utf-8")
    bad_line = b'{"prompt": "\xff", "answer": "2"}\n'
    path.write_bytes(good + bad_line)
    offset = len(good) + bad_line.index(b"\xff")
    with pytest.raises(DataError, match=rf"offset {offset}, line 40001\)"):
        load_rows(path)


def test_null_answer_is_refused_naming_file_row_and_key(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"prompt": "p", "answer": "1"}\n{"prompt": "q", "answer": null}\n')
    with pytest.raises(DataError, match=rf"{path}: row 1: the answer \(column 'answer', data.answer_key\) is null\."
                                        r".*set data.answer_key=null if the dataset has no answers"):
        load_rows(path)
    table = tmp_path / "x.parquet"
    pq.write_table(pa.table({"prompt": ["p", "q"], "answer": [None, "2"]}), table)
    with pytest.raises(DataError, match=r"row 0: the answer .* is null"):
        load_rows(table)
    # Without an answer column nothing is refused, and an empty string stays what it is.
    assert [r["ground_truth"] for r in load_rows(path, answer_key=None)] == ["", ""]
    empty = tmp_path / "e.csv"
    empty.write_text("prompt,answer\np,\n")
    assert load_rows(empty)[0]["ground_truth"] == ""


# ----------------------------------------------------------------- chat-message rows

TRANSCRIPT = [
    {"role": "user", "content": "12+34="},
    {"role": "assistant", "content": None,
     "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "12+34"}'}}]},
    {"role": "tool", "content": "46"},
    {"role": "assistant", "content": "46"},
]
CALCULATOR = {"type": "function", "function": {"name": "calculator", "parameters": {"properties": {"expression": {}}}}}


def test_a_messages_column_of_transcripts_gives_opening_and_demonstration(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": TRANSCRIPT, "answer": "46"}) + "\n"
                    + json.dumps({"messages": TRANSCRIPT[:1], "answer": "46"}) + "\n")
    rows = load_rows(path)
    assert rows[0]["messages"] == rows[0]["prompt"] == [{"role": "user", "content": "12+34="}]
    assert [m["role"] for m in rows[0]["sft_messages"]] == ["user", "assistant", "tool", "assistant"]
    assert rows[0]["sft_messages"][1]["tool_calls"][0]["function"]["arguments"] == {"expression": "12+34"}
    assert rows[0]["extras"] == {}  # the messages column is not an extra
    assert "sft_messages" not in rows[1]  # messages ending with a user turn only open an episode


def test_messages_beside_a_prompt_column_keep_the_prompt(tmp_path):
    path = tmp_path / "both.json"
    path.write_text(json.dumps([{"prompt": "p", "messages": TRANSCRIPT, "answer": "46"}]))
    row = load_rows(path)[0]
    assert row["prompt"] == "p" and row["messages"] == TRANSCRIPT[:1] and len(row["sft_messages"]) == 4


@pytest.mark.parametrize("messages, message", [
    ([{"role": "robot", "content": "x"}], r"row 0 \(column 'messages', data.messages_key\): message 0 has role "
                                          r"'robot'; valid roles: system, user, assistant, tool"),
    ([{"role": "assistant", "content": "x"}], r"row 0 \(column 'messages', data.messages_key\): the messages start "
                                              r"with an assistant message"),
    ("hello", r"row 0 \(column 'messages', data.messages_key\): messages must be a non-empty list"),
])
def test_bad_messages_rows_name_file_row_and_what_is_valid(tmp_path, messages, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": messages, "answer": "1"}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl: " + message):
        load_rows(path)


def test_neither_prompt_nor_messages_names_both_keys(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps([{"question": "1", "answer": "1"}]))
    with pytest.raises(DataError, match=r"data.prompt_key='prompt' is not a column of .*; or give a 'messages' "
                                        r"column of chat messages \(data.messages_key\)"):
        load_rows(path)


def test_chat_rows_render_messages_tools_and_system_prompt(tokenizer, tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": TRANSCRIPT, "answer": "46"}) + "\n")
    row = format_prompts(load_rows(path), tokenizer, use_chat_template=True, system_prompt="Use tools.",
                         tools=[CALCULATOR])[0]
    assert row["prompt"] == "<|system|>Use tools.\ntools: calculator(expression)<|eos|><|user|>12+34=<|eos|><|assistant|>"
    opening = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "12+34="}]
    assert row["messages"] == opening
    # the demonstration opens exactly like the rollout's prompt, then continues as given
    assert row["sft_messages"][:2] == opening and row["sft_messages"][2:] == load_rows(path)[0]["sft_messages"][1:]


def test_plain_rows_under_the_chat_template_record_the_messages_they_render(tokenizer):
    rows = [{"prompt": "1+2=", "ground_truth": "3", "extras": {}, "id": "a"}]
    row = format_prompts(rows, tokenizer, use_chat_template=True)[0]
    assert row["prompt"] == "<|user|>1+2=<|eos|><|assistant|>"
    assert row["messages"] == [{"role": "user", "content": "1+2="}] and "sft_messages" not in row


def test_the_prompt_template_fills_the_opening_not_the_demonstration(tokenizer):
    rows = [{"prompt": "g", "messages": [{"role": "user", "content": "g"}], "ground_truth": "4", "extras": {}, "id": "a",
             "sft_messages": [{"role": "user", "content": "g"}, {"role": "assistant", "content": "2"},
                              {"role": "user", "content": "higher"}, {"role": "assistant", "content": "4"}]}]
    row = format_prompts(rows, tokenizer, use_chat_template=True, prompt_template="Q {prompt}")[0]
    assert row["messages"] == [{"role": "user", "content": "Q g"}]
    assert [m["content"] for m in row["sft_messages"]] == ["Q g", "2", "higher", "4"]


def test_demonstrations_and_tools_need_the_chat_template(tokenizer):
    rows = [{"prompt": "g", "ground_truth": "4", "extras": {}, "id": "a",
             "sft_messages": [{"role": "user", "content": "g"}, {"role": "assistant", "content": "4"}]}]
    with pytest.raises(ValueError, match=r"row 'a' has a demonstration transcript \(sft_messages\).*"
                                         r"data.use_chat_template=true"):
        format_prompts(rows, tokenizer)
    with pytest.raises(ValueError, match=r"tools are rendered by the chat template: they need data.use_chat_template"):
        format_prompts(rows[:1], tokenizer, tools=[CALCULATOR])
