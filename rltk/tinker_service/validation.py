"""The service's bounds and the checks every request passes before any work is queued.

A failed check is an :class:`~rltk.serve.errors.APIError` 400 whose message starts with the field
(``data[2].loss_fn_inputs.advantages: ...``, ``sampling_params.max_tokens: ...``); the SDK raises it
as ``tinker.BadRequestError`` with that message. Bounds (:class:`TinkerLimits`) are checked first,
so an oversized request is refused before it is decoded or tokenized.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pydantic

from rltk.serve.errors import APIError


@dataclass(frozen=True)
class TinkerLimits:
    """Per-request bounds of ``rltk serve-tinker``; every field must be an integer >= 1.

    ``max_body_bytes`` and ``max_json_depth`` are read by :func:`rltk.serve.limits.json_body`.
    """

    max_body_bytes: int = 64 << 20
    max_json_depth: int = 32
    max_datums: int = 256  # per forward_backward request (the SDK splits larger batches into requests)
    max_batch_tokens: int = 65_536  # tokens over a forward_backward request's datums
    max_samples: int = 64  # num_samples of one sample request
    max_sample_tokens: int = 16_384  # num_samples x max_tokens of one sample request
    max_lora_rank: int = 128

    def __post_init__(self):
        for name, value in vars(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"TinkerLimits: {name} must be an integer >= 1, got {value!r}")


def bad(field: str, message: str) -> APIError:
    return APIError(400, f"{field}: {message}", param=field)


def parse(model_cls, body: dict):
    """``body`` as the SDK's pydantic request type, or a 400 naming the first bad field."""
    try:
        return model_cls.model_validate(body)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "body"
        raise bad(field, f"{first['msg']} (got {str(first.get('input'))[:80]!r})") from None


def check_tokens(field: str, tokens, vocab_size: int) -> None:
    array = np.asarray(tokens)
    if array.size and (array.min() < 0 or array.max() >= vocab_size):
        worst = int(array.min()) if array.min() < 0 else int(array.max())
        raise bad(field, f"token id {worst} is outside this model's vocabulary [0, {vocab_size})")


def check_forward_backward(data: list, needs: tuple[str, ...], *, vocab_size: int, context: int | None,
                           limits: TinkerLimits) -> None:
    """Every datum of a ``forward_backward`` request: lengths, token ids, the loss's inputs."""
    if not data:
        raise bad("data", "no datums")
    if len(data) > limits.max_datums:
        raise bad("data", f"{len(data)} datums, over this service's limit of {limits.max_datums} per request")
    total = sum(len(d.tokens) for d in data)
    if total > limits.max_batch_tokens:
        raise bad("data", f"{total} tokens in one request, over this service's limit of {limits.max_batch_tokens} "
                          "(--max-batch-tokens)")
    for i, datum in enumerate(data):
        n = len(datum.tokens)
        if n == 0:
            raise bad(f"data[{i}].model_input", "no tokens")
        if context is not None and n > context:
            raise bad(f"data[{i}].model_input", f"{n} tokens, more than the model's context of {context}")
        check_tokens(f"data[{i}].model_input", datum.tokens, vocab_size)
        for name in ("target_tokens", *needs):
            if name not in datum.inputs:
                raise bad(f"data[{i}].loss_fn_inputs.{name}", f"missing; this loss needs target_tokens"
                          f"{''.join(', ' + n for n in needs)}")
        for name, values in datum.inputs.items():
            field = f"data[{i}].loss_fn_inputs.{name}"
            if values.ndim != 1 or values.shape[0] != n:
                raise bad(field, f"shape {list(values.shape)}; must be [{n}], one value per model_input token")
            if values.dtype.kind == "f" and not np.isfinite(values).all():
                raise bad(field, "holds NaN or infinite values")
        check_tokens(f"data[{i}].loss_fn_inputs.target_tokens", datum.inputs["target_tokens"], vocab_size)
