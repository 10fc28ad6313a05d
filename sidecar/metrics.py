"""Prometheus metrics: `GET /metrics` renders the schedulers' and engines' live counters as text.

`fern serve --metrics-port N` starts a `MetricsServer` on the sidecar's event loop, bound
to the same host as gRPC. Nothing is sampled in the background: each scrape reads
`Scheduler.stats()` (a snapshot taken under the scheduler's lock, held for microseconds,
the same lock the loop already takes to admit a request), every engine's graph counters
and every tokenizer's worker-process counters (plain ints, read without a lock). The format
is Prometheus's text exposition format 0.0.4; counters end in `_total`, and every sample
carries the model's name, but the failed-authentication counters (with a token set), which
carry the door they count.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import ssl
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from sidecar.registry import ServedModel
from sidecar.security import AuthLimiter, TokenSet

log = logging.getLogger(__name__)

METRICS_PATH = "/metrics"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# A scraper sends its whole request at once; a connection that has not within this long is dropped.
READ_TIMEOUT_S = 10.0
MAX_HEADER_LINES = 100


@dataclass(frozen=True)
class Family:
    """One metric family: its name, type, help text, and how to read a sample from its source."""

    name: str
    kind: str  # "counter" or "gauge"
    help: str
    read: Callable[[object], int]


# Per model and lane, from LaneStats. Requests are Scheduler.embed calls (one per gRPC
# Embed call, or per EmbedStream request, per model).
LANE_FAMILIES: tuple[Family, ...] = (
    Family("fern_queue_tokens", "gauge", "Tokens queued in the lane now.",
           lambda s: s.queued_tokens),
    Family("fern_queue_requests", "gauge", "Requests with tokens queued in the lane now.",
           lambda s: s.queued_requests),
    Family("fern_queue_max_tokens", "gauge", "The lane's queue bound in tokens (beyond it: QueueFull).",
           lambda s: s.max_queued_tokens),
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
           "Worker process pools started anew after a worker died.", lambda t: t.process_restarts),
)

DRAINING = Family("fern_scheduler_draining", "gauge",
                  "1 while the model's scheduler drains for shutdown, else 0.",
                  lambda s: int(s.draining))


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _labels(pairs: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{_escape_label(v)}"' for k, v in pairs.items()) + "}"


# Upper bounds (seconds) of the HTTP door's latency histogram buckets; +Inf is implied.
HTTP_LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class HttpMetrics:
    """The HTTP door's counters: requests by route, status and lane, and latency by route (a histogram).

    `observe` runs on the event loop once per answered request; routes are the app's path
    templates, so the label sets stay few.
    """

    def __init__(self, buckets: tuple[float, ...] = HTTP_LATENCY_BUCKETS_S) -> None:
        self.buckets = buckets
        self.requests: dict[tuple[str, str, str], int] = {}
        self._latency: dict[str, list[int]] = {}  # per route: count per bucket, then +Inf
        self._sum: dict[str, float] = {}

    def observe(self, route: str, status: int, lane: str, seconds: float) -> None:
        key = (route, str(status), lane)
        self.requests[key] = self.requests.get(key, 0) + 1
        counts = self._latency.get(route)
        if counts is None:
            counts = self._latency[route] = [0] * (len(self.buckets) + 1)
            self._sum[route] = 0.0
        counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self._sum[route] += seconds

    def lines(self) -> list[str]:
        """This door's families in the text exposition format."""
        out = ["# HELP fern_http_requests_total HTTP requests answered, by route, status and lane.",
               "# TYPE fern_http_requests_total counter"]
        for (route, status, lane), count in sorted(self.requests.items()):
            out.append(f"fern_http_requests_total{_labels({'route': route, 'status': status, 'lane': lane})} {count}")
        out += ["# HELP fern_http_request_seconds Time from a request's arrival at its route to its answer.",
                "# TYPE fern_http_request_seconds histogram"]
        for route, counts in sorted(self._latency.items()):
            total = 0
            for bound, count in zip((*self.buckets, float("inf")), counts):
                total += count
                le = "+Inf" if bound == float("inf") else repr(bound)
                out.append(f"fern_http_request_seconds_bucket{_labels({'route': route, 'le': le})} {total}")
            out.append(f"fern_http_request_seconds_sum{_labels({'route': route})} {self._sum[route]!r}")
            out.append(f"fern_http_request_seconds_count{_labels({'route': route})} {total}")
        return out


def render(models: Iterable[ServedModel], extras: Iterable[HttpMetrics] = ()) -> str:
    """The text exposition (format 0.0.4) of every model's scheduler and engine counters now,
    then the families of `extras` (the HTTP door's)."""
    # A model's scheduler samples come from one stats() snapshot; its graph counters are
    # copied right after (the engine thread bumps them outside the scheduler's lock, so a
    # step being launched may show in one and not yet in the other).
    rows: dict[str, list[tuple[dict[str, str], object]]] = {}

    def add(family: Family, labels: dict[str, str], source: object) -> None:
        rows.setdefault(family.name, []).append((labels, source))

    for served in models:
        model = served.spec.name
        stats = served.scheduler.stats()
        for lane_name, lane_stats in (("online", stats.online), ("batch", stats.batch)):
            for family in LANE_FAMILIES:
                add(family, {"model": model, "lane": lane_name}, lane_stats)
        # The scheduler was built from served.engines: the same engines, in the same order.
        for index, (engine_stats, engine) in enumerate(zip(stats.engines, served.engines, strict=True)):
            labels = {"model": model, "engine": str(index), "device": engine_stats.device}
            graphs = replace(engine.counters)
            for family in ENGINE_FAMILIES:
                add(family, labels, engine_stats)
            for family in GRAPH_FAMILIES:
                add(family, labels, graphs)
        for family in TOKENIZER_FAMILIES:
            add(family, {"model": model}, served.tokenizer)
        add(DRAINING, {"model": model}, stats)

    lines: list[str] = []
    for family in (*LANE_FAMILIES, *ENGINE_FAMILIES, *GRAPH_FAMILIES, *TOKENIZER_FAMILIES, DRAINING):
        lines.append(f"# HELP {family.name} {_escape_help(family.help)}")
        lines.append(f"# TYPE {family.name} {family.kind}")
        for labels, source in rows.get(family.name, ()):
            lines.append(f"{family.name}{_labels(labels)} {int(family.read(source))}")
    for extra in extras:
        lines.extend(extra.lines())
    return "\n".join(lines) + "\n"


class MetricsServer:
    """`await MetricsServer(registry, host, port).start()`; `.port` is the bound port (0: any free).

    A minimal HTTP/1.1 server on the running event loop: `GET` or `HEAD /metrics` answers
    the exposition, any other path 404, any other method 405. Every response closes its
    connection, so `stop()` only has to cancel requests still being read. `ssl_context`
    serves HTTPS (a server-side context: mutual TLS when it requires client certificates);
    a non-empty `tokens` requires `Authorization: Bearer <token>` (401 otherwise). The
    failed-auth `limiter`'s counters, when given, are part of the exposition.
    """

    def __init__(self, models: Iterable[ServedModel], host: str = "127.0.0.1", port: int = 0, *,
                 ssl_context: ssl.SSLContext | None = None, tokens: TokenSet | None = None,
                 limiter: AuthLimiter | None = None, extras: Iterable[HttpMetrics] = ()) -> None:
        self.models = models
        self.extras = list(extras)
        self.host = host
        self.port = port
        self.ssl_context = ssl_context
        self.tokens = tokens or TokenSet()
        self.limiter = limiter
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task] = set()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        scheme = "http" if self.ssl_context is None else "https"
        return f"{scheme}://{host}:{self.port}{METRICS_PATH}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port, ssl=self.ssl_context,
                                                  ssl_handshake_timeout=READ_TIMEOUT_S if self.ssl_context else None)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("metrics on %s", self.url)

    async def stop(self) -> None:
        """Stop listening and drop connections still sending their request."""
        if self._server is None:
            return
        self._server.close()
        for handler in list(self._handlers):
            handler.cancel()
        if self._handlers:
            await asyncio.wait(list(self._handlers))
        await self._server.wait_closed()
        self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handler = asyncio.current_task()
        self._handlers.add(handler)
        try:
            try:
                method, target, authorization = await asyncio.wait_for(_read_request(reader), READ_TIMEOUT_S)
            except ValueError:  # not HTTP/1.x, or a line past the reader's limit
                writer.write(_response(400, "Bad Request", "bad request\n"))
            else:
                if self.tokens and not self.tokens.check_bearer(authorization):
                    writer.write(_response(401, "Unauthorized", "missing or wrong token: send "
                                           "'Authorization: Bearer <token>'\n",
                                           extra=('WWW-Authenticate: Bearer realm="fern"',)))
                else:
                    writer.write(self._answer(method, target))
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError, ssl.SSLError):
            pass  # the scraper went away, never finished its request, or failed the TLS handshake
        except asyncio.CancelledError:
            pass  # stop() ends the connection
        finally:
            self._handlers.discard(handler)
            writer.close()

    def _answer(self, method: str, target: str) -> bytes:
        path = target.split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            return _response(405, "Method Not Allowed", f"method {method} not allowed: use GET\n",
                             extra=("Allow: GET, HEAD",))
        if path != METRICS_PATH:
            return _response(404, "Not Found", f"{path} not found: metrics are at {METRICS_PATH}\n",
                             head=method == "HEAD")
        try:
            body = render(self.models, self.extras) + (
                self.limiter.exposition() if self.limiter is not None else "")
        except Exception as error:  # our bug: the scraper sees 500, the log has the traceback
            log.exception("rendering /metrics failed")
            return _response(500, "Internal Server Error", f"internal error: {error}\n",
                             head=method == "HEAD")
        return _response(200, "OK", body, content_type=CONTENT_TYPE, head=method == "HEAD")


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, str | None]:
    """The method, target and Authorization header of an HTTP/1.x request; other headers are ignored."""
    request_line = await reader.readline()
    if not request_line:
        raise asyncio.IncompleteReadError(b"", None)
    parts = request_line.decode("latin-1").split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise ValueError(f"not an HTTP/1.x request line: {request_line[:80]!r}")
    authorization = None
    for _ in range(MAX_HEADER_LINES):
        line = await reader.readline()
        if line in (b"\r\n", b"\n"):
            return parts[0], parts[1], authorization
        name, _, value = line.decode("latin-1").partition(":")
        if name.strip().lower() == "authorization":
            authorization = value.strip()
        if not line:
            raise asyncio.IncompleteReadError(b"", None)
    raise ValueError(f"more than {MAX_HEADER_LINES} header lines")


def _response(status: int, reason: str, body: str, *, content_type: str = "text/plain; charset=utf-8",
              extra: tuple[str, ...] = (), head: bool = False) -> bytes:
    payload = body.encode()
    headers = [f"HTTP/1.1 {status} {reason}", f"Content-Type: {content_type}",
               f"Content-Length: {len(payload)}", "Connection: close", *extra]
    return ("\r\n".join(headers) + "\r\n\r\n").encode() + (b"" if head else payload)
