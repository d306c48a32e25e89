"""Loading prompt datasets from local files and turning them into model-ready prompts.

Every dataset in rltk ends up as a list of rows of one standard form::

    {"prompt": str, "ground_truth": str, "extras": dict, "id": str}

optionally with chat messages (see :mod:`rltk.data.chat`): ``"messages"``,
the opening messages of an episode, and ``"sft_messages"``, a demonstration
transcript for the supervised warm-up (loss on its assistant turns only).

:func:`load_rows` reads the rows (JSON, JSONL, parquet, CSV, a ``datasets``
folder written by ``save_to_disk``, or a folder of such files);
:func:`format_prompts` applies the prompt template, the system prompt and
the chat template, and filters or rejects prompts that are too long. After
it, ``prompt`` is the exact text to tokenize with ``add_special_tokens=False``.
Synthetic tasks (:mod:`rltk.data.synthetic`) produce the same rows.
"""

from __future__ import annotations

import codecs
import csv
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rltk.data.images import check_placeholders, row_images
from rltk.data.templates import fill_template, template_fields

logger = logging.getLogger(__name__)

FILE_FORMATS = (".json", ".jsonl", ".parquet", ".csv")
ON_TOO_LONG = ("filter", "error")


class DataError(ValueError):
    """A dataset cannot be read as rltk rows; the message names the file and key."""


def load_rows(
    path_or_name: str | os.PathLike,
    *,
    split: str | None = None,
    prompt_key: str = "prompt",
    answer_key: str | None = "answer",
    extras_keys: Sequence[str] | None = None,
    id_key: str = "id",
    messages_key: str = "messages",
    image_key: str | None = None,
    config_prefix: str = "data",
) -> list[dict]:
    """Rows ``{"prompt", "ground_truth", "extras", "id"}`` (and ``"images"``) from a local dataset.

    Sources: a ``.json`` file (a list of objects, or ``{"data": [...]}``), a
    ``.jsonl`` file (one object per line), ``.parquet``, ``.csv`` (values
    stay strings), a folder written by ``datasets``' ``save_to_disk`` (a
    ``DatasetDict`` needs ``split``, default ``train``), or a folder of data
    files (with ``split``, the files whose name starts with it or that sit in
    a folder named after it; without, the ``train*`` files if any, else all).

    A prompt is a string, or a list of chat messages ``[{"role", "content"}]``
    (kept as is; :func:`format_prompts` renders it with the chat template).

    A ``messages`` column (``messages_key``) holds chat messages, checked by
    :func:`rltk.data.chat.check_messages` (roles system, user, assistant,
    tool; assistant ``tool_calls``). Messages that end with an assistant turn
    are a demonstration transcript: the row's ``messages`` are those before its
    first assistant turn (the episode's opening) and ``sft_messages`` all of
    them (what the warm-up teaches); other messages are all opening. Without a
    prompt column the opening messages are the prompt too.
    The answer becomes the string ``ground_truth`` (numbers as written, lists
    and objects as JSON); ``answer_key=None`` means the rows have no answer.
    A missing answer (``null`` / ``None``, an empty parquet cell) is an error
    naming the file and row, not an empty string every reward would silently
    score 0: drop such rows, or set ``answer_key`` to null for a dataset
    without answers. An empty string (an empty CSV cell) is kept as it is.

    Args:
        path_or_name: a local file or folder; nothing is downloaded.
        split: which split to read from a folder.
        prompt_key: the column holding the prompt.
        answer_key: the column holding the reference answer, or None.
        extras_keys: columns copied into ``extras`` (for reward functions);
            ``None`` copies every column except prompt, answer and id.
        id_key: the column holding a row id if present; otherwise ids are
            ``"<file stem>-<row index>"``.
        messages_key: the column holding chat messages, if the dataset has one.
        image_key: the column holding each row's images, if the dataset has one: decoded into the row's
            ``images`` (RGB ``PIL.Image`` s) and counted against the prompt's placeholders, as
            :mod:`rltk.data.images` says; not an extra.
        config_prefix: the config section the arguments came from, used in
            error messages (``data.prompt_key`` ...).
    """
    path = Path(path_or_name).expanduser()
    if not path.exists():
        raise DataError(
            f"{config_prefix}.path='{path_or_name}' does not exist. rltk reads local datasets only: a "
            f"{', '.join(FILE_FORMATS)} file, a folder written by datasets' save_to_disk, or a folder of "
            f"such files (for the built-in synthetic tasks see rltk.data.synthetic.make_task)."
        )
    records, source = _read_records(path, split, config_prefix)
    columns = _columns_of(records, source, config_prefix)
    has_messages = messages_key in columns
    image_key = image_key if image_key in columns else None
    extras_keys = [key for key in _checked_keys(columns, source, prompt_key, answer_key, extras_keys, id_key,
                                                messages_key, has_messages, config_prefix) if key != image_key]
    stem = Path(source).stem or "row"
    rows, seen_ids = [], set()
    for index, record in enumerate(records):
        where = f"{source}: row {index}"
        prompt, chat = _prompt_and_chat(record, where, columns, has_messages, prompt_key, answer_key, extras_keys,
                                        messages_key, config_prefix)
        row_id = str(record[id_key]) if record.get(id_key) is not None else f"{stem}-{index}"
        if row_id in seen_ids:
            raise DataError(f"{where}: id '{row_id}' (column '{id_key}') appears more than once; ids must be unique")
        seen_ids.add(row_id)
        rows.append({
            "prompt": prompt,
            "ground_truth": _as_text(record[answer_key]) if answer_key else "",
            "extras": {key: record[key] for key in extras_keys},
            "id": row_id,
            **chat,
            **(_images_of(record, prompt, where, image_key, path) if image_key else {}),
        })
    return rows


def _images_of(record: dict, prompt: str | list[dict], where: str, image_key: str, path: Path) -> dict:
    images = row_images(record.get(image_key), where=where, key=image_key,
                        base_dir=path if path.is_dir() else path.parent)
    check_placeholders(prompt, images, where=where, key=image_key)
    return {"images": images}


def _columns_of(records: list, source: str, config_prefix: str) -> list[str]:
    """The column names, taken from the first row, once every row is known to be an object."""
    if not records:
        raise DataError(f"{config_prefix}.path='{source}' holds no rows (empty dataset)")
    for index, record in enumerate(records):
        if not isinstance(record, dict):
            raise DataError(f"{source}: row {index} is a {type(record).__name__}, expected an object with named fields")
    return list(records[0].keys())


def _checked_keys(columns: list[str], source: str, prompt_key: str, answer_key: str | None,
                  extras_keys: Sequence[str] | None, id_key: str, messages_key: str, has_messages: bool,
                  config_prefix: str) -> list[str]:
    """The extras columns, once the configured keys are known to be columns (checked before any row is read)."""
    if not (has_messages and prompt_key not in columns):
        _require_key(prompt_key, f"{config_prefix}.prompt_key", columns, source,
                     f"; or give a '{messages_key}' column of chat messages ({config_prefix}.messages_key)")
    if answer_key is not None:
        _require_key(answer_key, f"{config_prefix}.answer_key", columns, source)
    if extras_keys is None:
        return [c for c in columns if c not in (prompt_key, answer_key, id_key, messages_key)]
    extras_keys = list(extras_keys)
    for key in extras_keys:
        _require_key(key, f"{config_prefix}.extras_keys", columns, source)
    return extras_keys


def _prompt_and_chat(record: dict, where: str, columns: list[str], has_messages: bool, prompt_key: str,
                     answer_key: str | None, extras_keys: list[str], messages_key: str,
                     config_prefix: str) -> tuple[str | list[dict], dict[str, list[dict]]]:
    """One row's prompt and chat columns, once its keys are present and its answer is not null."""
    prompt_keys = [prompt_key] if prompt_key in columns or not has_messages else [messages_key]
    for key in [*prompt_keys, *([answer_key] if answer_key else []), *extras_keys]:
        if key not in record:
            raise DataError(f"{where} has no '{key}' (columns of that row: {sorted(record)})")
    chat: dict[str, list[dict]] = {}
    if has_messages and record.get(messages_key) is not None:
        chat = _chat_columns(record[messages_key], f"{where} (column '{messages_key}', "
                                                   f"{config_prefix}.messages_key)")
    if prompt_key in record:
        prompt = _check_prompt(record[prompt_key], where, f"{config_prefix}.prompt_key={prompt_key!r}")
    elif chat:
        prompt = chat["messages"]
    else:
        raise DataError(f"{where} has neither a prompt ('{prompt_key}', {config_prefix}.prompt_key) nor chat "
                        f"messages ('{messages_key}', {config_prefix}.messages_key)")
    if answer_key is not None and record[answer_key] is None:
        raise DataError(
            f"{where}: the answer (column '{answer_key}', {config_prefix}.answer_key) is null. A reward would "
            f"compare responses with an empty answer and score them 0; drop rows without an answer, or set "
            f"{config_prefix}.answer_key=null if the dataset has no answers"
        )
    return prompt, chat


def _chat_columns(messages: Any, where: str) -> dict[str, list[dict]]:
    """``{"messages": opening}`` plus ``"sft_messages"`` when the messages are a transcript (end with an assistant)."""
    from rltk.data.chat import check_messages, split_transcript

    try:
        checked = check_messages(messages, where)
        opening, transcript = split_transcript(checked)
    except ValueError as exc:
        message = str(exc)
        raise DataError(message if message.startswith(where) else f"{where}: {message}") from None
    return {"messages": opening, **({"sft_messages": transcript} if transcript else {})}


def _read_records(path: Path, split: str | None, config_prefix: str) -> tuple[list, str]:
    if path.is_file():
        return _read_file(path), str(path)
    if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists():
        return _read_saved_dataset(path, split, config_prefix), str(path)
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in FILE_FORMATS)
    if not files:
        raise DataError(
            f"{config_prefix}.path='{path}' is a folder with no {', '.join(FILE_FORMATS)} files and is not a "
            f"datasets save_to_disk folder (no dataset_info.json or dataset_dict.json)"
        )

    def in_split(p: Path, name: str) -> bool:
        return p.name.lower().startswith(name.lower()) or name in p.relative_to(path).parts[:-1]

    if split:
        chosen = [p for p in files if in_split(p, split)]
    else:  # the Hugging Face hub layout names splits in file names; default to train
        chosen = [p for p in files if in_split(p, "train")] or files
    if not chosen:
        raise DataError(
            f"{config_prefix}.split='{split}': no file in '{path}' is named after it or sits in a folder named "
            f"after it. Files: {[str(p.relative_to(path)) for p in files][:20]}"
        )
    records: list = []
    for file in chosen:
        records.extend(_read_file(file))
    return records, str(path if len(chosen) > 1 else chosen[0])


def _read_file(path: Path) -> list:
    try:
        return _read_file_as_utf8(path)
    except UnicodeDecodeError:
        offset, byte, line = _first_invalid_utf8(path)
        raise DataError(
            f"{path}: not UTF-8 text (byte {byte!r} at offset {offset}, line {line}). rltk reads json, jsonl and "
            f"csv files as UTF-8: convert it, e.g. `iconv -f latin1 -t utf-8 {path.name} > {path.stem}.utf8{path.suffix}`"
        ) from None


def _first_invalid_utf8(path: Path, chunk_size: int = 1 << 20) -> tuple[int, bytes, int]:
    """(file offset, byte, 1-based line) of the first byte of ``path`` that is not valid UTF-8.

    Decoded in chunks: the offset a text stream's error reports is relative to
    its read buffer, not to the file, and a large file need not fit in memory.
    """
    decoder = codecs.getincrementaldecoder("utf-8")()
    consumed, lines = 0, 0
    with path.open("rb") as handle:
        while True:
            chunk = handle.read(chunk_size)
            # An incomplete multi-byte sequence carried over from the last chunk (never a newline).
            pending = decoder.getstate()[0]
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as exc:
                data = pending + chunk
                return (consumed - len(pending) + exc.start, data[exc.start : exc.start + 1],
                        lines + data[: exc.start].count(b"\n") + 1)
            if not chunk:
                return consumed, b"", lines + 1  # valid after all (changed since it was read)
            consumed += len(chunk)
            lines += chunk.count(b"\n")


def _read_file_as_utf8(path: Path) -> list:
    suffix = path.suffix.lower()
    if suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}: not valid JSON ({exc})") from None
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            return data["data"]
        if not isinstance(data, list):
            found = f"an object with keys {sorted(data)[:10]}" if isinstance(data, dict) else type(data).__name__
            raise DataError(f"{path}: expected a list of rows or {{\"data\": [rows]}}, found {found}")
        return data
    if suffix == ".jsonl":
        records = []
        with path.open(encoding="utf-8") as handle:
            for line_number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path}: line {line_number} is not valid JSON ({exc})") from None
        return records
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if suffix == ".csv":
        with path.open(encoding="utf-8", newline="") as handle:
            return list(csv.DictReader(handle))
    raise DataError(f"{path}: unsupported file type '{suffix}'. Supported: {', '.join(FILE_FORMATS)}")


def _read_saved_dataset(path: Path, split: str | None, config_prefix: str) -> list:
    import datasets

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded.keys())
        name = split or ("train" if "train" in loaded else (splits[0] if len(splits) == 1 else None))
        if name not in loaded:
            raise DataError(
                f"{config_prefix}.split={split!r}: the dataset at '{path}' has splits {splits}; choose one"
            )
        loaded = loaded[name]
    return loaded.to_list()


def _require_key(key: str, config_key: str, columns: list[str], source: str, alternative: str = "") -> None:
    if key not in columns:
        raise DataError(f"{config_key}='{key}' is not a column of '{source}'. Columns: {', '.join(columns)}"
                        + alternative)


def _check_prompt(prompt: Any, where: str, key: str) -> str | list[dict]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
        return [{"role": m["role"], "content": m["content"]} for m in prompt]
    raise DataError(
        f"{where}: prompt ({key}) must be a string or a list of {{'role', 'content'}} messages, "
        f"got {type(prompt).__name__}: {str(prompt)[:80]!r}"
    )


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (list, dict)):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def format_prompts(
    rows: list[dict],
    tokenizer,
    *,
    system_prompt: str | None = None,
    use_chat_template: bool = False,
    prompt_template: str = "{prompt}",
    max_prompt_tokens: int | None = None,
    on_too_long: str = "filter",
    tools: list[dict] | None = None,
    config_prefix: str = "data",
) -> list[dict]:
    """Rows whose ``prompt`` is the final text to tokenize with ``add_special_tokens=False``.

    1. ``prompt_template`` is filled with ``{prompt}`` and the row's extras
       (``"Question: {prompt}\\nAnswer:"``); plain field names only, no
       attribute access or indexing (see :mod:`rltk.data.templates`).
    2. With ``use_chat_template``, the messages ``[system?, user]`` are
       rendered by ``tokenizer.apply_chat_template(..., tokenize=False,
       add_generation_prompt=True)``; a row whose prompt is already a list of
       messages gets the system prompt prepended (unless it has one) and is
       rendered as is; so is a row's ``messages`` (chat rows, see
       :mod:`rltk.data.chat`), which take precedence over its prompt.
       ``tools`` (OpenAI function schemas) are rendered by the template too.
       The formatted row keeps the rendered opening as ``messages`` and, when
       it has a demonstration, ``sft_messages`` starting with that same
       opening, so a multi-turn rollout and the warm-up render exactly the
       prompt text. Without it, the system prompt and a newline are put
       before the text, and the tokenizer's bos token when it adds one by
       default (Llama-style tokenizers), because special tokens are not
       added again at tokenization; chat rows then use their text prompt,
       and a demonstration transcript is an error (it needs the template).
    3. Prompts longer than ``max_prompt_tokens`` are dropped with a logged
       count (``on_too_long="filter"``) or raise an error naming the row
       (``"error"``). Filtering every row is an error.

    Returns new row dicts; the input rows are not modified.
    """
    _check_format_args(tokenizer, use_chat_template=use_chat_template, prompt_template=prompt_template,
                       max_prompt_tokens=max_prompt_tokens, on_too_long=on_too_long, tools=tools,
                       config_prefix=config_prefix)
    bos_prefix = "" if use_chat_template else _default_bos(tokenizer)
    texts, chats = [], []
    for row in rows:
        text, chat = _render_row(row, tokenizer, bos_prefix, system_prompt=system_prompt,
                                 use_chat_template=use_chat_template, prompt_template=prompt_template, tools=tools,
                                 config_prefix=config_prefix)
        texts.append(text)
        chats.append(chat)
    return _within_length(rows, texts, chats, tokenizer, max_prompt_tokens=max_prompt_tokens,
                          on_too_long=on_too_long, config_prefix=config_prefix)


def _check_format_args(tokenizer, *, use_chat_template: bool, prompt_template: str, max_prompt_tokens: int | None,
                       on_too_long: str, tools: list[dict] | None, config_prefix: str) -> None:
    """Refuse a bad setting of :func:`format_prompts` before any row is rendered."""
    if on_too_long not in ON_TOO_LONG:
        raise ValueError(f"{config_prefix}.on_too_long='{on_too_long}' is not valid. Valid: {', '.join(ON_TOO_LONG)}")
    if max_prompt_tokens is not None and (not isinstance(max_prompt_tokens, int) or max_prompt_tokens < 1):
        raise ValueError(f"{config_prefix}.max_prompt_tokens must be a positive integer or null, got {max_prompt_tokens!r}")
    if use_chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{config_prefix}.use_chat_template=true but tokenizer {type(tokenizer).__name__} has no chat "
            f"template; set it to false, or use a model folder whose tokenizer_config.json has one"
        )
    template_fields(prompt_template, f"{config_prefix}.prompt_template")  # refused before any row is read
    if tools and not use_chat_template:
        raise ValueError(f"tools are rendered by the chat template: they need {config_prefix}.use_chat_template=true")


def _render_row(row: dict, tokenizer, bos_prefix: str, *, system_prompt: str | None, use_chat_template: bool,
                prompt_template: str, tools: list[dict] | None, config_prefix: str) -> tuple[str, dict]:
    """One row's prompt text, and the chat columns (``messages``, ``sft_messages``) the formatted row keeps."""
    prompt, given = row["prompt"], row.get("messages")
    chat: dict[str, list[dict]] = {}
    if not use_chat_template:
        if isinstance(prompt, list):
            raise ValueError(
                f"row '{row['id']}': the prompt is a list of chat messages, which needs "
                f"{config_prefix}.use_chat_template=true"
            )
        if row.get("sft_messages"):
            raise ValueError(
                f"row '{row['id']}' has a demonstration transcript (sft_messages), which is rendered by the chat "
                f"template: set {config_prefix}.use_chat_template=true"
            )
    if use_chat_template and (isinstance(given, list) or isinstance(prompt, list)):
        original = given if isinstance(given, list) else prompt
        messages = _format_opening(original, row, system_prompt, prompt_template, config_prefix)
    else:
        text = _fill(prompt_template, prompt, row, config_prefix)
        original = None
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": text}
        ]
    if not use_chat_template:
        body = messages[-1]["content"]
        return bos_prefix + (f"{system_prompt}\n{body}" if system_prompt else body), chat
    text = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=True)
    chat["messages"] = messages
    if row.get("sft_messages"):
        chat["sft_messages"] = _format_transcript(row["sft_messages"], original, messages, row,
                                                  system_prompt, prompt_template, config_prefix)
    return text, chat


def _within_length(rows: list[dict], texts: list[str], chats: list[dict], tokenizer, *,
                   max_prompt_tokens: int | None, on_too_long: str, config_prefix: str) -> list[dict]:
    """The formatted rows whose prompt fits ``max_prompt_tokens``; the others dropped with a logged count or
    refused, as ``on_too_long`` says. All prompts are tokenized in one call."""
    if max_prompt_tokens is None:
        lengths = [0] * len(texts)
    else:
        lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else []
    formatted, too_long = [], []
    for row, text, length, chat in zip(rows, texts, lengths, chats):
        if max_prompt_tokens is not None and length > max_prompt_tokens:
            if on_too_long == "error":
                raise ValueError(
                    f"row '{row['id']}': the prompt is {length} tokens, more than "
                    f"{config_prefix}.max_prompt_tokens={max_prompt_tokens}. Raise the limit, shorten the "
                    f"prompt, or set {config_prefix}.on_too_long=filter to drop such rows"
                )
            too_long.append(row["id"])
            continue
        formatted.append({**row, "prompt": text, "extras": dict(row.get("extras", {})), **chat})
    if too_long:
        logger.warning(
            "dropped %d of %d prompts longer than %s.max_prompt_tokens=%d (first ids: %s)",
            len(too_long), len(rows), config_prefix, max_prompt_tokens, ", ".join(too_long[:5]),
        )
    if rows and not formatted:
        raise ValueError(
            f"all {len(rows)} prompts are longer than {config_prefix}.max_prompt_tokens={max_prompt_tokens}; "
            f"nothing is left to train on. Raise the limit."
        )
    return formatted


def _format_opening(messages: list[dict], row: dict, system_prompt: str | None, prompt_template: str,
                    config_prefix: str) -> list[dict]:
    """Opening messages with the prompt template filled into user messages and the system prompt first."""
    messages = [dict(m) for m in messages]
    for message in messages:
        if message["role"] == "user" and isinstance(message["content"], str):
            message["content"] = _fill(prompt_template, message["content"], row, config_prefix)
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def _format_transcript(transcript: list[dict], original: list[dict] | None, opening: list[dict], row: dict,
                       system_prompt: str | None, prompt_template: str, config_prefix: str) -> list[dict]:
    """The demonstration with the formatted ``opening`` in place of its own, so the warm-up's prompt is the
    rollout's. A transcript that does not start with the row's opening is formatted on its own."""
    head = original if original is not None else [{"role": "user", "content": row["prompt"]}]
    if [(m["role"], m["content"]) for m in transcript[: len(head)]] == [(m["role"], m["content"]) for m in head]:
        return opening + [dict(m) for m in transcript[len(head):]]
    first = next((i for i, m in enumerate(transcript) if m["role"] == "assistant"), len(transcript))
    own = _format_opening(transcript[:first], row, system_prompt, prompt_template, config_prefix)
    return own + [dict(m) for m in transcript[first:]]


def _fill(template: str, prompt: str, row: dict, config_prefix: str) -> str:
    if template == "{prompt}":
        return prompt
    fields = {**row.get("extras", {}), "prompt": prompt}
    return fill_template(template, fields, f"{config_prefix}.prompt_template", f"row '{row['id']}'")


def _default_bos(tokenizer) -> str:
    """The bos token text if the tokenizer puts bos first by default, else ''."""
    bos_id = getattr(tokenizer, "bos_token_id", None)
    if bos_id is None:
        return ""
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return tokenizer.bos_token if ids and ids[0] == bos_id else ""
