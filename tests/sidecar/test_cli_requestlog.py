"""`fern serve --log-level debug --log-format json` logs one JSON line per request; errors at WARNING with their id."""

from __future__ import annotations

import json
import time

import grpc
import pytest

from sidecar.client import FernClient, FernError


@pytest.fixture(scope="module")
def logging_sidecar(sidecar_factory):
    process = sidecar_factory("--log-level", "debug", "--log-format", "json")
    yield process
    process.stop()


def request_lines(process, count: int, timeout: float = 30.0) -> list[dict]:
    """The request lines logged so far, once there are `count` (logging follows the reply)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = []
        for text in process.log().splitlines():
            if text.startswith("{"):
                record = json.loads(text)  # every structured line parses on its own
                if record["logger"] == "fern.requests":
                    lines.append(record)
        if len(lines) >= count or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def test_each_embed_is_one_debug_line_with_its_fields(logging_sidecar):
    with FernClient(logging_sidecar.target) as client:
        client.embed(["hello world", "second text"], lane="batch")
        client.embed(["one more"])
    lines = request_lines(logging_sidecar, 2)
    embeds = [r for r in lines if r["method"] == "Embed"]
    assert len(embeds) == 2, lines
    first, second = embeds
    assert first["level"] == "DEBUG" and first["door"] == "grpc" and first["status"] == "OK"
    assert first["model"] == "all-MiniLM-L6-v2" and first["lane"] == "batch"
    assert first["inputs"] == 2 and first["tokens"] == 8
    assert isinstance(first["ms"], float) and first["ms"] > 0
    assert second["lane"] == "online" and second["inputs"] == 1 and second["tokens"] == 4


def test_an_error_is_a_warning_with_its_request_id(logging_sidecar):
    with grpc.insecure_channel(logging_sidecar.target) as channel:
        from sidecar.wire import embedder_pb2 as pb
        from sidecar.wire import embedder_pb2_grpc as pb_grpc

        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.EmbedderStub(channel).Embed(pb.EmbedRequest(request_id="req-42", texts=["ok", ""]), timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    (warning,) = [r for r in request_lines(logging_sidecar, 3) if r.get("request_id") == "req-42"]
    assert warning["level"] == "WARNING" and warning["status"] == "INVALID_ARGUMENT"
    assert warning["error"] == "texts[1]: empty text" and warning["inputs"] == 2


def test_stream_requests_are_logged_one_a_response(logging_sidecar):
    with FernClient(logging_sidecar.target) as client:
        results = list(client.embed_stream([("s-1", ["streamed"]), ("s-2", [""])]))
    assert {r.request_id for r in results} == {"s-1", "s-2"}
    lines = [r for r in request_lines(logging_sidecar, 5) if r["method"] == "EmbedStream"]
    by_id = {r["request_id"]: r for r in lines}
    tokens = sum(next(r for r in results if r.request_id == "s-1").embeddings.token_counts)
    assert by_id["s-1"]["level"] == "DEBUG" and by_id["s-1"]["lane"] == "batch"
    assert by_id["s-1"]["tokens"] == tokens and by_id["s-1"]["model"] == "all-MiniLM-L6-v2"
    assert by_id["s-2"]["level"] == "WARNING" and by_id["s-2"]["status"] == "INVALID_ARGUMENT"


def test_at_the_default_level_only_errors_are_logged(sidecar_process):
    with FernClient(sidecar_process.target) as client:
        client.embed(["quiet at info"])
        with pytest.raises(FernError):
            client.embed([""])
    deadline = time.monotonic() + 30
    while "status=INVALID_ARGUMENT" not in sidecar_process.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    log = sidecar_process.log()
    assert "WARNING fern.requests: door=grpc method=Embed status=INVALID_ARGUMENT" in log
    assert "status=OK" not in log
