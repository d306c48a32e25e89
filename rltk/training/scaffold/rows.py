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
    _check_image_rows(cfg, train + held_out)
    fmt = dict(system_prompt=d.system_prompt, use_chat_template=d.use_chat_template,
               prompt_template=d.prompt_template, max_prompt_tokens=d.max_prompt_tokens,
               on_too_long=d.on_too_long, tools=tool_schemas(cfg))
    if d.max_prompt_tokens is None or not any(row.get("images") for row in train + held_out):
        return format_prompts(train, tokenizer, **fmt), format_prompts(held_out, tokenizer, **fmt)
    # rows with images: their length is counted with the image tokens the processor expands them into
    from rltk.training.scaffold.setup import build_processor

    processor = build_processor(cfg, tokenizer)
    fmt["max_prompt_tokens"] = None
    return tuple(_within_length_with_images(format_prompts(rows, tokenizer, **fmt), tokenizer, processor,
                                            d.max_prompt_tokens, d.on_too_long) for rows in (train, held_out))


def _within_length_with_images(rows: list[dict], tokenizer, processor, max_tokens: int,
                               on_too_long: str) -> list[dict]:
    """The formatted rows whose prompt fits ``data.max_prompt_tokens``, a row with images counted as the
    processor encodes it (each image its feature tokens, :func:`rltk.models.vision.inputs.expanded_length`); the
    others dropped with a logged count or refused, as ``data.on_too_long`` says (as
    :func:`rltk.data.loading.format_prompts` does for text rows)."""
    import logging

    from rltk.models.vision.inputs import expanded_length

    kept, dropped = [], []
    for row in rows:
        images = row.get("images") or []
        length = expanded_length(processor, row["prompt"], images)
        if length <= max_tokens:
            kept.append(row)
        elif on_too_long == "error":
            raise ConfigError(f"row '{row['id']}': the prompt is {length} tokens (with its {len(images)} "
                              f"image(s)' tokens), more than data.max_prompt_tokens={max_tokens}. Raise the limit, "
                              f"use smaller images, or set data.on_too_long=filter to drop such rows")
        else:
            dropped.append(row["id"])
    if dropped:
        logging.getLogger(__name__).warning(
            "dropped %d of %d prompts longer than data.max_prompt_tokens=%d (image tokens counted; first ids: %s)",
            len(dropped), len(rows), max_tokens, ", ".join(dropped[:5]))
    if rows and not kept:
        raise ConfigError(f"all {len(rows)} prompts are longer than data.max_prompt_tokens={max_tokens} with their "
                          f"image tokens; nothing is left to train on. Raise the limit.")
    return kept


def _check_image_rows(cfg: DictConfig, rows: list[dict]) -> None:
    """Rows with images need a vision-language policy and a run that carries them to every forward.

    The synchronous RL loop (``trainer.mode=sync``, the ``single_turn`` and ``multi_turn`` workflows) and the
    supervised warm-up carry each row's images from the processor to the engine and every log-prob pass; what
    does not (the asynchronous modes, a critic, the preference and distillation stages) is refused
    here, and by :func:`refuse_image_rows` as a stage starts, naming ``data.image_key``.
    Packing is refused for any VLM policy before rows load (:func:`rltk.config.validation.check_vision_config`).
    """
    from rltk.config.validation import policy_is_vlm

    with_images = next((row for row in rows if row.get("images")), None)
    if with_images is None:
        return
    key = cfg.data.image_key
    where = (f"data.image_key='{key}': row '{with_images['id']}' has {len(with_images['images'])} image(s)")
    vlm, described = policy_is_vlm(cfg)
    if not vlm:
        raise ConfigError(f"{where} but the policy ({described}) is a text model; use a vision-language model "
                          f"(model.tiny.vision.depth=2 or a Qwen-VL folder), or drop the column")
    if cfg.trainer.mode != "sync":
        raise ConfigError(f"{where}: trainer.mode={cfg.trainer.mode} does not carry images to its producer yet; "
                          f"run with trainer.mode=sync")
    if cfg.rollout.workflow not in ("single_turn", "multi_turn"):
        raise ConfigError(f"{where}: rollout.workflow={cfg.rollout.workflow} does not carry images yet; "
                          f"run with rollout.workflow=single_turn or multi_turn")


def refuse_image_rows(rows: list[dict], cfg: DictConfig, what: str) -> None:
    """Stop a stage (``what``, e.g. "the dpo stage") that would train on the text of rows with images alone."""
    with_images = next((row for row in rows if row.get("images")), None)
    if with_images is not None:
        raise ConfigError(
            f"data.image_key='{cfg.data.image_key}': row '{with_images['id']}' has {len(with_images['images'])} "
            f"image(s), but {what} does not carry images to its forwards yet, so it would train on the text "
            f"alone; drop the column (or set data.image_key to a column the data lacks) for this stage")


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
              tools: list[dict] | None = None, processor=None) -> list[tuple]:
    """``(prompt ids, response ids, loss mask)`` for supervised warm-up, and the prompt's
    :class:`rltk.batch.PromptImages` fourth for a row with images.

    A row with ``images`` goes through a VLM's ``processor`` as the rollout's prompts do
    (:func:`rltk.models.vision.inputs.encode_prompt`: placeholders expanded into image tokens), so the loss
    sees the image features; its pixel values travel with the example into the batch. A demonstration
    transcript with images is refused (its turns are not encoded by the processor yet).

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
        if row.get("images") and (processor is None or (row.get("sft_messages") and not completion_key)):
            what = ("the policy has no processor (a text model)" if processor is None else
                    "its demonstration transcript (sft_messages) is not encoded with images yet")
            raise ConfigError(f"row '{row.get('id')}' has {len(row['images'])} image(s) (data.image_key) but {what}; "
                              f"drop the column, or give the row a completion instead of a transcript")
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
        completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        if row.get("images"):
            from rltk.models.vision.inputs import encode_prompt

            prompt_ids, vision = encode_prompt(processor, row["prompt"], row["images"])
            pairs.append((prompt_ids, completion_ids, [1] * len(completion_ids), vision))
            continue
        prompt_ids = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        pairs.append((prompt_ids, completion_ids, [1] * len(completion_ids)))
    return pairs
