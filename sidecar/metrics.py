"""Prometheus metrics: `GET /metrics` exports the schedulers' and engines' live counters.

`fern serve --metrics-port N` starts a `MetricsServer`: prometheus_client's exposition
(text format, OpenMetrics when the scraper asks for it, gzip, `name[]` filters) served by
uvicorn on the sidecar's event loop, bound to the same host as gRPC. Nothing is sampled in
the background: each scrape reads `Scheduler.stats()` (a snapshot taken under the
scheduler's lock, held for microseconds), every engine's graph counters and every
tokenizer's worker-process counters (plain ints, read without a lock). Every sample carries
the model's name, but the failed-authentication counters, which carry the door they count.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.asgi import make_asgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from sidecar.registry import ServedModel
from sidecar.security import AuthLimiter, TokenSet

log = logging.getLogger(__name__)

METRICS_PATH = "/metrics"
# Scrapers' connections open at once; beyond it a scrape gets 503 (a scraper holds one).
MAX_CONNECTIONS = 64


@dataclass(frozen=True)
class Family:
    """One metric family: its sample name, type, help text, and how to read a sample from its source."""

    name: str
    kind: str  # "counter" (name ends in _total) or "gauge"
    help: str
    read: Callable[[object], float]

    def empty(self, labels: Iterable[str]) -> Metric:
        kind = CounterMetricFamily if self.kind == "counter" else GaugeMetricFamily
        return kind(self.name, self.help, labels=list(labels))


# Per model and lane, from LaneStats. Requests are Scheduler.embed calls (one per gRPC
# Embed call, or per EmbedStream request, per model).
LANE_FAMILIES: tuple[Family, ...] = (
    Family("fern_queue_tokens", "gauge", "Tokens queued in the lane now.",
           lambda s: s.queued_tokens),
    Family("fern_queue_requests", "gauge", "Requests with tokens queued in the lane now.",
           lambda s: s.queued_requests),
    Family("fern_queue_max_tokens", "gauge", "The lane's queue bound in tokens (beyond it: QueueFull).",
           lambda s: s.max_queued_tokens),
    Family("fern_queue_saturation", "gauge",
           "Queued tokens over the lane's bound, 0 to 1: what an autoscaler targets.",
           lambda s: s.queued_tokens / s.max_queued_tokens if s.max_queued_tokens else 0.0),
    Family("fern_queue_high_water_tokens", "gauge", "The most tokens ever queued in the lane at once.",
           lambda s: s.high_water_tokens),
    Family("fern_requests_admitted_total", "counter", "Requests admitted to the lane's queue.",
           lambda s: s.admitted),
    Family("fern_requests_rejected_total", "counter",
           "Requests refused because the lane's queue was full (RESOURCE_EXHAUSTED).",
           lambda s: s.rejected),
    Family("fern_requests_cancelled_total", "counter", "Requests cancelled by their caller.",
           lambda s: s.cancelled),
    Family("fern_requests_expired_total", "counter",
           "Requests whose deadline passed before all their sequences were embedded.",
           lambda s: s.expired),
    Family("fern_requests_completed_total", "counter", "Requests whose vectors all came back.",
           lambda s: s.completed),
    Family("fern_embedded_tokens_total", "counter", "Tokens whose vectors came back.",
           lambda s: s.tokens),
)

# Per model and engine (one engine per device), from EngineStats.
ENGINE_FAMILIES: tuple[Family, ...] = (
    Family("fern_engine_steps_total", "counter", "Engine steps launched.", lambda s: s.steps),
    Family("fern_engine_tokens_total", "counter", "Tokens in the engine steps launched.",
           lambda s: s.tokens),
    Family("fern_engine_sequences_total", "counter", "Sequences in the engine steps launched.",
           lambda s: s.sequences),
    Family("fern_engine_inflight_tokens", "gauge",
           "Tokens composed into steps and not yet delivered.", lambda s: s.inflight_tokens),
    Family("fern_engine_loop_launched_steps_total", "counter",
           "Of the steps launched, those the event loop launched for queries that found the engine idle.",
           lambda s: s.loop_launches),
)

# Per model and engine, from core_engine's GraphCounters (how each step was run).
GRAPH_FAMILIES: tuple[Family, ...] = (
    Family("fern_graph_eager_runs_total", "counter", "Steps run eagerly (no CUDA graph).",
           lambda c: c.eager_runs),
    Family("fern_graph_captures_total", "counter", "CUDA graphs captured.", lambda c: c.captures),
    Family("fern_graph_replays_total", "counter", "Steps run by replaying a captured CUDA graph.",
           lambda c: c.replays),
    Family("fern_graph_evictions_total", "counter",
           "Captured CUDA graphs evicted (least recently used first).", lambda c: c.evictions),
    Family("fern_graph_uncacheable_total", "counter",
           "Steps too large for the static buffers, always run eagerly.", lambda c: c.uncacheable),
)

# Per model and engine, from the engine itself.
ENGINE_STATE_FAMILIES: tuple[Family, ...] = (
    Family("fern_engine_compiled", "gauge",
           "1 when the engine's steps run torch.compile's code (from the next step on); 0 while it serves "
           "uncompiled (a background compile under way, or compiling off or failed).", lambda e: int(getattr(e, "compiled", False))),
)

# Per model, from its TextTokenizer: the worker processes that tokenize bulk requests.
TOKENIZER_FAMILIES: tuple[Family, ...] = (
    Family("fern_tokenizer_processes", "gauge",
           "Tokenizer worker processes taking bulk requests now, shared by the models (0: none, or given up).",
           lambda t: t.live_processes),
    Family("fern_tokenizer_process_slices_total", "counter", "Request slices tokenized in worker processes.",
           lambda t: t.process_slices),
    Family("fern_tokenizer_process_failures_total", "counter",
           "Request slices whose worker process died; each was tokenized again on the threads.",
           lambda t: t.process_failures),
    Family("fern_tokenizer_process_restarts_total", "counter",
           "Worker processes started anew after one died or hung.", lambda t: t.process_restarts),
)

DRAINING = Family("fern_scheduler_draining", "gauge",
                  "1 while the model's scheduler drains for shutdown, else 0.",
                  lambda s: int(s.draining))

# Per door, from the failed-authentication limiter (exported when a token is set).
AUTH_FAMILIES: tuple[Family, ...] = (
    Family("fern_auth_failures_total", "counter", "Calls refused for a missing or wrong token.",
           lambda a: a.failures_total),
    Family("fern_auth_refused_total", "counter",
           "Of those, calls refused at once because their address was over its limit.",
           lambda a: a.refused_total),
    Family("fern_auth_locked_addresses", "gauge",
           "Addresses refused at once now for too many failed authentications.",
           lambda a: a.locked_addresses()),
    Family("fern_auth_held_calls", "gauge", "Wrong-token calls being held for their back-off now.",
           lambda a: a.held_calls),
)

_LABELS = {id(f): ("model", "lane") for f in LANE_FAMILIES}
_LABELS.update({id(f): ("model", "engine", "device")
                for f in (*ENGINE_FAMILIES, *ENGINE_STATE_FAMILIES, *GRAPH_FAMILIES)})
_LABELS.update({id(f): ("model",) for f in (*TOKENIZER_FAMILIES, DRAINING)})


class ServingCollector(Collector):
    """Every served model's scheduler, engine, graph and tokenizer counters, read at scrape time."""

    def __init__(self, models: Iterable[ServedModel]) -> None:
        self.models = models

    def collect(self) -> Iterator[Metric]:
        families = {family.name: family.empty(_LABELS[id(family)])
                    for family in (*LANE_FAMILIES, *ENGINE_FAMILIES, *ENGINE_STATE_FAMILIES, *GRAPH_FAMILIES,
                                   *TOKENIZER_FAMILIES, DRAINING)}

        def add(family: Family, labels: tuple[str, ...], source: object) -> None:
            families[family.name].add_metric(list(labels), family.read(source))

        for served in self.models:
            model = served.spec.name
            # The scheduler samples come from one stats() snapshot; the graph counters are copied
            # right after (the engine thread bumps them outside the scheduler's lock).
            stats = served.scheduler.stats()
            for lane_name, lane_stats in (("online", stats.online), ("batch", stats.batch)):
                for family in LANE_FAMILIES:
                    add(family, (model, lane_name), lane_stats)
            # The scheduler was built from served.engines: the same engines, in the same order.
            for index, (engine_stats, engine) in enumerate(zip(stats.engines, served.engines, strict=True)):
                labels = (model, str(index), engine_stats.device)
                graphs = replace(engine.counters)
                for family in ENGINE_FAMILIES:
                    add(family, labels, engine_stats)
                for family in GRAPH_FAMILIES:
                    add(family, labels, graphs)
                for family in ENGINE_STATE_FAMILIES:
                    add(family, labels, engine)
            for family in TOKENIZER_FAMILIES:
                add(family, (model,), served.tokenizer)
            add(DRAINING, (model,), stats)
        yield from families.values()


class LimiterCollector(Collector):
    """The failed-authentication limiter's counters, labelled with the door they count."""

    def __init__(self, limiter: AuthLimiter, door: str = "grpc") -> None:
        self.limiter, self.door = limiter, door

    def collect(self) -> Iterator[Metric]:
        for family in AUTH_FAMILIES:
            metric = family.empty(("door",))
            metric.add_metric([self.door], family.read(self.limiter))
            yield metric


# Upper bounds (seconds) of the HTTP door's latency histogram buckets; +Inf is implied.
HTTP_LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class HttpMetrics(Collector):
    """The HTTP door's counters: requests by route, status and lane, and latency by route (a histogram).

    `observe` runs on the event loop once per answered request; routes are the app's path
    templates, so the label sets stay few.
    """

    def __init__(self, buckets: tuple[float, ...] = HTTP_LATENCY_BUCKETS_S) -> None:
        self._requests = Counter("fern_http_requests", "HTTP requests answered, by route, status and lane.",
                                 ("route", "status", "lane"), registry=None)
        self._latency = Histogram("fern_http_request_seconds",
                                  "Time from a request's arrival at its route to its answer.",
                                  ("route",), buckets=buckets, registry=None)
        self._children: dict[tuple[str, int, str], tuple[Callable[[], None], Callable[[float], None]]] = {}

    def observe(self, route: str, status: int, lane: str, seconds: float) -> None:
        key = (route, status, lane)
        child = self._children.get(key)
        if child is None:  # labels() takes a lock and builds a child: once per label set
            child = self._children[key] = (self._requests.labels(route, str(status), lane).inc,
                                           self._latency.labels(route).observe)
        child[0]()
        child[1](seconds)

    def collect(self) -> Iterator[Metric]:
        yield from self._requests.collect()
        yield from self._latency.collect()


def build_registry(models: Iterable[ServedModel], extras: Iterable[Collector] = ()) -> CollectorRegistry:
    """A registry of the serving counters, then `extras` (the HTTP door's, the limiter's)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServingCollector(models))
    for extra in extras:
        registry.register(extra)
    return registry


def render(models: Iterable[ServedModel], extras: Iterable[Collector] = ()) -> str:
    """The text exposition of every model's counters now, then those of `extras`."""
    return generate_latest(build_registry(models, extras)).decode()


class MetricsApp:
    """The ASGI app of the metrics door: `GET`/`HEAD /metrics` answers prometheus_client's
    exposition; any other path 404, any other method 405; with `tokens`, a request without
    `Authorization: Bearer <token>` gets 401."""

    def __init__(self, registry: CollectorRegistry, tokens: TokenSet) -> None:
        self.tokens = tokens
        self._export = make_asgi_app(registry)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        if method not in ("GET", "HEAD"):
            await _plain(send, 405, f"method {method} not allowed: use GET\n", (b"allow", b"GET, HEAD"))
        elif path != METRICS_PATH:
            await _plain(send, 404, f"{path} not found: metrics are at {METRICS_PATH}\n")
        elif self.tokens and not self.tokens.check_bearer(_header(scope, b"authorization")):
            await _plain(send, 401, "missing or wrong token: send 'Authorization: Bearer <token>'\n",
                         (b"www-authenticate", b'Bearer realm="fern"'))
        else:
            await self._export(scope, receive, send)


def _header(scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _plain(send, status: int, text: str, *extra: tuple[bytes, bytes]) -> None:
    body = text.encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                            (b"content-length", str(len(body)).encode()), *extra]})
    await send({"type": "http.response.body", "body": body})


class MetricsServer:
    """`await MetricsServer(registry, host, port).start()`; `.port` is the bound port (0: any free).

    `ssl_context` serves HTTPS (a server-side context: mutual TLS when it requires client
    certificates); a non-empty `tokens` requires `Authorization: Bearer <token>`. The
    failed-auth `limiter`'s counters (door="grpc"), the Postgres endpoint's `pg_limiter`'s
    (door="pgwire") and those of `extras` are part of the exposition.
    """

    def __init__(self, models: Iterable[ServedModel], host: str = "127.0.0.1", port: int = 0, *,
                 ssl_context: ssl.SSLContext | None = None, tokens: TokenSet | None = None,
                 limiter: AuthLimiter | None = None, pg_limiter: object | None = None,
                 extras: Iterable[Collector] = ()) -> None:
        import uvicorn  # loaded only where the door is open

        from sidecar.inloop import InLoopServer

        collectors = list(extras) + ([LimiterCollector(limiter)] if limiter is not None else [])
        if pg_limiter is not None:  # the Postgres endpoint's own limiter (SCRAM failures), door="pgwire"
            collectors.append(LimiterCollector(pg_limiter, "pgwire"))
        self.app = MetricsApp(build_registry(models, collectors), tokens or TokenSet())
        self.host = host
        self.port = port
        self.ssl_context = ssl_context
        self._config = uvicorn.Config(
            self.app, host=host, port=port, http="httptools", ws="none", lifespan="off", access_log=False,
            log_config=None, proxy_headers=False, server_header=False, timeout_keep_alive=5,
            timeout_graceful_shutdown=1, limit_concurrency=MAX_CONNECTIONS)
        self._server = InLoopServer(self._config, "metrics", ssl_context=ssl_context)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        scheme = "http" if self.ssl_context is None else "https"
        return f"{scheme}://{host}:{self.port}{METRICS_PATH}"

    async def start(self) -> None:
        """Bind and serve; OSError when the address cannot be bound."""
        await self._server.start()
        self.port = self._server.port
        log.info("metrics on %s", self.url)

    async def stop(self) -> None:
        """Stop listening and close the scrapers' connections."""
        await self._server.stop()
