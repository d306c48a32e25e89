"""The service's protobuf against the SDK's own encoders and decoders."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("tinker")

from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402
from tinker.proto.response_conv import (  # noqa: E402
    deserialize_forward_backward_output, deserialize_sample_response,
)

from rltk.tinker_service.wire import (  # noqa: E402
    WireError, decode_forward_backward, encode_forward_backward_output, encode_sample_response,
)


def _request(datum, loss_fn="ppo", config=None):
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn=loss_fn, loss_fn_config=config),
        model_id="m", seq_id=3)
    return forward_backward_request_to_proto(request).SerializeToString()


def test_a_forward_backward_request_decodes_to_what_the_sdk_encoded():
    datum = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                        loss_fn_inputs={"target_tokens": np.array([6, 7, 1]),
                                        "logprobs": np.array([-0.5, -1.0, -2.0], dtype=np.float32),
                                        "advantages": np.array([0.0, 1.5, 1.5], dtype=np.float32)})
    fwd = decode_forward_backward(_request(datum, config={"clip_low_threshold": 0.7}))
    assert (fwd.model_id, fwd.seq_id, fwd.loss_fn, fwd.forward_only) == ("m", 3, "ppo", False)
    assert fwd.loss_fn_config == {"clip_low_threshold": pytest.approx(0.7)}
    assert fwd.data[0].tokens == [5, 6, 7]
    assert fwd.data[0].inputs["target_tokens"].tolist() == [6, 7, 1]
    assert fwd.data[0].inputs["advantages"].tolist() == [0.0, 1.5, 1.5]


def test_a_zstd_body_decodes_and_garbage_is_refused():
    import zstandard

    datum = types.Datum(model_input=types.ModelInput.from_ints([1]), loss_fn_inputs={"target_tokens": np.array([2])})
    body = zstandard.ZstdCompressor().compress(_request(datum, "cross_entropy"))
    assert decode_forward_backward(body, "zstd").data[0].tokens == [1]
    with pytest.raises(WireError, match="not a ForwardBackwardRequest"):
        decode_forward_backward(b"\xff\xff\xff")


def test_image_chunks_decode_to_their_place_among_the_tokens():
    chunks = [types.EncodedTextChunk(tokens=[5, 6]), types.ImageChunk(data=b"png-bytes", format="png", expected_tokens=4),
              types.EncodedTextChunk(tokens=[7]), types.ImageChunk(data=b"jpeg-bytes", format="jpeg")]
    datum = types.Datum(model_input=types.ModelInput(chunks=chunks), loss_fn_inputs={"target_tokens": np.array([2])})
    decoded = decode_forward_backward(_request(datum, "cross_entropy")).data[0]
    assert decoded.tokens == [5, 6, 7]  # the images' tokens go in once the served processor counts them
    assert [(i.at, i.data, i.format, i.expected_tokens, i.field) for i in decoded.images] == [
        (2, b"png-bytes", "png", 4, "data[0].model_input[1]"), (3, b"jpeg-bytes", "jpeg", None, "data[0].model_input[3]")]


def test_outputs_and_samples_decode_with_the_sdk():
    body = encode_forward_backward_output([{"logprobs": np.array([-1.0, -2.0])}, {"logprobs": np.array([-3.0])}],
                                          {"loss:sum": 6.0})
    out = deserialize_forward_backward_output(body)
    assert out.metrics == {"loss:sum": 6.0}
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-1.0, -2.0], [-3.0]]
    sample = deserialize_sample_response(encode_sample_response([([4, 1], [-0.5, -0.25], "stop"),
                                                                 ([4, 4], [-0.5, -1.0], "length")],
                                                                [math.nan, -2.0]))
    assert [(s.tokens, s.logprobs, s.stop_reason) for s in sample.sequences] == [
        ([4, 1], [-0.5, -0.25], "stop"), ([4, 4], [-0.5, -1.0], "length")]
    assert sample.prompt_logprobs == [None, -2.0]
