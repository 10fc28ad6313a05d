"""The client decodes packed little-endian vectors and stream errors without per-value objects."""

import grpc
import numpy as np
import pytest

from sidecar.client import EmbedOptions, _stream_result, decode_response
from sidecar.wire import embedder_pb2 as pb


@pytest.mark.parametrize("encoding,dtype", [
    (pb.ENCODING_FLOAT32, "<f4"), (pb.ENCODING_FLOAT16, "<f2"), (pb.ENCODING_INT8, "i1")])
def test_dense_encodings_round_trip(encoding, dtype):
    rng = np.random.default_rng(0)
    vectors = (rng.standard_normal((3, 5)) * 50).astype(dtype)
    resp = pb.EmbedResponse(request_id="r", model="m", count=3, dimensions=5, encoding=encoding,
                            vectors=vectors.tobytes(), token_counts=[4, 5, 6])
    out = decode_response(resp)
    assert out.vectors.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(out.vectors, vectors)
    assert out.token_counts.tolist() == [4, 5, 6]
    assert out.token_counts.dtype == np.int64
    assert (out.request_id, out.model, out.dimensions, len(out)) == ("r", "m", 5, 3)


def test_binary_rows_are_ceil_dims_over_8_bytes():
    bits = np.array([[1, 0, 1, 1, 0, 0, 0, 0, 1, 1], [0] * 9 + [1]], dtype=bool)
    packed = np.packbits(bits, axis=1)
    resp = pb.EmbedResponse(count=2, dimensions=10, encoding=pb.ENCODING_BINARY,
                            vectors=packed.tobytes())
    out = decode_response(resp)
    assert out.vectors.shape == (2, 2)
    np.testing.assert_array_equal(np.unpackbits(out.vectors, axis=1)[:, :10], bits)


def test_sparse_vectors_decode_per_input():
    resp = pb.EmbedResponse(count=1, dimensions=1, vectors=np.zeros((1, 1), "<f4").tobytes(),
                            sparse=[pb.SparseVector(indices=[7, 9], values=[0.5, 1.5])])
    sparse = decode_response(resp).sparse
    assert sparse[0].indices.tolist() == [7, 9]
    assert sparse[0].values.tolist() == [0.5, 1.5]
    assert (sparse[0].indices.dtype, sparse[0].values.dtype) == (np.uint32, np.float32)


def test_stream_error_keeps_code_message_and_index():
    resp = pb.EmbedResponse(request_id="b7", error=pb.Error(
        code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message="texts[2]: empty text", index=2))
    result = _stream_result(resp)
    assert result.embeddings is None
    assert result.request_id == "b7"
    assert result.error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert result.error.index == 2 and "texts[2]" in result.error.message


def test_options_reject_bad_values_before_sending():
    with pytest.raises(ValueError, match="lane"):
        EmbedOptions(lane="fast").request(texts=["a"])
    with pytest.raises(ValueError, match="encoding"):
        EmbedOptions(encoding="bf16").request(texts=["a"])
    with pytest.raises(TypeError, match="not one string"):
        EmbedOptions().request(texts="a single string")


def test_unset_normalize_means_model_default():
    assert not EmbedOptions().request(texts=["a"]).HasField("normalize")
    assert EmbedOptions(normalize=False).request(texts=["a"]).HasField("normalize")


def test_every_option_reaches_the_request_and_requests_share_nothing():
    options = EmbedOptions(model="m", lane="batch", prompt="query", normalize=True, truncate=False,
                           dimensions=8, encoding="int8", sparse=True)
    first = options.request("a", texts=["x", "y"])
    second = options.request("b", token_ids=[[1, 2]])
    assert (first.request_id, list(first.texts), len(first.token_ids)) == ("a", ["x", "y"], 0)
    assert (second.request_id, list(second.texts), list(second.token_ids[0].ids)) == ("b", [], [1, 2])
    for req in (first, second):
        assert (req.model, req.lane, req.prompt_name, req.normalize, req.truncation, req.dimensions,
                req.encoding, req.return_sparse) == (
            "m", pb.LANE_BATCH, "query", True, pb.TRUNCATION_ERROR, 8, pb.ENCODING_INT8, True)
