"""Bytes that are not a valid request, sent raw to a real `fern serve`: INVALID_ARGUMENT naming the field, no traceback."""

from __future__ import annotations

import random

import grpc
import pytest

from sidecar.wire import embedder_pb2 as pb

EMBED = "/fern.v1.Embedder/Embed"
STREAM = "/fern.v1.Embedder/EmbedStream"
LIST = "/fern.v1.Embedder/ListModels"
BAD_UTF8 = b"\xff\xfe\xc3\x28"  # not UTF-8: a lone 0xff, and 0xc3 followed by a non-continuation byte


def with_bad_utf8(request: pb.EmbedRequest, marker: str = "MARK") -> bytes:
    """`request` serialized, with the string field holding `marker` made invalid UTF-8 (same length)."""
    data = request.SerializeToString()
    assert data.count(marker.encode()) == 1
    return data.replace(marker.encode(), BAD_UTF8)


@pytest.fixture(scope="module")
def sidecar(sidecar_factory):
    process = sidecar_factory()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def channel(sidecar):
    with grpc.insecure_channel(sidecar.target) as ch:
        yield ch


def raw_unary(channel: grpc.Channel, method: str, data: bytes) -> grpc.RpcError | bytes:
    call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
    try:
        return call(data, timeout=30)
    except grpc.RpcError as error:
        return error


@pytest.mark.parametrize("request_, field", [
    (pb.EmbedRequest(texts=["fine", "MARK", "also fine"]), "texts[1]"),
    (pb.EmbedRequest(texts=["MARK"]), "texts[0]"),
    (pb.EmbedRequest(texts=["a"], model="MARK"), "model"),
    (pb.EmbedRequest(texts=["a"], request_id="MARK"), "request_id"),
    (pb.EmbedRequest(texts=["a"], prompt_name="MARK"), "prompt_name"),
])
def test_invalid_utf8_is_invalid_argument_naming_the_field(channel, request_, field):
    error = raw_unary(channel, EMBED, with_bad_utf8(request_))
    assert isinstance(error, grpc.RpcError), "the server embedded invalid UTF-8"
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert f"{field}: not valid UTF-8" in error.details(), error.details()


def test_invalid_utf8_index_travels_in_trailing_metadata(channel):
    error = raw_unary(channel, EMBED, with_bad_utf8(pb.EmbedRequest(texts=["a", "b", "MARK"])))
    assert ("fern-input-index", "2") in tuple(error.trailing_metadata())


def test_truncated_and_random_bytes_are_invalid_argument(channel):
    whole = pb.EmbedRequest(texts=["hello world", "a second text"], model="m").SerializeToString()
    rng = random.Random(24)
    cases = [whole[:-3], whole[:5], b"\xff" * 16, bytes(rng.randrange(256) for _ in range(200)),
             b"\x1a\xff\xff\xff\xff\x0f"]  # texts with a 4 GiB length and no bytes
    for data in cases:
        error = raw_unary(channel, EMBED, data)
        assert isinstance(error, grpc.RpcError), f"{data[:16]!r}: answered"
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (data[:16], error)
        assert "fern.v1.EmbedRequest" in error.details(), error.details()


def test_list_models_with_garbage_is_invalid_argument(channel):
    error = raw_unary(channel, LIST, b"\x0a\xff\xff")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert "fern.v1.ListModelsRequest" in error.details()


def test_stream_answers_what_it_read_then_ends_naming_the_bad_message(channel):
    good = [pb.EmbedRequest(request_id=str(i), texts=[f"text {i}"], lane=pb.LANE_BATCH).SerializeToString()
            for i in range(3)]
    bad = with_bad_utf8(pb.EmbedRequest(request_id="3", texts=["x", "MARK"], lane=pb.LANE_BATCH))
    call = channel.stream_stream(STREAM, request_serializer=None, response_deserializer=None)
    responses = call(iter([*good, bad, good[0]]), timeout=60)
    answered = []
    with pytest.raises(grpc.RpcError) as info:
        for data in responses:
            answered.append(pb.EmbedResponse.FromString(data))
    assert sorted(r.request_id for r in answered) == ["0", "1", "2"]
    assert all(not r.HasField("error") and r.count == 1 for r in answered)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    assert "message 3" in info.value.details() and "texts[1]: not valid UTF-8" in info.value.details()


def test_no_traceback_in_the_log_and_still_serving(sidecar, channel):
    for data in (b"\xff" * 8, with_bad_utf8(pb.EmbedRequest(texts=["MARK"]))):
        raw_unary(channel, EMBED, data)
    ok = raw_unary(channel, EMBED, pb.EmbedRequest(texts=["still serving"]).SerializeToString())
    assert isinstance(ok, bytes) and pb.EmbedResponse.FromString(ok).count == 1
    assert "Traceback" not in sidecar.log(), sidecar.log()[-3000:]
