"""EmbedStream over gRPC: responses matched by request id, an in-stream error that does not end the stream."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np

from sidecar.client import AsyncFernClient, FernClient
from sidecar.wire import embedder_pb2 as pb


def _requests(n: int) -> list[tuple[str, list[str]]]:
    return [(f"req-{i}", [f"stream text {i}.{j} about topic {i % 7}" for j in range(1 + i % 5)])
            for i in range(n)]


def test_stream_results_match_unary_by_request_id_with_an_error_in_the_middle(client: FernClient):
    requests = _requests(40)
    requests[17] = ("req-17", ["fine", "", "also fine"])
    results = list(client.embed_stream(iter(requests)))
    by_id = {r.request_id: r for r in results}
    assert len(results) == len(requests) and set(by_id) == {rid for rid, _ in requests}
    bad = by_id["req-17"]
    assert bad.embeddings is None and bad.error is not None
    assert bad.error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert bad.error.index == 1 and "texts[1]: empty text" in bad.error.message
    for rid, texts in requests:
        if rid == "req-17":
            continue
        got = by_id[rid].embeddings
        assert got.request_id == rid and got.vectors.shape == (len(texts), 384)
        np.testing.assert_allclose(got.vectors, client.embed(texts).vectors, atol=1e-5)


def test_stream_carries_per_request_options(client: FernClient, sidecar_target):
    reqs = [pb.EmbedRequest(request_id="a", texts=["x y z"], dimensions=32, lane=pb.LANE_BATCH),
            pb.EmbedRequest(request_id="b", texts=["x y z"], encoding=pb.ENCODING_BINARY),
            pb.EmbedRequest(request_id="c", texts=["x y z"], model="nope"),
            pb.EmbedRequest(request_id="d", texts=["x y z"], return_sparse=True)]
    by_id = {r.request_id: r for r in client.embed_stream(reqs)}
    assert by_id["a"].embeddings.vectors.shape == (1, 32)
    assert by_id["b"].embeddings.vectors.shape == (1, 48)
    assert by_id["c"].error.code == grpc.StatusCode.NOT_FOUND and by_id["c"].error.index is None
    assert by_id["d"].embeddings.sparse is not None


def test_async_stream_from_an_async_generator(sidecar_target):
    async def run() -> dict[str, int]:
        async def items():
            for i in range(25):
                yield (str(i), [f"async {i}"] * (i % 3 + 1))

        async with AsyncFernClient(sidecar_target, timeout=120) as c:
            return {r.request_id: len(r.embeddings) async for r in c.embed_stream(items())}

    got = asyncio.run(run())
    assert got == {str(i): i % 3 + 1 for i in range(25)}


def test_empty_stream_ends_cleanly(client: FernClient):
    assert list(client.embed_stream(iter(()))) == []
