"""`fern serve --metrics-port`: /metrics scraped over loopback before and after real embeds."""

from __future__ import annotations

import http.client
import math
import os
import re
import socket
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from core_engine.graphs import GraphCounters
from prometheus_client.parser import text_string_to_metric_families

from sidecar.cli import build_parser
from sidecar.client import FernClient, FernError
from sidecar.metrics import render
from sidecar.scheduler import Scheduler

ONLINE_TEXTS = ["What is the capital of France?", "vector search", "a"]
BATCH_TEXTS = ["Embedding models map text to dense vectors. " * 6, "hello world", "ok", "東京"]


def free_port() -> int:
    """A loopback TCP port nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_exposition(text: str) -> dict[tuple[str, frozenset], float]:
    """Samples of a text exposition by (name, labels), read with Prometheus's own parser."""
    samples: dict[tuple[str, frozenset], float] = {}
    for family in text_string_to_metric_families(text):
        assert family.type in ("counter", "gauge", "histogram"), family
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue  # prometheus_client's creation time of a labelled child
            key = (sample.name, frozenset(sample.labels.items()))
            assert key not in samples, f"sample repeated: {sample}"
            assert math.isfinite(sample.value) and sample.value >= 0, sample
            samples[key] = sample.value
    return samples


def scrape(port: int, path: str = "/metrics", method: str = "GET") -> tuple[int, str, str]:
    """(status, Content-Type, body) of one HTTP request to the metrics port."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request(method, path)
        response = connection.getresponse()
        return response.status, response.getheader("Content-Type", ""), response.read().decode()
    finally:
        connection.close()


def metrics(port: int) -> dict[tuple[str, frozenset], float]:
    status, content_type, body = scrape(port)
    assert status == 200, body
    assert content_type.startswith("text/plain; version=") and "charset=utf-8" in content_type
    return parse_exposition(body)


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def listening_ports(pid: int) -> set[int]:
    """TCP ports process `pid` listens on (Linux /proc: its socket inodes in the LISTEN state)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except FileNotFoundError:  # closed while we looked
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for row in path.read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


@pytest.fixture(scope="module")
def metrics_sidecar(sidecar_factory):
    port = free_port()
    process = sidecar_factory("--metrics-port", str(port))
    process.metrics_port = port
    yield process
    process.stop()


def test_the_exposition_parses_and_names_the_served_model(metrics_sidecar):
    samples = metrics(metrics_sidecar.metrics_port)
    assert f"fern: metrics on http://127.0.0.1:{metrics_sidecar.metrics_port}/metrics" in metrics_sidecar.log()
    with FernClient(metrics_sidecar.target) as client:
        (model,) = [m.name for m in client.list_models()]
    assert {dict(labels)["model"] for _, labels in samples} == {model}
    for lane in ("online", "batch"):
        assert value(samples, "fern_queue_tokens", model=model, lane=lane) == 0
        assert value(samples, "fern_queue_max_tokens", model=model, lane=lane) > 0
        assert value(samples, "fern_queue_saturation", model=model, lane=lane) == 0
        assert value(samples, "fern_requests_rejected_total", model=model, lane=lane) == 0
    engine = dict(model=model, engine="0", device="cpu")
    for name in ("fern_engine_steps_total", "fern_engine_tokens_total", "fern_engine_loop_launched_steps_total",
                 "fern_graph_eager_runs_total",
                 "fern_graph_captures_total", "fern_graph_replays_total",
                 "fern_graph_evictions_total", "fern_graph_uncacheable_total"):
        assert (name, frozenset(engine.items())) in samples
    assert value(samples, "fern_engine_compiled", **engine) == 0  # the CPU compiles nothing by default
    assert value(samples, "fern_scheduler_draining", model=model) == 0
    # The 2-core test machine runs no tokenizer worker processes by default.
    assert value(samples, "fern_tokenizer_processes", model=model) == 0
    for name in ("slices", "failures", "restarts"):
        assert value(samples, f"fern_tokenizer_process_{name}_total", model=model) == 0


def test_embedding_moves_the_counters_by_what_was_embedded(metrics_sidecar):
    port = metrics_sidecar.metrics_port
    before = metrics(port)
    with FernClient(metrics_sidecar.target, timeout=120) as client:
        online = [client.embed([text]) for text in ONLINE_TEXTS]
        batch = client.embed(BATCH_TEXTS, lane="batch")
    after = metrics(port)
    model = batch.model

    def delta(name: str, **labels: str) -> float:
        return value(after, name, model=model, **labels) - value(before, name, model=model, **labels)

    online_tokens = sum(int(e.token_counts.sum()) for e in online)
    batch_tokens = int(batch.token_counts.sum())
    assert delta("fern_requests_completed_total", lane="online") == len(ONLINE_TEXTS)
    assert delta("fern_requests_admitted_total", lane="online") == len(ONLINE_TEXTS)
    assert delta("fern_requests_completed_total", lane="batch") == 1
    assert delta("fern_embedded_tokens_total", lane="online") == online_tokens
    assert delta("fern_embedded_tokens_total", lane="batch") == batch_tokens
    engine = dict(engine="0", device="cpu")
    steps = delta("fern_engine_steps_total", **engine)
    # Each online call is a step of its own (the calls were sequential); the batch call needs at
    # least one more, and no step is empty.
    assert len(ONLINE_TEXTS) + 1 <= steps <= len(ONLINE_TEXTS) + len(BATCH_TEXTS)
    assert delta("fern_engine_tokens_total", **engine) == online_tokens + batch_tokens
    assert delta("fern_engine_sequences_total", **engine) == len(ONLINE_TEXTS) + len(BATCH_TEXTS)
    # Every step ran one way: eagerly, by capture, by replay, or as too large for the graphs.
    ran = sum(delta(f"fern_graph_{how}_total", **engine)
              for how in ("eager_runs", "captures", "replays", "uncacheable"))
    assert ran == steps
    for lane in ("online", "batch"):
        assert value(after, "fern_queue_tokens", model=model, lane=lane) == 0
    assert value(after, "fern_queue_high_water_tokens", model=model, lane="batch") >= batch_tokens
    assert value(after, "fern_engine_inflight_tokens", model=model, **engine) == 0
    assert delta("fern_engine_loop_launched_steps_total", **engine) == 0  # a CPU engine computes in step()


def test_other_paths_are_not_found_and_only_get_is_allowed(metrics_sidecar):
    port = metrics_sidecar.metrics_port
    status, _, body = scrape(port, "/")
    assert status == 404 and "/metrics" in body
    assert scrape(port, "/metricsx")[0] == 404
    assert scrape(port, "/metrics?name[]=fern_queue_tokens")[0] == 200
    status, content_type, body = scrape(port, method="HEAD")
    assert (status, body) == (200, "") and content_type.startswith("text/plain; version=")
    assert scrape(port, method="POST")[0] == 405
    with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
        raw.sendall(b"not http\r\n\r\n")
        assert raw.recv(64).startswith(b"HTTP/1.1 400 ")


def test_without_the_flag_nothing_more_listens(metrics_sidecar, sidecar_process):
    grpc_port = int(metrics_sidecar.target.rsplit(":", 1)[1])
    # The check itself sees the metrics port where there is one...
    assert listening_ports(metrics_sidecar.process.pid) == {grpc_port, metrics_sidecar.metrics_port}
    # ...and a sidecar started without the flag listens on its gRPC port alone.
    assert listening_ports(sidecar_process.process.pid) == {int(sidecar_process.target.rsplit(":", 1)[1])}
    assert "fern: metrics on" not in sidecar_process.log()


def test_the_environment_twin_sets_the_port(monkeypatch):
    assert build_parser().parse_args(["serve"]).metrics_port is None
    monkeypatch.setenv("FERN_METRICS_PORT", "9464")
    assert build_parser().parse_args(["serve"]).metrics_port == 9464
    assert build_parser().parse_args(["serve", "--metrics-port", "9000"]).metrics_port == 9000


def test_model_names_are_escaped_in_labels():
    engine = SimpleNamespace(spec=SimpleNamespace(dimensions=4), device="cpu",
                             counters=GraphCounters(eager_runs=3, replays=2))
    name = 'odd "name"\\ with\na newline'
    tokenizer = SimpleNamespace(live_processes=4, process_slices=7, process_failures=1, process_restarts=1)
    served = SimpleNamespace(spec=SimpleNamespace(name=name), scheduler=Scheduler([engine]),
                             engines=[engine], tokenizer=tokenizer)
    samples = parse_exposition(render([served]))
    labels = dict(model=name, engine="0", device="cpu")
    assert value(samples, "fern_graph_eager_runs_total", **labels) == 3
    assert value(samples, "fern_graph_replays_total", **labels) == 2
    assert value(samples, "fern_queue_tokens", model=name, lane="batch") == 0
    assert value(samples, "fern_tokenizer_processes", model=name) == 4
    assert value(samples, "fern_tokenizer_process_slices_total", model=name) == 7


def test_the_metrics_port_closes_when_the_sidecar_drains(metrics_sidecar):
    assert metrics_sidecar.terminate() == 0
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", metrics_sidecar.metrics_port), timeout=5).close()


def _parent_pid(proc_dir) -> int | None:
    try:  # /proc/PID/stat: "pid (comm) state ppid ..."; comm may hold spaces
        return int((proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def test_tokenizer_worker_processes_serve_bulk_requests_and_show_in_the_metrics(sidecar_factory, client):
    # A sidecar started with --tokenizer-processes gives the threads-only sidecar's vectors for a
    # request big enough to go to its worker processes, names a bad input in one as well, and
    # counts the slices its workers tokenized.
    from sidecar.tokenize import PROCESS_CHARS

    texts = [f"passage {i}: words about words, and other words ({i % 7} of 7)" * 4 for i in range(300)]
    assert sum(map(len, texts)) > 2 * PROCESS_CHARS
    port = free_port()
    process = sidecar_factory("--tokenizer-processes", "1", "--metrics-port", str(port))
    try:
        model = client.list_models()[0].name
        assert value(metrics(port), "fern_tokenizer_processes", model=model) == 1
        pid = process.process.pid
        children = [d for d in Path("/proc").iterdir() if d.name.isdigit() and _parent_pid(d) == pid]
        assert len(children) >= 2  # the worker and multiprocessing's resource tracker
        with FernClient(process.target, timeout=120) as procs_client:
            got = procs_client.embed(texts)
            bad = list(texts)
            bad[257] = "word " * 300
            with pytest.raises(FernError) as info:
                procs_client.embed(bad, truncate=False)
        assert info.value.index == 257 and "texts[257]: 302 tokens" in info.value.message
        assert value(metrics(port), "fern_tokenizer_process_slices_total", model=model) >= 2
        assert value(metrics(port), "fern_tokenizer_process_failures_total", model=model) == 0
        want = client.embed(texts)
        assert got.token_counts.tolist() == want.token_counts.tolist()
        np.testing.assert_allclose(got.vectors, want.vectors, atol=1e-5)
    finally:
        process.stop()


def test_the_saturation_gauge_is_the_queue_share_a_scaler_targets():
    from sidecar.scheduler.stats import EngineStats, LaneStats, SchedulerStats

    def lane(queued: int, bound: int) -> LaneStats:
        return LaneStats(queued, 1, bound, queued, 1, 0, 0, 0, 0, 0)

    stats = SchedulerStats(lane(0, 2048), lane(6144, 8192), (EngineStats("cpu", 0, 0, 0, 0),), 0, 0, False)
    engine = SimpleNamespace(counters=GraphCounters())
    served = SimpleNamespace(spec=SimpleNamespace(name="m"), scheduler=SimpleNamespace(stats=lambda: stats),
                             engines=[engine], tokenizer=SimpleNamespace(live_processes=0, process_slices=0,
                                                                         process_failures=0, process_restarts=0))
    samples = parse_exposition(render([served]))
    assert value(samples, "fern_queue_saturation", model="m", lane="batch") == 0.75
    assert value(samples, "fern_queue_saturation", model="m", lane="online") == 0
