"""The Tinker SDK's protobuf bodies: ``/forward_backward`` requests in, fwd/bwd outputs and samples out.

The SDK sends ``forward_backward`` as ``application/x-protobuf`` (zstd-compressed when the server's
client config asks for it; ours does not, but a compressed body is read too) and asks for
``ForwardBackwardOutput`` and ``SampleResponse`` results as protobuf (``Accept``). The schema is the
SDK's own ``tinker.proto.tinker_public_pb2``, so the service reads and writes exactly what the SDK
writes and reads. Everything else the SDK sends is JSON, parsed with the SDK's pydantic types in
:mod:`rltk.tinker_service.app`.

Decoding turns the message into plain Python and numpy (:class:`DatumIn`); a problem is a
:class:`WireError` naming the field (``data[3].loss_fn_inputs.weights``), answered as a 400.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PROTO_CONTENT_TYPE = "application/x-protobuf"


class WireError(ValueError):
    """A body the service cannot read; the message names the field (``field``, where one is known)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


#: The SDK's chunk kinds that carry an image (its ``ImageChunk``, ``ImageAssetPointerChunk``).
IMAGE_CHUNK_KINDS = ("image", "image_asset_pointer")


def unsupported_chunk(kind: str) -> str:
    """Why a chunk of ``kind`` (``image``, ``image_asset_pointer``, ``dmel`` ...) is refused by a service whose
    model cannot read it: images need a vision-language model served (PATH a folder whose ``config.json`` has
    a ``vision_config``, with its processor), which reads ``ImageChunk`` bytes (:mod:`rltk.tinker_service.images`);
    an asset pointer is an address, which the service never fetches."""
    if kind == "image_asset_pointer":
        return ("an image_asset_pointer chunk; rltk serve-tinker fetches no image addresses: send the image's "
                "bytes as an ImageChunk (png or jpeg)")
    if kind in IMAGE_CHUNK_KINDS:
        return ("an image chunk; the served model is a text model, which cannot read images: serve a "
                "vision-language model folder (rltk serve-tinker PATH whose config.json has a vision_config, "
                "Qwen2.5-VL or Qwen3-VL, with its processor) to send ImageChunk inputs, or send EncodedTextChunk "
                "tokens only (types.ModelInput.from_ints)")
    return (f"{kind or 'an empty'} chunk; this service takes text (EncodedTextChunk) and, with a vision-language "
            f"model, image (ImageChunk) chunks only")


@dataclass
class DatumIn:
    """One datum: its input tokens and its ``loss_fn_inputs`` as flat numpy arrays (by name)."""

    tokens: list[int]
    inputs: dict[str, np.ndarray]
    images: list = field(default_factory=list)  # its image chunks (rltk.tinker_service.images.ImageIn), in order
    vision: Any = None  # their processor outputs once expanded (rltk.batch.PromptImages), for a VLM


@dataclass
class ForwardBackwardIn:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    data: list[DatumIn] = field(default_factory=list)


def _pb():
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


def _numpy_dtypes() -> dict:
    pb = _pb()
    return {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


def decode_tensor(msg, where: str) -> np.ndarray:
    """A ``Tensor`` message as a numpy array of its shape (a sparse CSR matrix made dense)."""
    dtype = _numpy_dtypes().get(msg.dtype)
    if dtype is None:
        raise WireError(f"{where}: dtype {msg.dtype} is not one of float32, int64, int32")
    shape = [int(s) for s in msg.shape]
    if msg.HasField("sparse_csr"):
        csr = msg.sparse_csr
        values = np.frombuffer(csr.values, dtype=dtype)
        crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
        cols = np.frombuffer(csr.col_indices, dtype=np.int64)
        if len(shape) != 2 or len(crow) != shape[0] + 1 or len(cols) != len(values):
            raise WireError(f"{where}: a sparse tensor must be 2-D CSR with shape[0] + 1 row pointers")
        dense = np.zeros(shape, dtype=dtype)
        rows = np.repeat(np.arange(shape[0]), np.diff(crow))
        if len(cols) and (cols.min() < 0 or cols.max() >= shape[1]):
            raise WireError(f"{where}: a sparse column index is outside the shape {shape}")
        dense[rows, cols] = values
        return dense
    array = np.frombuffer(msg.dense, dtype=dtype)
    if shape and math.prod(shape) != array.size:
        raise WireError(f"{where}: {array.size} values for shape {shape}")
    return array.reshape(shape) if shape else array


def _datum(msg, index: int) -> DatumIn:
    from rltk.tinker_service.images import ImageIn

    tokens: list[int] = []
    images: list[ImageIn] = []
    for j, chunk in enumerate(msg.model_input):
        kind = chunk.WhichOneof("chunk")
        where = f"data[{index}].model_input[{j}]"
        if kind == "image":  # placed at its position once the served model's processor has counted its tokens
            image = chunk.image
            images.append(ImageIn(len(tokens), bytes(image.data), image.format,
                                  int(image.expected_tokens) if image.HasField("expected_tokens") else None, where))
            continue
        if kind != "encoded_text":
            raise WireError(f"{where}: {unsupported_chunk(kind)}", field=where)
        tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
    inputs = {name: decode_tensor(tensor, f"data[{index}].loss_fn_inputs.{name}")
              for name, tensor in msg.loss_fn_inputs.items()}
    return DatumIn(tokens=tokens, inputs=inputs, images=images)


def decode_forward_backward(body: bytes, content_encoding: str | None = None) -> ForwardBackwardIn:
    """The SDK's ``ForwardBackwardRequest`` protobuf (zstd when ``Content-Encoding: zstd``)."""
    if content_encoding and content_encoding.lower() == "zstd":
        import zstandard

        try:
            body = zstandard.ZstdDecompressor().decompress(body, max_output_size=1 << 31)
        except zstandard.ZstdError as exc:
            raise WireError(f"the body is not valid zstd: {exc}") from None
    elif content_encoding and content_encoding.lower() != "identity":
        raise WireError(f"Content-Encoding {content_encoding!r} is not supported (zstd or none)")
    msg = _pb().ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:  # protobuf's DecodeError and friends
        raise WireError(f"the body is not a ForwardBackwardRequest protobuf: {exc}") from None
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():  # v2 wins where both are set (the SDK writes both)
        config[key] = value.text if value.WhichOneof("value") == "text" else float(value.number)
    return ForwardBackwardIn(model_id=msg.model_id, seq_id=int(msg.seq_id), loss_fn=msg.loss_fn,
                             loss_fn_config=config, forward_only=bool(msg.forward_only),
                             data=[_datum(d, i) for i, d in enumerate(msg.data)])


def encode_forward_backward_output(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """``ForwardBackwardOutput``: one batched ``ArrayRecord`` whose fields hold each datum's 1-D float32 array."""
    pb = _pb()
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in metrics.items():
        msg.metrics[key] = float(value)
    record = msg.loss_fn_outputs.add()
    record.num_datums = len(outputs)
    for name in (outputs[0].keys() if outputs else ()):
        arrays = [np.ascontiguousarray(out[name], dtype=np.float32).reshape(-1) for out in outputs]
        offsets = np.concatenate([[0], np.cumsum([a.nbytes for a in arrays])]).astype(np.int64)
        batched = record.fields[name]
        batched.data = b"".join(a.tobytes() for a in arrays)
        batched.offsets = offsets.tobytes()
        batched.dtype = pb.DTYPE_FLOAT32
    return msg.SerializeToString()


def encode_sample_response(sequences: list[tuple[list[int], list[float], str]],
                           prompt_logprobs: list[float] | None = None) -> bytes:
    """``SampleResponse``: ``(tokens, logprobs, "stop" | "length")`` per sequence; prompt log-probs
    with NaN where none is defined (the first prompt token)."""
    pb = _pb()
    reasons = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
    msg = pb.SampleResponse()
    for tokens, logprobs, reason in sequences:
        seq = msg.sequences.add()
        seq.stop_reason = reasons[reason]
        seq.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(logprobs, dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return msg.SerializeToString()
