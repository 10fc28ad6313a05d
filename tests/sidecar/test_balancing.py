"""Several sidecars behind one FernClient: round_robin spreads calls, retries ride out a killed or draining one."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from sidecar.balancing import channel_target, service_config
from sidecar.client import FernClient


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_comma_list_becomes_one_address_list():
    assert channel_target("127.0.0.1:1,127.0.0.1:2") == "ipv4:127.0.0.1:1,127.0.0.1:2"
    assert channel_target("localhost:7, 127.0.0.1:8").startswith("ip")
    assert channel_target("[::1]:5,[::1]:6") == "ipv6:[::1]:5,[::1]:6"
    assert channel_target("dns:///fern.svc:50051") == "dns:///fern.svc:50051"
    assert channel_target("unix:/tmp/fern.sock") == "unix:/tmp/fern.sock"


@pytest.mark.parametrize("target, named", [("127.0.0.1:1,nowhere", "'nowhere' is not host:port"),
                                           ("127.0.0.1:1,[::1]:2", "mixes IPv4 and IPv6"),
                                           ("127.0.0.1:1,no-such-host.invalid:3", "cannot resolve")])
def test_a_bad_list_names_the_entry(target, named):
    with pytest.raises(ValueError, match=named):
        channel_target(target)


def test_the_service_config_retries_only_the_pure_unary_methods():
    config = json.loads(service_config())
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    (method,) = config["methodConfig"]
    assert {m["method"] for m in method["name"]} == {"Embed", "ListModels"}
    assert set(method["retryPolicy"]["retryableStatusCodes"]) == {"UNAVAILABLE", "RESOURCE_EXHAUSTED", "CANCELLED"}
    assert 1 < method["retryPolicy"]["maxAttempts"] <= 5


class _StubEmbedder:
    """A real gRPC server whose Embed either answers one zero vector or, as a sidecar whose
    gRPC shutdown has begun does to a call arriving on an open connection, cancels the call."""

    def __init__(self, cancel: bool) -> None:
        from concurrent import futures

        import grpc

        from sidecar.wire import embedder_pb2 as pb
        from sidecar.wire import embedder_pb2_grpc as pb_grpc

        stub = self

        class Servicer(pb_grpc.EmbedderServicer):
            def Embed(self, request, context):
                stub.calls += 1
                if cancel:
                    context.abort(grpc.StatusCode.CANCELLED, "CANCELLED")
                return pb.EmbedResponse(model="stub", count=1, dimensions=4, vectors=bytes(16),
                                        token_counts=[len(request.texts[0])])

        self.calls = 0
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_EmbedderServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()


def test_a_call_a_stopping_sidecar_cancels_is_retried_on_another():
    # gRPC's own shutdown cancels a call that reaches a sidecar in the instant between its drain
    # and its connections closing; an Embed is pure, so the balanced client runs it elsewhere.
    cancelling, answering = _StubEmbedder(cancel=True), _StubEmbedder(cancel=False)
    try:
        with FernClient(f"127.0.0.1:{cancelling.port},127.0.0.1:{answering.port}", timeout=30) as client:
            for i in range(20):
                assert client.embed([f"text {i}"]).vectors.shape == (1, 4)
        assert cancelling.calls >= 1  # round_robin did send calls to the stopping one
        assert answering.calls == 20
    finally:
        cancelling.server.stop(0)
        answering.server.stop(0)


def _served_calls(process) -> int:
    """Embed calls a sidecar answered OK, from its JSON request log (one line per call at debug)."""
    count = 0
    for line in process.log().splitlines():
        if line.startswith("{") and '"method": "Embed"' in line and '"status": "OK"' in line:
            count += 1
    return count


class Load:
    """Threads sending batch-1 Embed calls through one client until stopped; every error is kept."""

    def __init__(self, client: FernClient, threads: int = 4) -> None:
        self.client, self.done, self.errors = client, 0, []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(threads)]

    def _run(self, k: int) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            try:
                self.client.embed([f"load {k} {i}"], timeout=60)
                with self._lock:
                    self.done += 1
            except Exception as exc:  # noqa: BLE001 - every failure is the test's finding
                with self._lock:
                    self.errors.append(repr(exc))

    def __enter__(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def wait_for(self, calls: int, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        start = self.done
        while self.done - start < calls:
            assert time.monotonic() < deadline, f"only {self.done - start} of {calls} calls in {timeout:g}s"
            time.sleep(0.05)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)


@pytest.fixture(scope="module")
def three(sidecar_process_class):
    ports = [_free_port() for _ in range(3)]
    processes = [sidecar_process_class(["--port", str(p), "--log-level", "debug", "--log-format", "json"])
                 for p in ports]
    try:
        for process in processes:
            process.start()
        yield ports, processes
    finally:
        for process in processes:
            process.stop()


def test_three_sidecars_share_the_load_and_survive_a_kill_and_a_drain(three, sidecar_process_class):
    ports, processes = three
    target = ",".join(f"127.0.0.1:{p}" for p in ports)
    with FernClient(target, timeout=60) as client:
        client.wait_ready(timeout=30)
        before = [_served_calls(p) for p in processes]
        for i in range(3000):
            client.embed([f"spread {i}"])
        counts = [_served_calls(p) - b for p, b in zip(processes, before)]
        assert sum(counts) == 3000
        assert max(counts) <= 1.2 * min(counts), counts

        with Load(client) as load:
            load.wait_for(100)
            processes[0].kill()  # SIGKILL mid-load: its in-flight calls fail over to the others
            load.wait_for(200)
            processes[1].terminate()  # SIGTERM mid-load: it drains, its clients go elsewhere
            load.wait_for(200)
            restarted = sidecar_process_class(["--port", str(ports[0]), "--log-level", "debug",
                                               "--log-format", "json"])
            processes[0] = restarted
            restarted.start()
            deadline = time.monotonic() + 120
            while _served_calls(restarted) < 20:
                assert time.monotonic() < deadline, "the restarted sidecar took no load"
                time.sleep(0.1)
        assert load.errors == []
        assert load.done > 500
