"""A sidecar with a token and tiny queues: auth, RESOURCE_EXHAUSTED, stream flow control, SIGTERM drain.

The drain is also pinned in process, where the test holds a call in flight for as long as it needs.
"""

from __future__ import annotations

import asyncio
import math
import re
import socket
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import grpc.aio
import pytest

from sidecar.client import FernClient, FernError
from sidecar.errors import unavailable
from sidecar.gateway import DRAINING
from sidecar.registry import ModelSource, Registry
from sidecar.server import EmbedderService, Sidecar
from sidecar.wire import embedder_pb2 as pb
from sidecar.wire import embedder_pb2_grpc as pb_grpc

TOKEN = "s3cret-token"
# ONLINE holds 4 full-length inputs, BATCH 3; a CPU step takes 256 tokens.
SMALL = ("--token", TOKEN, "--max-queued-tokens-online", "1024", "--max-queued-tokens-batch", "768",
         "--max-step-tokens", "256", "--online-step-tokens", "256", "--grace", "60")
LONG = "word " * 300  # truncated to 256 tokens
# Full-length inputs kept in flight while the drain test acts: at least this many, and at
# least IN_FLIGHT_SECONDS of steps at the speed the test measures on the machine it runs on.
IN_FLIGHT = 48
IN_FLIGHT_SECONDS = 6.0
DEADLINE_S = 1.0  # long enough to be queued however loaded the machine; short next to the work ahead


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
    # Each refused call, unary or stream, is a WARNING of the request log (at the default level).
    deadline = time.monotonic() + 30
    lines = [f"WARNING fern.requests: door=grpc method={method} status=UNAUTHENTICATED"
             for method in ("Embed", "EmbedStream", "ListModels")]
    while not all(line in small_sidecar.log() for line in lines) and time.monotonic() < deadline:
        time.sleep(0.05)
    for line in lines:
        assert line in small_sidecar.log(), (line, small_sidecar.log()[-3000:])


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


class Metrics:
    """The sidecar's /metrics, read as {(family, lane): value} for the bundled model."""

    def __init__(self, process) -> None:
        found = re.search(r"fern: metrics on (\S+)", process.log())
        assert found, process.log()[-2000:]
        self.url = found.group(1)

    def read(self) -> dict[tuple[str, str], int]:
        with urllib.request.urlopen(self.url, timeout=30) as response:
            text = response.read().decode()
        values = {}
        for line in text.splitlines():
            if m := re.match(r'(fern_\w+)\{[^}]*lane="(\w+)"[^}]*\} (\d+)(?:\.0)?$', line):
                values[(m.group(1), m.group(2))] = int(m.group(3))
        return values

    def batch(self, family: str) -> int:
        return self.read()[(f"fern_{family}", "batch")]

    def wait_until(self, what: str, done, timeout: float = 60.0) -> dict:
        """Poll until `done(values)`: the test moves on when the server reports a state, not after a guess."""
        deadline = time.monotonic() + timeout
        while True:
            values = self.read()
            if done(values):
                return values
            assert time.monotonic() < deadline, f"the sidecar never reported {what}: {values}"
            time.sleep(0.02)


def dropped(values: dict) -> int:
    return values[("fern_requests_cancelled_total", "batch")] + values[("fern_requests_expired_total", "batch")]


def test_deadlines_and_cancels_drop_queued_work_then_sigterm_drains(sidecar_factory):
    process = sidecar_factory("--max-step-tokens", "256", "--online-step-tokens", "256", "--metrics-port", "0",
                              "--grace", "300")
    metrics = Metrics(process)
    with FernClient(process.target, timeout=300) as c:
        c.embed([LONG] * 2, lane="batch")  # the first steps pay one-off costs
        started = time.perf_counter()
        c.embed([LONG] * 8, lane="batch")
        seconds_per_input = (time.perf_counter() - started) / 8
    # The work kept in flight is sized from this machine's own speed, so that it cannot finish
    # while the test queues and drops two requests behind it, however fast the machine (a
    # loaded machine only makes it last longer); the BATCH bound holds 256 such inputs.
    in_flight = min(240, max(IN_FLIGHT, math.ceil(IN_FLIGHT_SECONDS / seconds_per_input)))
    done_before = metrics.batch("requests_completed_total")
    admitted_before = metrics.batch("requests_admitted_total")
    outcome: dict = {}

    def in_flight_call() -> None:
        with FernClient(process.target, timeout=300) as c:
            try:
                outcome["result"] = c.embed([LONG] * in_flight, lane="batch")
            except FernError as error:
                outcome["error"] = error

    worker = threading.Thread(target=in_flight_call)
    worker.start()
    metrics.wait_until("the in-flight request admitted",
                       lambda v: v[("fern_requests_admitted_total", "batch")] == admitted_before + 1)
    with grpc.insecure_channel(process.target) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        # Queued behind the in-flight work (BATCH is first come, first served): dropped at its deadline.
        late = stub.Embed.future(pb.EmbedRequest(texts=[LONG], lane=pb.LANE_BATCH), timeout=DEADLINE_S)
        metrics.wait_until("the deadline request queued",
                           lambda v: v[("fern_requests_admitted_total", "batch")] == admitted_before + 2)
        with pytest.raises(grpc.RpcError) as info:
            late.result(timeout=60)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        metrics.wait_until("the deadline request dropped", lambda v: dropped(v) == 1)
        # Cancelled by its client while queued: dropped too.
        call = stub.Embed.future(pb.EmbedRequest(texts=[LONG], lane=pb.LANE_BATCH), timeout=60)
        metrics.wait_until("the cancelled request queued",
                           lambda v: v[("fern_requests_admitted_total", "batch")] == admitted_before + 3)
        assert call.cancel()
        values = metrics.wait_until("the cancelled request dropped", lambda v: dropped(v) == 2)
    # Both were dropped while the in-flight request still had steps ahead of them (so neither was
    # served first); were it already done, the in-flight work would need to be bigger.
    assert values[("fern_requests_completed_total", "batch")] == done_before, \
        f"the in-flight request ({in_flight} inputs) finished before the drops: {values}"
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
    assert outcome["result"].vectors.shape == (in_flight, 384)
    assert process.process.wait(60) == 0
    log = process.log()
    assert "draining" in log and "fern: stopped" in log
    # The scheduler's own account, logged when it drained: the BATCH lane dropped both, and
    # the engine saw only the tokens of the requests served (10 + in_flight inputs of 256).
    counts = re.search(r"scheduler drained: \d+ steps, (\d+) tokens; .*cancelled (\d+)/(\d+), expired (\d+)/(\d+)", log)
    assert counts, log[-2000:]
    tokens, online_cancelled, batch_cancelled, online_expired, batch_expired = map(int, counts.groups())
    assert (online_cancelled, online_expired) == (0, 0), counts.group(0)
    # The client's deadline fires a transit time before the server's own, so the server may see
    # its cancel first: either way the request is dropped (test_scheduler.py pins which it counts as).
    assert batch_cancelled + batch_expired == 2 and batch_cancelled >= 1, counts.group(0)
    assert tokens == (10 + in_flight) * 256, counts.group(0)


@pytest.fixture
def registry():
    """A fresh registry per test: stopping a Sidecar drains its schedulers for good."""
    return Registry.load([ModelSource(None)], device="cpu", tokenizer_workers=1)


def test_a_new_call_during_the_drain_is_refused_with_unavailable_not_cancelled(registry):
    """While stop() waits for a call in flight, a new call reaches the sidecar's handler and is told
    UNAVAILABLE, naming the drain (clients retry it elsewhere), on an open connection and on a new one.

    gRPC's own shutdown cancels a call that arrives on an open connection (CANCELLED, not retried)
    and refuses new connections, so it must not begin before the calls in flight are done.
    """
    async def main():
        sidecar = Sidecar(registry, port=0)
        await sidecar.start()
        entered, release = asyncio.Event(), asyncio.Event()
        embed = sidecar.gateway.embed

        async def held_embed(params):
            if list(params.texts) != ["held"]:
                return await embed(params)
            prepared = await sidecar.gateway.prepare(params)  # accepted before the drain began
            entered.set()
            await release.wait()
            return await sidecar.gateway.execute(prepared)

        sidecar.gateway.embed = held_embed
        refusals = []
        async with grpc.aio.insecure_channel(sidecar.target) as open_channel, \
                grpc.aio.insecure_channel(sidecar.target) as new_channel:
            stub = pb_grpc.EmbedderStub(open_channel)
            await stub.ListModels(pb.ListModelsRequest(), timeout=30)  # the connection is open
            held = asyncio.ensure_future(stub.Embed(pb.EmbedRequest(texts=["held"]), timeout=60))
            await asyncio.wait_for(entered.wait(), 30)
            stopping = asyncio.create_task(sidecar.stop(grace=60))
            try:
                while not sidecar.gateway.draining:
                    await asyncio.sleep(0.01)
                for channel in (open_channel, new_channel):
                    try:
                        await pb_grpc.EmbedderStub(channel).Embed(pb.EmbedRequest(texts=["new call"]), timeout=30)
                        refusals.append(None)
                    except grpc.aio.AioRpcError as error:
                        refusals.append((error.code(), error.details()))
            finally:
                release.set()
            response = await asyncio.wait_for(held, 60)
            await asyncio.wait_for(stopping, 60)
        return refusals, response

    refusals, response = asyncio.run(main())
    for refusal in refusals:
        assert refusal is not None and refusal[0] == grpc.StatusCode.UNAVAILABLE, refusals
        assert "draining for shutdown" in refusal[1], refusals
    assert (response.count, response.dimensions) == (1, 384)  # the call in flight was answered


class _DrainingGateway:
    """Refuses work as a draining Gateway does."""

    draining = False

    async def embed(self, params):
        raise unavailable(DRAINING)

    async def rerank(self, params):
        raise unavailable(DRAINING)


class _RefusedContext:
    """Just enough of a grpc.aio.ServicerContext to see whether a refused call counted as in flight."""

    def __init__(self, service: EmbedderService) -> None:
        self.service = service
        self.aborted = None

    def time_remaining(self) -> None:
        return None

    def cancelled(self) -> bool:
        return False

    async def abort(self, code, details, trailing_metadata=()):
        self.aborted = (code, details, await self.service.wait_idle(0))
        raise grpc.aio.AbortError()  # what a real context.abort raises


@pytest.mark.parametrize("method", ["Embed", "EmbedStream", "Rerank"])
def test_a_call_refused_during_the_drain_does_not_count_as_in_flight(method):
    """Otherwise clients retrying against a draining replica could hold its drain open until the grace ran out."""
    async def main():
        service = EmbedderService(gateway=_DrainingGateway())
        service.begin_drain()
        context = _RefusedContext(service)

        async def requests():
            yield pb.EmbedRequest(texts=["x"])

        request = {"Embed": pb.EmbedRequest(texts=["x"]), "EmbedStream": requests(),
                   "Rerank": pb.RerankRequest(query="q", documents=["d"])}[method]
        with pytest.raises(grpc.aio.AbortError):
            await getattr(service, method)(request, context)
        return context.aborted

    code, details, idle = asyncio.run(main())
    assert code == grpc.StatusCode.UNAVAILABLE and "draining for shutdown" in details
    assert idle, "the refused call was counted as a call in flight"


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
