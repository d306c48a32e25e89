"""A run's rows: train and held-out prompts from a dataset or a synthetic task, tool schemas,
and the (prompt, response, loss mask) examples of the supervised warm-up."""

from __future__ import annotations

import random

from omegaconf import DictConfig, OmegaConf

from rltk.errors import ConfigError


def build_rows(cfg: DictConfig, tokenizer) -> tuple[list[dict], list[dict]]:
    """Train and held-out rows in the standard form ``{prompt, ground_truth, extras, id}``.

    Data problems (a missing column, too few synthetic problems, an empty
    split) are config errors: they name the ``data.*`` key to change.
    """
    try:
        return _build_rows(cfg, tokenizer)
    except (ValueError, FileNotFoundError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"data: {exc}") from exc


def _build_rows(cfg: DictConfig, tokenizer) -> tuple[list[dict], list[dict]]:
    from rltk.data.loading import format_prompts, load_rows
    from rltk.data.synthetic import make_task

    d = cfg.data
    extras_keys = list(d.extras_keys) if d.extras_keys is not None else None
    if d.path:
        train = load_rows(d.path, split=d.split, prompt_key=d.prompt_key, answer_key=d.answer_key,
                          extras_keys=extras_keys, messages_key=d.messages_key, image_key=d.image_key)
        if d.eval_path:
            held_out = load_rows(d.eval_path, split=d.eval_split, prompt_key=d.prompt_key,
                                 answer_key=d.answer_key, extras_keys=extras_keys, messages_key=d.messages_key,
                                 image_key=d.image_key)
        else:  # carve a deterministic held-out slice off the training file
            order = list(range(len(train)))
            random.Random(cfg.seed).shuffle(order)
            n_eval = min(d.eval_size, max(1, len(train) // 10))
            held_out = [train[i] for i in order[:n_eval]]
            train = [train[i] for i in order[n_eval:]]
    elif d.task:
        task_args = dict(OmegaConf.to_container(d.task_args, resolve=True))
        train = make_task(d.task, "train", d.train_size, cfg.seed, **task_args)
        held_out = make_task(d.task, "heldout", d.eval_size, cfg.seed, **task_args)
    else:
        raise ConfigError("set either 'data.path' (a dataset file or folder) or 'data.task' (a synthetic task)")
    _refuse_images(train + held_out, d.image_key)
    fmt = dict(system_prompt=d.system_prompt, use_chat_template=d.use_chat_template,
               prompt_template=d.prompt_template, max_prompt_tokens=d.max_prompt_tokens,
               on_too_long=d.on_too_long, tools=tool_schemas(cfg))
    return format_prompts(train, tokenizer, **fmt), format_prompts(held_out, tokenizer, **fmt)


def _refuse_images(rows: list[dict], image_key: str) -> None:
    """Rows with images stop the run: they are read and checked, but not yet carried to the engine and the loss."""
    with_images = next((row for row in rows if row.get("images")), None)
    if with_images is not None:
        raise ConfigError(
            f"data.image_key='{image_key}': row '{with_images['id']}' has {len(with_images['images'])} image(s); "
            f"rltk reads and checks them, but passing images to the rollout engine and every log-prob pass is "
            f"not wired yet, so a run would train on the text alone. Drop the column or set data.image_key to "
            f"a column the data lacks")


def tool_schemas(cfg: DictConfig) -> list[dict] | None:
    """The OpenAI function schemas of ``env.tools`` (with ``env.tools_args``), as the chat template renders them.

    Prompts, demonstrations and multi-turn rollouts all render the same tool
    list, so the warm-up and RL see one prompt text. ``None`` without tools.
    """
    env = cfg.get("env")
    if env is None or not env.tools:
        return None
    from rltk.tools.resolve import resolve_tools

    return [tool.schema() for tool in resolve_tools(OmegaConf.to_container(env, resolve=True))]


def sft_pairs(rows: list[dict], tokenizer, completion_key: str | None = None, *,
              tools: list[dict] | None = None) -> list[tuple[list[int], list[int], list[int]]]:
    """``(prompt ids, response ids, loss mask)`` for supervised warm-up.

    A row with a demonstration transcript (``sft_messages``) is tokenized by
    :func:`rltk.data.chat.tokenize_transcript` (``tools`` rendered as in the
    rollout's prompts): the loss covers its assistant turns only, and the ids
    are those a multi-turn rollout of the same conversation builds. Any other
    row teaches one completion, all of it with eos: ``extras["solution"]``
    when the task provides one, else ``extras[completion_key]`` when
    configured, else the ground truth.
    """
    from rltk.data.chat import tokenize_transcript

    pairs = []
    for row in rows:
        extras = row.get("extras") or {}
        if row.get("sft_messages") and not completion_key:
            try:
                pairs.append(tokenize_transcript(row["sft_messages"], tokenizer, tools=tools))
            except ValueError as exc:
                raise ConfigError(f"row '{row.get('id')}': its demonstration (sft_messages) cannot be tokenized: "
                                  f"{exc}") from exc
            continue
        if completion_key:
            if completion_key not in extras:
                raise ConfigError(
                    f"sft.completion_key='{completion_key}' is not a column of row {row.get('id')}; "
                    f"available extras: {sorted(extras)} (add it to data.extras_keys)"
                )
            completion = str(extras[completion_key])
        else:
            completion = str(extras.get("solution", row["ground_truth"]))
        prompt_ids = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        pairs.append((prompt_ids, completion_ids, [1] * len(completion_ids)))
    return pairs
