"""A sidecar with a token and tiny queues: auth, RESOURCE_EXHAUSTED, stream flow control, SIGTERM drain."""

from __future__ import annotations

import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from sidecar.client import FernClient, FernError
from sidecar.wire import embedder_pb2 as pb
from sidecar.wire import embedder_pb2_grpc as pb_grpc

TOKEN = "s3cret-token"
# ONLINE holds 4 full-length inputs, BATCH 3; a CPU step takes 256 tokens.
SMALL = ("--token", TOKEN, "--max-queued-tokens-online", "1024", "--max-queued-tokens-batch", "768",
         "--max-step-tokens", "256", "--online-step-tokens", "256", "--grace", "60")
LONG = "word " * 300  # truncated to 256 tokens
# Full-length inputs kept in flight while the drain test acts: ~12k tokens, seconds of CPU
# work even on an idle machine (the scheduler measured ~4k tokens/s on two cores).
IN_FLIGHT = 48


@pytest.fixture(scope="module")
def small_sidecar(sidecar_factory):
    process = sidecar_factory(*SMALL)
    yield process
    process.stop()


def test_token_is_required_except_for_health(small_sidecar):
    with FernClient(small_sidecar.target, token="") as anonymous:
        assert anonymous.health()  # probes need no secret
        with pytest.raises(FernError) as info:
            anonymous.embed(["x"])
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert "authorization: Bearer" in info.value.message
        with pytest.raises(FernError) as info:
            list(anonymous.embed_stream([("a", ["x"])]))
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    with FernClient(small_sidecar.target, token="wrong") as wrong:
        with pytest.raises(FernError) as info:
            wrong.list_models()
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    with FernClient(small_sidecar.target, token=TOKEN) as good:
        assert good.embed(["with the token"]).vectors.shape == (1, 384)


def test_full_online_queue_is_resource_exhausted_and_the_server_recovers(small_sidecar):
    def call(_: int):
        with FernClient(small_sidecar.target, token=TOKEN, timeout=300) as c:
            try:
                return c.embed([LONG] * 4)  # the whole ONLINE bound
            except FernError as error:
                return error

    with ThreadPoolExecutor(6) as pool:
        outcomes = list(pool.map(call, range(6)))
    errors = [o for o in outcomes if isinstance(o, FernError)]
    assert len(errors) >= 1 and len(errors) < len(outcomes)
    for error in errors:
        assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "ONLINE" in error.message and "queue is full" in error.message
    with FernClient(small_sidecar.target, token=TOKEN, timeout=300) as c:
        assert c.embed([LONG] * 4).vectors.shape == (4, 384)


def test_stream_waits_for_room_instead_of_failing(small_sidecar):
    # 16 requests of ~2 x 60 tokens through a 768-token BATCH queue: unary calls this
    # fast would be refused; the stream is flow-controlled and every request succeeds.
    requests = [(str(i), [f"stream {i} " + "token " * 55] * 2) for i in range(16)]
    with FernClient(small_sidecar.target, token=TOKEN, timeout=300) as c:
        results = list(c.embed_stream(requests))
    assert sorted(int(r.request_id) for r in results) == list(range(16))
    assert all(r.error is None and r.embeddings.vectors.shape == (2, 384) for r in results)


def test_deadlines_and_cancels_drop_queued_work_then_sigterm_drains(sidecar_factory):
    process = sidecar_factory("--max-step-tokens", "256", "--online-step-tokens", "256")
    outcome: dict = {}

    def in_flight() -> None:
        with FernClient(process.target, timeout=300) as c:
            try:
                outcome["result"] = c.embed([LONG] * IN_FLIGHT, lane="batch")
            except FernError as error:
                outcome["error"] = error

    worker = threading.Thread(target=in_flight)
    worker.start()
    time.sleep(1.0)  # the request is on the server, with seconds of steps still ahead
    with FernClient(process.target) as c:
        # Queued behind the in-flight work (BATCH is FCFS): dropped at its deadline.
        with pytest.raises(FernError) as info:
            c.embed([LONG], lane="batch", timeout=0.3)
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    with grpc.insecure_channel(process.target) as channel:
        # Cancelled by its client while queued: dropped too.
        call = pb_grpc.EmbedderStub(channel).Embed.future(
            pb.EmbedRequest(texts=[LONG], lane=pb.LANE_BATCH), timeout=60)
        time.sleep(0.3)
        assert call.cancel()
    process.process.send_signal(15)
    refused = None
    deadline = time.monotonic() + 20
    with grpc.insecure_channel(process.target) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        while refused is None and time.monotonic() < deadline:
            try:
                stub.Embed(pb.EmbedRequest(texts=["new call"]), timeout=10)
            except grpc.RpcError as error:
                refused = error
            time.sleep(0.05)
    assert refused is not None and refused.code() == grpc.StatusCode.UNAVAILABLE
    worker.join(300)
    assert "error" not in outcome, outcome.get("error")
    assert outcome["result"].vectors.shape == (IN_FLIGHT, 384)
    assert process.process.wait(60) == 0
    log = process.log()
    assert "draining" in log and "fern: stopped" in log
    # The scheduler's own account, logged when it drained: the BATCH lane dropped both.
    counts = re.search(r"cancelled (\d+)/(\d+), expired (\d+)/(\d+)", log)
    assert counts, log[-2000:]
    assert int(counts.group(2)) == 1 and int(counts.group(4)) == 1, counts.group(0)


def test_an_ipv6_host_is_bound_and_served(sidecar_factory):
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    process = sidecar_factory("--host", "::1")
    try:
        assert process.target.startswith("[::1]:")
        with FernClient(process.target) as client:
            assert client.embed(["over IPv6"]).vectors.shape == (1, 384)
    finally:
        process.stop()
