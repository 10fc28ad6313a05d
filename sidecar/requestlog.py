"""One log line per request from every door: a gRPC server interceptor, and `log_request` for the others.

A request that succeeds is logged at DEBUG (door, method, model, lane, inputs, tokens, status,
milliseconds); one that fails is logged at WARNING with its request id and the error, so a
sidecar at the default INFO level shows every failure and nothing per success. The fields
travel on the record (`record.request`), so `--log-format json` prints them as keys of one
JSON object a line, and the text format as `key=value` pairs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass

import grpc
import grpc.aio

from sidecar.wire import embedder_pb2 as pb

log = logging.getLogger("fern.requests")

# Only the embedding service is logged per call; health probes and reflection would drown it.
LOGGED_SERVICE = "/fern.v1.Embedder/"
_LANE_NAMES = {0: "online", 1: "batch"}  # fern.v1.Lane numbers


@dataclass
class RequestRecord:
    """What one request's log line says."""

    door: str  # grpc, pg, http, ...
    method: str  # Embed, EmbedStream, ListModels, embed() ...
    status: str  # OK or the gRPC status code's name
    ms: float
    request_id: str = ""
    model: str = ""  # "" before the gateway resolved the default model
    lane: str = ""
    inputs: int = 0
    tokens: int | None = None  # None where the door does not know them (a failed call)
    error: str = ""
    peer: str = ""


def log_request(record: RequestRecord) -> None:
    """Log one request: DEBUG when it succeeded, WARNING (with its request id) when it failed."""
    failed = record.status != "OK"
    level = logging.WARNING if failed else logging.DEBUG
    if not log.isEnabledFor(level):
        return
    fields = asdict(record)
    fields["ms"] = round(record.ms, 3)
    text = " ".join(f"{key}={_text_value(value)}" for key, value in fields.items()
                    if value not in ("", None) or key in ("request_id", "status"))
    log.log(level, "%s", text, extra={"request": fields})


def _text_value(value: object) -> str:
    text = str(value)
    return json.dumps(text) if (not text or any(c.isspace() or c in '"=' for c in text)) else text


def _lane(number: int) -> str:
    return _LANE_NAMES.get(number, str(number))


def _inputs(request) -> int:
    return len(request.texts) or len(request.token_ids)


def _status(context: grpc.aio.ServicerContext, error: BaseException | None) -> tuple[str, str]:
    """The call's status code name and message, as the servicer set them (by abort or otherwise)."""
    code = context.code()
    if code is None:
        if error is None:
            return "OK", ""
        if isinstance(error, asyncio.CancelledError):
            return "CANCELLED", "the client cancelled the call"
        return "UNKNOWN", f"{type(error).__name__}: {error}"
    if isinstance(code, int):  # grpc.aio keeps the integer where the servicer set one
        code = next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)
    name = code.name
    return name, "" if name == "OK" else (context.details() or "")


class _StreamContext:
    """A servicer context whose `write` logs each response of an EmbedStream as its own request."""

    def __init__(self, context: grpc.aio.ServicerContext, peer: str, lanes: dict[str, tuple[str, int, float]]) -> None:
        self._context = context
        self._peer = peer
        self._lanes = lanes  # request id -> (lane, inputs, when it was read)

    def __getattr__(self, name: str):
        return getattr(self._context, name)

    async def write(self, message) -> None:
        lane, inputs, read_at = self._lanes.pop(message.request_id, ("", 0, time.perf_counter()))
        ms = (time.perf_counter() - read_at) * 1000
        if message.HasField("error"):
            code = next((c.name for c in grpc.StatusCode if c.value[0] == message.error.code), "UNKNOWN")
            log_request(RequestRecord("grpc", "EmbedStream", code, ms, message.request_id, lane=lane,
                                      inputs=inputs, error=message.error.message, peer=self._peer))
        elif log.isEnabledFor(logging.DEBUG):
            log_request(RequestRecord("grpc", "EmbedStream", "OK", ms, message.request_id,
                                      model=message.model, lane=lane, inputs=inputs,
                                      tokens=sum(message.token_counts), peer=self._peer))
        await self._context.write(message)


class RequestLogInterceptor(grpc.aio.ServerInterceptor):
    """Times every fern.v1.Embedder call and logs it through `log_request`.

    Unary calls give one line each; an EmbedStream gives one line per response (each is a
    request of its own, with its own id) and, if the stream itself fails, one line for that.
    """

    def __init__(self) -> None:
        self._wrapped: dict[tuple[int, str], tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(self, continuation: Callable[..., Awaitable],
                                details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(LOGGED_SERVICE):
            return handler
        # The same handler object comes back for every call of a method; a refusal's handler is
        # shared by every method, hence the method in the key.
        key = (id(handler), details.method)
        cached = self._wrapped.get(key)
        if cached is None or cached[0] is not handler:
            cached = self._wrapped[key] = (handler, _wrap(handler, details.method.rsplit("/", 1)[1]))
        return cached[1]


def _wrap(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    options = dict(request_deserializer=handler.request_deserializer,
                   response_serializer=handler.response_serializer)
    if not handler.request_streaming and not handler.response_streaming:
        behaviour = handler.unary_unary

        async def unary(request, context):
            # The query path: a success costs a clock read and a level check; Fern's servicer
            # ends every failed call by raising (context.abort), which is where errors are seen.
            started = time.perf_counter()
            try:
                response = await behaviour(request, context)
            except BaseException as error:
                _log_unary(method, request, None, context, error, started)
                raise
            if log.isEnabledFor(logging.DEBUG):
                _log_unary(method, request, response, context, None, started)
            return response

        return grpc.unary_unary_rpc_method_handler(unary, **options)
    if handler.request_streaming and handler.response_streaming:
        behaviour = handler.stream_stream

        async def stream(request_iterator, context):
            started = time.perf_counter()
            peer = context.peer()
            lanes: dict[str, tuple[str, int, float]] = {}

            async def reading() -> AsyncIterator:
                async for request in request_iterator:
                    if isinstance(request, pb.EmbedRequest):  # not a message that did not decode
                        lanes[request.request_id] = (_lane(request.lane), _inputs(request), time.perf_counter())
                    yield request

            error = None
            try:
                return await behaviour(reading(), _StreamContext(context, peer, lanes))
            except BaseException as raised:
                error = raised
                raise
            finally:
                status, message = _status(context, error)
                if status != "OK":  # the stream as a whole failed: its unanswered requests with it
                    log_request(RequestRecord("grpc", method, status, (time.perf_counter() - started) * 1000,
                                              ",".join(lanes), inputs=sum(i for _, i, _ in lanes.values()),
                                              error=message, peer=peer))

        return grpc.stream_stream_rpc_method_handler(stream, **options)
    if handler.request_streaming:
        # A unary method answered without reading its request: TokenAuth's refusal, which is a
        # stream-unary handler so that a wrong-token body is never read.
        refuse = handler.stream_unary

        async def refused(request_iterator, context):
            started = time.perf_counter()
            try:
                return await refuse(request_iterator, context)
            except BaseException as error:
                status, message = _status(context, error)
                log_request(RequestRecord("grpc", method, status, (time.perf_counter() - started) * 1000, "",
                                          error=message, peer=context.peer()))
                raise

        return grpc.stream_unary_rpc_method_handler(refused, **options)
    return handler  # no other shapes in fern.v1.Embedder


def _log_unary(method: str, request, response, context: grpc.aio.ServicerContext,
               error: BaseException | None, started: float) -> None:
    ms = (time.perf_counter() - started) * 1000
    status, message = _status(context, error)
    embed = hasattr(request, "texts")
    rerank = isinstance(request, pb.RerankRequest)  # its inputs are the documents
    scored = embed or rerank
    record = RequestRecord(
        "grpc", method, status, ms,
        request_id=getattr(request, "request_id", ""),
        model=(response.model if response is not None and scored else getattr(request, "model", "")),
        lane=_lane(request.lane) if scored else "",
        inputs=_inputs(request) if embed else len(request.documents) if rerank else 0,
        tokens=sum(response.token_counts) if response is not None and scored else None,
        error=message, peer=context.peer() if status != "OK" else "")
    log_request(record)


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, and a request's fields as keys."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
               "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        out.update(getattr(record, "request", None) or {})
        if record.exc_info:
            out["traceback"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str, fmt: str = "text") -> None:
    """Logging for `fern serve`: `level` by name (debug adds a line per request), text or json lines on stderr."""
    number = logging.getLevelName(level.upper())
    if not isinstance(number, int):
        raise ValueError(f"--log-level {level!r}: debug, info, warning or error (env FERN_LOG_LEVEL)")
    if fmt not in ("text", "json"):
        raise ValueError(f"--log-format {fmt!r}: text or json (env FERN_LOG_FORMAT)")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=number, handlers=[handler])
    # gRPC's own DEBUG lines (one per call) would bury the request lines.
    logging.getLogger("grpc").setLevel(max(number, logging.INFO))
