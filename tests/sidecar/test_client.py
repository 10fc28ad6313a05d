"""FernClient and AsyncFernClient against a real sidecar over loopback gRPC."""

import asyncio
import socket
import time

import grpc
import numpy as np
import pytest

from sidecar.client import AsyncFernClient, FernClient, FernError


def test_sync_and_async_clients_return_the_same_vectors(client, sidecar_target):
    texts = ["the cat sat on the mat", "Fern embeds text next to the database"]
    sync = client.embed(texts)

    async def go():
        async with AsyncFernClient(sidecar_target) as aclient:
            return await aclient.embed(texts)

    got = asyncio.run(go())
    assert sync.vectors.shape == (2, 384) and sync.vectors.dtype == np.float32
    np.testing.assert_allclose(got.vectors, sync.vectors, atol=1e-6)
    assert got.token_counts.tolist() == sync.token_counts.tolist()


def test_stream_results_match_unary_and_errors_stay_per_request(client):
    batches = [("a", ["first batch", "of two"]), ("bad", ["fine", ""]), ("c", ["last one"])]
    results = {r.request_id: r for r in client.embed_stream(batches)}
    assert set(results) == {"a", "bad", "c"}
    assert results["bad"].embeddings is None
    assert results["bad"].error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert results["bad"].error.index == 1
    for rid, texts in (batches[0], batches[2]):
        expected = client.embed(texts, lane="batch").vectors
        np.testing.assert_allclose(results[rid].embeddings.vectors, expected, atol=1e-5)


def test_async_stream_accepts_an_async_iterable(sidecar_target):
    async def items():
        for i in range(5):
            yield (f"r{i}", [f"text number {i}"] * (i + 1))

    async def go():
        async with AsyncFernClient(sidecar_target) as aclient:
            return [r async for r in aclient.embed_stream(items())]

    results = asyncio.run(go())
    assert sorted(r.request_id for r in results) == [f"r{i}" for i in range(5)]
    assert all(len(r.embeddings) == int(r.request_id[1:]) + 1 for r in results)


def test_errors_carry_status_and_input_index(client):
    with pytest.raises(FernError) as err:
        client.embed(["ok", "also ok", ""])
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.index == 2
    assert "texts[2]" in err.value.message


def test_default_model_comes_first_and_model_lookup(client):
    models = client.list_models()
    assert models[0].dimensions == 384 and models[0].max_tokens == 256
    assert client.model().name == models[0].name
    with pytest.raises(FernError) as err:
        client.model("no-such-model")
    assert err.value.code is grpc.StatusCode.NOT_FOUND


def test_wait_ready_on_a_dead_port_says_unavailable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with FernClient(f"127.0.0.1:{port}") as dead:
        assert dead.health(timeout=0.5) is False
        with pytest.raises(FernError) as err:
            dead.wait_ready(timeout=0.5)
    assert err.value.code is grpc.StatusCode.UNAVAILABLE
    assert str(port) in err.value.message


def test_a_client_sees_a_sidecar_that_comes_up_late_within_about_a_second():
    """A refused connection is retried at most ~1 s apart, not on gRPC's growing backoff: after
    6 s of a dead port, gRPC's defaults saw the server 4 s after it came up (measured)."""
    from concurrent import futures

    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with FernClient(f"127.0.0.1:{port}") as client:
        down_since = time.monotonic()
        while time.monotonic() - down_since < 6:
            assert client.health(timeout=0.2) is False
            time.sleep(0.05)
        server = grpc.server(futures.ThreadPoolExecutor(2))
        servicer = health.HealthServicer()
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        try:
            up = time.monotonic()
            while not client.health(timeout=0.2):
                assert time.monotonic() - up < 2.0, "the client did not reconnect within 2 s"
                time.sleep(0.02)
        finally:
            server.stop(0)


@pytest.mark.parametrize("dimensions, fragment", [
    (-1, "dimensions: -1 is out of range"), (2**33, "dimensions: 8589934592 is out of range"),
    (2**32, "out of range"), (1.5, "dimensions: expected an integer"), (True, "expected an integer"),
    (2**32 - 1, "dimensions: 4294967295 is outside 1..384"),  # carried by the wire, refused by the sidecar
    (385, "dimensions: 385 is outside 1..384"),
])
def test_dimensions_out_of_range_is_invalid_argument_naming_dimensions(client, sidecar_target,
                                                                        dimensions, fragment):
    with pytest.raises(FernError) as info:
        client.embed(["a"], dimensions=dimensions)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and fragment in info.value.message

    async def go():
        async with AsyncFernClient(sidecar_target) as aclient:
            await aclient.embed(["a"], dimensions=dimensions)

    with pytest.raises(FernError, match=fragment):
        asyncio.run(go())


@pytest.mark.parametrize("kwargs, fragment, index", [
    ({"texts": ["a", 3]}, "texts[1]: expected str, got int", 1),
    ({"texts": ["a", "b", "\ud800"]}, "texts[2]: a lone surrogate", 2),
    ({"token_ids": [[101, 102], [101, -1, 102]]}, "token_ids[1]: position 1: token id: -1 is out of range", 1),
    ({"token_ids": [[2**33]]}, "token_ids[0]: position 0: token id: 8589934592 is out of range", 0),
])
def test_inputs_the_wire_cannot_carry_are_named(client, kwargs, fragment, index):
    call = client.embed_tokens if "token_ids" in kwargs else client.embed
    with pytest.raises(FernError) as info:
        call(*kwargs.values())
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and info.value.index == index
    assert fragment in info.value.message
