"""The gRPC server: fern.v1.Embedder over the gateway, plus grpc.health.v1, reflection, auth and drain.

`Sidecar` is the composable unit: give it a loaded `Registry`, `await start()`, and its
`gateway` is what other front ends (the Postgres-protocol endpoint, in-process callers)
share. `await stop()` drains: health goes NOT_SERVING, new calls get UNAVAILABLE, calls
in flight finish, the schedulers empty, then the server closes.

Vectors travel as one packed little-endian buffer per response. Errors are gRPC status
codes whose message names the input; on unary calls the input's index is also in the
trailing metadata (`fern-input-index`). In EmbedStream a bad request comes back as a
response with `error` set, and the stream goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc
import grpc.aio
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError
from grpc_reflection.v1alpha import reflection

from core_engine.config import ModelSpec
from sidecar import balancing, encodings, unixsocket
from sidecar.errors import INPUT_INDEX_KEY, EmbedError, invalid_argument, unavailable
from sidecar.gateway import (DRAINING, LOOP_ROWS, MAX_INPUTS, EmbedParams, EmbedResult, Gateway,
                             RerankParams, RerankResult)
from sidecar.lexical import DEFAULT_LANGUAGE
from sidecar.registry import Registry
from sidecar.requestlog import RequestLogInterceptor
from sidecar.scheduler import Lane
from sidecar.security import AuthLimiter, TlsSettings, TokenSet, peer_address
from sidecar.unixsocket import UnixSocket
from sidecar.wire import embedder_pb2 as pb
from sidecar.wire import embedder_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

try:  # what gRPC raises when a call's answer cannot be sent because the call has ended
    from grpc._cython.cygrpc import ExecuteBatchError as _CallGone
except ImportError:  # another grpcio layout: such a failure is then gRPC's to log
    _CallGone = ()

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Embedder"].full_name  # "fern.v1.Embedder"
# A request of MAX_INPUTS long texts, or a response of MAX_INPUTS 4096-dim float32 vectors
# (128 MiB), fits; bigger jobs belong on EmbedStream.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
# Requests one EmbedStream may have read but not yet answered: with the scheduler's
# queue bounds, this keeps a stream's memory bounded even when its client reads slowly.
STREAM_WINDOW = 64
# Requests one EmbedStream may have read but not yet handed to the scheduler: tokenizing
# a few ahead keeps the GPU fed from a single stream; a full lane stops further reads.
STREAM_PREFETCH = 4
DEFAULT_GRACE_S = 30.0
# gRPC core holds calls that arrived before the server asked for the next one; past its
# default backlog (1,000, rising to 3,000 with random early rejection) it cancels them with a
# bare CANCELLED the caller never asked for. Lanes are bounded in tokens (RESOURCE_EXHAUSTED
# naming the lane), and a connection carries at most MAX_STREAMS_PER_CONNECTION calls at once
# (HTTP/2 flow control: more wait in the client), so the backlog is set far above anything
# those bounds let through.
MAX_PENDING_CALLS = 1 << 20
MAX_STREAMS_PER_CONNECTION = 4096
ADMISSION_OPTIONS = [("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
                     ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
                     ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION)]
# What gRPC reads of a call's body before a handler asks for it: a fixed 1 MiB per stream,
# not the BDP estimator's window, which grows to tens of MiB on a fast link. A wrong-token
# call held for its back-off so costs at most this much, however large its body. 1 MiB a
# round trip is 2 GB/s at 0.5 ms and 100 MB/s at 10 ms, far above what a GPU embeds of text;
# on loopback a fixed window moves a 32 MiB message faster than the grown one.
RECEIVE_WINDOW_BYTES = 1 << 20
WINDOW_OPTIONS = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", RECEIVE_WINDOW_BYTES)]

_TRUNCATIONS = {pb.TRUNCATION_END: True, pb.TRUNCATION_ERROR: False}
_LANES = {lane.value: lane for lane in Lane}


@dataclass(frozen=True)
class Undecodable:
    """What the deserializer hands a handler for bytes that are not a valid request: why, and
    the offending input's index when it is one of `texts`."""

    message: str
    index: int | None = None

    def error(self) -> EmbedError:
        return invalid_argument(self.message, self.index)


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """The varint at `pos` and the position after it; IndexError when it runs past the end."""
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift >= 70:
            raise ValueError("a varint longer than 10 bytes")


def _fault(data: bytes, descriptor: Descriptor, path: str = "") -> tuple[str, int | None]:
    """Where `data` stops being a valid `descriptor` message: the field's name and what is wrong.

    protobuf's DecodeError says only that parsing failed; this walks the wire format (tags,
    lengths, strings' UTF-8, nested messages) to name the field, e.g. ``texts[2]``.
    """
    pos, seen = 0, {}
    while pos < len(data):
        start = pos
        try:
            tag, pos = _varint(data, pos)
        except (IndexError, ValueError):
            return f"{path or 'message'}: truncated or corrupt field tag at byte {start}", None
        number, wire = tag >> 3, tag & 7
        field = descriptor.fields_by_number.get(number)
        name = field.name if field is not None else f"field {number}"
        label = f"{path}{'.' if path else ''}{name}"
        index = None
        if field is not None and field.is_repeated and wire == 2:
            index = seen[number] = seen.get(number, -1) + 1
            label = f"{label}[{index}]"
        try:
            if wire == 0:
                _, pos = _varint(data, pos)
            elif wire in (1, 5):
                pos += 8 if wire == 1 else 4
                if pos > len(data):
                    raise IndexError
            elif wire == 2:
                length, pos = _varint(data, pos)
                end = pos + length
                if end > len(data):
                    return (f"{label}: its length ({length} bytes) runs past the end of the message "
                            f"({len(data)} bytes): truncated", None)
                body, pos = data[pos:end], end
                if field is not None and field.type == FieldDescriptor.TYPE_STRING:
                    try:
                        body.decode("utf-8")
                    except UnicodeDecodeError as error:
                        top = index if not path and name == "texts" else None
                        return f"{label}: not valid UTF-8 (byte {error.start} of the string)", top
                elif field is not None and field.type == FieldDescriptor.TYPE_MESSAGE:
                    inner, _ = _fault(body, field.message_type, label)
                    if inner:
                        return inner, None
            else:
                return f"{label}: wire type {wire} at byte {start} is not valid protobuf", None
        except (IndexError, ValueError):
            return f"{label}: truncated at byte {start}", None
    return "", None


def _decoder(message_class) -> Callable[[bytes], object]:
    """A request deserializer that turns bytes protobuf cannot parse into an `Undecodable`
    (answered INVALID_ARGUMENT by the handler) instead of an exception gRPC logs as UNKNOWN."""
    descriptor = message_class.DESCRIPTOR
    parse = message_class.FromString

    def decode(data: bytes):
        try:
            return parse(data)
        except DecodeError as error:
            where, index = _fault(data, descriptor)
            detail = where or f"protobuf says: {error}"
            return Undecodable(f"{detail}; the request is not a valid {descriptor.full_name}", index)

    return decode


def add_embedder(service: pb_grpc.EmbedderServicer, server: grpc.aio.Server) -> None:
    """fern.v1.Embedder on `server`, as pb_grpc.add_EmbedderServicer_to_server adds it but with
    request deserializers that report undecodable bytes as INVALID_ARGUMENT."""
    embed_request, list_request = _decoder(pb.EmbedRequest), _decoder(pb.ListModelsRequest)
    handlers = {
        "Embed": grpc.unary_unary_rpc_method_handler(
            service.Embed, request_deserializer=embed_request,
            response_serializer=pb.EmbedResponse.SerializeToString),
        "EmbedStream": grpc.stream_stream_rpc_method_handler(
            service.EmbedStream, request_deserializer=embed_request,
            response_serializer=pb.EmbedResponse.SerializeToString),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            service.ListModels, request_deserializer=list_request,
            response_serializer=pb.ListModelsResponse.SerializeToString),
        "Rerank": grpc.unary_unary_rpc_method_handler(
            service.Rerank, request_deserializer=_decoder(pb.RerankRequest),
            response_serializer=pb.RerankResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def params_from_request(request: pb.EmbedRequest, deadline: float | None) -> EmbedParams:
    """The gateway's view of a wire request; unknown enum numbers are INVALID_ARGUMENT."""
    lane = _LANES.get(request.lane)
    if lane is None:
        raise invalid_argument(f"lane: unknown value {request.lane}")
    encoding = encodings.BY_WIRE.get(request.encoding)
    if encoding is None:
        raise invalid_argument(f"encoding: unknown value {request.encoding}")
    truncate = _TRUNCATIONS.get(request.truncation)
    if truncate is None:
        raise invalid_argument(f"truncation: unknown value {request.truncation}")
    return EmbedParams(
        texts=request.texts,
        token_ids=[t.ids for t in request.token_ids] if len(request.token_ids) else (),
        model=request.model,
        lane=lane,
        prompt_name=request.prompt_name,
        normalize=request.normalize if request.HasField("normalize") else None,
        truncate=truncate,
        dimensions=request.dimensions,
        encoding=encoding.name,
        return_sparse=request.return_sparse,
        deadline=deadline,
        return_multivector=request.return_multivector,
    )


def response_from_result(request_id: str, result: EmbedResult) -> pb.EmbedResponse:
    """One packed little-endian buffer for all rows; sparse vectors as repeated fields."""
    encoding = encodings.BY_NAME[result.encoding]
    vectors = np.ascontiguousarray(result.vectors, dtype=encoding.dtype)
    response = pb.EmbedResponse(
        request_id=request_id,
        model=result.model,
        count=vectors.shape[0],
        dimensions=result.dimensions,
        encoding=encoding.wire,
        vectors=vectors.tobytes(),
        token_counts=result.token_counts,
    )
    if result.sparse is not None:
        response.sparse.extend(pb.SparseVector(indices=indices.tolist(), values=values.tolist())
                               for indices, values in result.sparse)
    if result.multivectors is not None:
        _add_multivectors(response, result.multivectors)
    return response


def _add_multivectors(response: pb.EmbedResponse, multivectors: list[np.ndarray]) -> None:
    """Every input's multi-vectors in one packed little-endian float32 buffer, with a row count per input."""
    response.multivector_counts.extend(len(m) for m in multivectors)
    response.multivector_dimensions = multivectors[0].shape[1] if multivectors else 0
    response.multivectors = np.concatenate(multivectors).astype("<f4", copy=False).tobytes() if multivectors else b""


def model_info(spec: ModelSpec) -> pb.ModelInfo:
    """A ModelSpec as ListModels describes it."""
    return pb.ModelInfo(
        name=spec.name,
        dimensions=spec.dimensions,
        max_tokens=spec.max_tokens,
        pooling=spec.pooling,
        prompts=[pb.Prompt(name=k, text=v) for k, v in spec.prompts.items()],
        default_prompt_name=spec.default_prompt_name or "",
        normalize=spec.normalize,
        matryoshka_dimensions=list(spec.matryoshka_dimensions),
        vocab_size=spec.vocab_size,
        distance=spec.distance,
        native_int8=spec.native_int8,
        learned_sparse=spec.sparse_head,
        multivector_dimensions=spec.colbert_dim,
        kind=spec.kind,
    )


def _deadline(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


def _internal(error: BaseException) -> EmbedError:
    log.exception("internal error while embedding", exc_info=error)
    return EmbedError(grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}")


def _error_response(request_id: str, error: EmbedError) -> pb.EmbedResponse:
    return pb.EmbedResponse(request_id=request_id, error=pb.Error(
        code=error.code.value[0], message=error.message,
        index=-1 if error.index is None else error.index))


class EmbedderService(pb_grpc.EmbedderServicer):
    """fern.v1.Embedder on top of a Gateway."""

    def __init__(self, gateway: Gateway, *, stream_window: int = STREAM_WINDOW,
                 stream_prefetch: int = STREAM_PREFETCH) -> None:
        self.gateway = gateway
        self.stream_window = stream_window
        self.stream_prefetch = stream_prefetch
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._draining = asyncio.Event()

    @contextlib.contextmanager
    def _tracked(self):
        self._active += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._active -= 1
            if self._active == 0:
                self._idle.set()

    def begin_drain(self) -> None:
        """Refuse new work; streams stop reading and end once their requests are answered."""
        self.gateway.draining = True
        self._draining.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait for calls in flight to finish; False when `timeout` passed first."""
        if self._idle.is_set():  # wait_for(..., 0) times out before the wait even looks
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        if self._draining.is_set():
            await _refuse_draining(context)
        # The hot path of a query: tracked inline rather than through _tracked()'s generator.
        self._active += 1
        self._idle.clear()
        try:
            try:
                if isinstance(request, Undecodable):
                    raise request.error()
                params = params_from_request(request, _deadline(context))
                result = await self.gateway.embed(params)
            except EmbedError as error:
                await _abort(context, error)
            except Exception as error:  # anything else is our bug: say so, keep serving
                await _abort(context, _internal(error))
            if _ended(context):
                raise _gone(None)
            if result.sparse is not None and len(result.sparse) > LOOP_ROWS:
                return await asyncio.to_thread(response_from_result, request.request_id, result)
            return response_from_result(request.request_id, result)
        finally:
            self._active -= 1
            if self._active == 0:
                self._idle.set()

    async def EmbedStream(self, request_iterator: AsyncIterator[pb.EmbedRequest],
                          context: grpc.aio.ServicerContext) -> None:
        """Flow-controlled bulk embedding; see the module docstring.

        Two bounds decide when the next request is read. `admitting`: at most
        `stream_prefetch` requests may be read and not yet admitted by the scheduler
        (being tokenized, or waiting for lane room); while the lane is full they wait and
        later requests stay unread, in gRPC's window and then the client's. `window`: at
        most `stream_window` requests may be read and not yet answered, so a client that
        reads its responses slowly cannot make the server hold results without bound.
        """
        if self._draining.is_set():
            await _refuse_draining(context)
        with self._tracked():
            deadline = _deadline(context)
            window = asyncio.Semaphore(self.stream_window)
            admitting = asyncio.Semaphore(self.stream_prefetch)
            responses: asyncio.Queue = asyncio.Queue()
            reading_over = object()
            read_count = written_count = 0
            stopped_by_drain = False
            ended_by: EmbedError | None = None  # a message that ended the stream, once answered

            async def answer(request: pb.EmbedRequest) -> None:
                try:
                    try:
                        prepared = await self.gateway.prepare(params_from_request(request, deadline))
                        await self.gateway.wait_for_room(prepared)
                    finally:
                        admitting.release()
                    result = await self.gateway.execute(prepared, wait_first=True)
                    if result.sparse is not None and len(result.sparse) > LOOP_ROWS:
                        response = await asyncio.to_thread(response_from_result, request.request_id, result)
                    else:
                        response = response_from_result(request.request_id, result)
                except EmbedError as error:
                    response = _error_response(request.request_id, error)
                except Exception as error:  # our bug: report it on this request, keep the stream
                    response = _error_response(request.request_id, _internal(error))
                responses.put_nowait(response)

            async def read(group: asyncio.TaskGroup) -> None:
                nonlocal read_count, stopped_by_drain, ended_by
                iterator = aiter(request_iterator)
                try:
                    while True:
                        await window.acquire()
                        await admitting.acquire()
                        request = await self._next_or_drain(iterator)
                        if request is None:
                            stopped_by_drain = self._draining.is_set()
                            return
                        if isinstance(request, Undecodable):
                            # Framing is gRPC's, so later messages could be read, but a client
                            # that sends garbage has lost track of its stream: stop here.
                            ended_by = invalid_argument(
                                f"message {read_count} of this stream: {request.message}; the "
                                f"{read_count} messages before it were answered, none after it "
                                "was read")
                            return
                        read_count += 1
                        group.create_task(answer(request))
                finally:
                    responses.put_nowait(reading_over)

            async with asyncio.TaskGroup() as group:
                group.create_task(read(group))
                reading = True
                while reading or written_count < read_count:
                    item = await responses.get()
                    if item is reading_over:
                        reading = False
                        continue
                    try:
                        await context.write(item)
                    except _CallGone:  # the caller cancelled or its deadline passed
                        raise _gone(None) from None
                    written_count += 1
                    window.release()
            if ended_by is not None:
                await _abort(context, ended_by)
            if stopped_by_drain:
                await _abort(context, unavailable(
                    "the sidecar is draining for shutdown; requests not answered on this stream "
                    "were not read: resend them to another replica"))

    async def _next_or_drain(self, iterator) -> pb.EmbedRequest | None:
        """The next request, or None at the end of the stream or when the sidecar drains."""
        if self._draining.is_set():
            return None
        read = asyncio.ensure_future(anext(iterator, None))
        drain = asyncio.ensure_future(self._draining.wait())
        try:
            await asyncio.wait({read, drain}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            drain.cancel()
        if read.done():
            return read.result()
        read.cancel()
        return None

    async def ListModels(self, request: pb.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> pb.ListModelsResponse:
        if isinstance(request, Undecodable):
            await _abort(context, request.error())
        return pb.ListModelsResponse(models=[model_info(s) for s in self.gateway.models()],
                                     default_model=self.gateway.default_model)

    async def Rerank(self, request: pb.RerankRequest, context: grpc.aio.ServicerContext) -> pb.RerankResponse:
        if self._draining.is_set():
            await _refuse_draining(context)
        with self._tracked():
            try:
                if isinstance(request, Undecodable):
                    raise request.error()
                result = await self.gateway.rerank(rerank_params_from_request(request, _deadline(context)))
            except EmbedError as error:
                await _abort(context, error)
            except Exception as error:  # anything else is our bug: say so, keep serving
                await _abort(context, _internal(error))
            if _ended(context):
                raise _gone(None)
            return response_from_rerank(request.request_id, result)


def rerank_params_from_request(request: pb.RerankRequest, deadline: float | None) -> RerankParams:
    """The gateway's view of a wire Rerank request; unknown enum numbers are INVALID_ARGUMENT."""
    lane = _LANES.get(request.lane)
    if lane is None:
        raise invalid_argument(f"lane: unknown value {request.lane}")
    truncate = _TRUNCATIONS.get(request.truncation)
    if truncate is None:
        raise invalid_argument(f"truncation: unknown value {request.truncation}")
    return RerankParams(query=request.query, documents=request.documents, model=request.model,
                        top_n=request.top_n, raw_scores=request.raw_scores,
                        return_documents=request.return_documents, truncate=truncate, lane=lane,
                        deadline=deadline)


def response_from_rerank(request_id: str, result: RerankResult) -> pb.RerankResponse:
    """The ranked documents, best first."""
    documents = result.documents or [""] * len(result.indices)
    return pb.RerankResponse(
        request_id=request_id, model=result.model, token_counts=result.token_counts,
        results=[pb.RankedDocument(index=i, score=score, document=text) for i, score, text in
                 zip(result.indices.tolist(), result.scores.tolist(), documents)])


def _ended(context: grpc.aio.ServicerContext) -> bool:
    """Whether the caller can no longer hear an answer: it cancelled, or its deadline passed."""
    remaining = context.time_remaining()
    return context.cancelled() or (remaining is not None and remaining <= 0)


def _gone(error: EmbedError | None) -> asyncio.CancelledError:
    """What a handler raises for a call that ended before its answer went out: gRPC takes a
    CancelledError as the normal end of such a call; the log gets one DEBUG line, no traceback."""
    if error is None:
        log.debug("call ended (cancelled, or its deadline passed) before its response was sent")
    else:
        log.debug("call ended (cancelled, or its deadline passed) before its status was sent: %s %s",
                  error.code.name, error.message)
    return asyncio.CancelledError()


async def _refuse_draining(context: grpc.aio.ServicerContext) -> None:
    """UNAVAILABLE for a call that arrives during the drain, before it counts as a call in flight:
    clients that retry against this replica cannot hold its drain open."""
    await _abort(context, unavailable(DRAINING))


async def _abort(context: grpc.aio.ServicerContext, error: EmbedError) -> None:
    metadata = () if error.index is None else ((INPUT_INDEX_KEY, str(error.index)),)
    if _ended(context):
        raise _gone(error)
    try:
        await context.abort(error.code, error.message, metadata)
    except _CallGone:  # it ended while the status was being sent
        raise _gone(error) from None


class TokenAuth(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer <token>` metadata on every call but health checks.

    The token is checked from the call's metadata, before anything of its body is read: a
    denied call is answered by a handler that never reads (nor parses) the request, after
    the back-off the limiter asks for, so a wrong-token 200 MB Embed costs no more than
    its receive window (RECEIVE_WINDOW_BYTES).
    """

    def __init__(self, tokens: TokenSet | str, limiter: AuthLimiter | None = None) -> None:
        self.tokens = tokens if isinstance(tokens, TokenSet) else TokenSet([tokens])
        self.limiter = limiter or AuthLimiter()
        self._denied: dict[tuple[bool, bool], grpc.RpcMethodHandler] = {}  # per streaming kind

    async def intercept_service(self, continuation: Callable[..., Awaitable],
                                details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith("/grpc.health.v1.Health/"):
            return handler
        given = None
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                given = value
                break
        if self.tokens.check_bearer(given):
            return handler
        kind = (handler.request_streaming, handler.response_streaming)
        denied = self._denied.get(kind)
        if denied is None:
            denied = self._denied[kind] = _denied(handler.response_streaming, self.limiter)
        return denied


DENIED_MESSAGE = "missing or wrong token: send metadata 'authorization: Bearer <token>'"


def _denied(response_streaming: bool, limiter: AuthLimiter) -> grpc.RpcMethodHandler:
    """A handler that answers UNAUTHENTICATED without reading the request.

    It is a request-streaming handler whatever the method's kind: gRPC reads a unary
    request in full before calling its handler, a stream's messages only when asked.
    """

    async def deny(request_iterator, context):
        refused = await limiter.penalize(peer_address(context.peer()))
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            DENIED_MESSAGE if refused is None else f"{DENIED_MESSAGE}; {refused}")

    make = grpc.stream_stream_rpc_method_handler if response_streaming else grpc.stream_unary_rpc_method_handler
    return make(deny)


def _bind_unix(server: grpc.aio.Server, spec: UnixSocket) -> int:
    """Add `spec`'s socket file to `server` (plaintext: the file's permissions guard it); its inode."""
    unixsocket.claim(spec.path)
    with unixsocket.owner_only():
        try:
            bound = server.add_insecure_port(spec.address)
        except RuntimeError:  # grpc's "Failed to bind"
            bound = 0
    if bound == 0:
        raise OSError(f"could not bind gRPC on {spec.address}")
    return unixsocket.secure(spec)


def server_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """The gRPC server options a Sidecar runs with (tools/profiling/grpc_floor.py measures them alone)."""
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0), *ADMISSION_OPTIONS, *WINDOW_OPTIONS]


def enable_reflection(server: grpc.aio.Server) -> None:
    """Server reflection for the Embedder and Health services, as a Sidecar offers it."""
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)


class Sidecar:
    """The sidecar's gRPC face: `await Sidecar(registry).start()`, later `await stop()`.

    `port` 0 binds a free port (read `.port` after start). `token` (one) or `tokens` (a
    TokenSet) turns on bearer-token auth, with `limiter` counting failures per address;
    `tls` serves TLS (mutual when it has a client CA). `extras` are other front ends
    sharing the gateway (objects with async start()/stop(), e.g. the Postgres-protocol
    endpoint); they start after the gRPC server and stop first on drain.

    `unix_socket` also listens on a socket file (plaintext: the file's mode and group decide who
    may connect; tokens still apply), removed on stop; `tcp=False` (with `unix_socket`) listens on
    no TCP port, and `.target` is then the socket's "unix:/path".
    """

    def __init__(self, registry: Registry, *, host: str = "127.0.0.1", port: int = 50051,
                 token: str | None = None, tokens: TokenSet | None = None,
                 tls: TlsSettings | None = None, limiter: AuthLimiter | None = None,
                 max_message_bytes: int = MAX_MESSAGE_BYTES,
                 stream_window: int = STREAM_WINDOW, max_inputs: int | None = None,
                 max_connection_age_s: float | None = None,
                 unix_socket: UnixSocket | None = None, tcp: bool = True,
                 sparse_language: str = DEFAULT_LANGUAGE) -> None:
        if not tcp and unix_socket is None:
            raise ValueError("a sidecar without TCP needs a Unix socket to listen on")
        self.registry = registry
        self.unix_socket = unix_socket
        self.tcp = tcp
        self._socket_inode: int | None = None
        self._max_connection_age_s = max_connection_age_s
        self.host = host
        self.port = port
        self.tokens = tokens if tokens is not None else TokenSet([token] if token else [])
        self.token = self.tokens.first()
        self.tls = tls
        self.limiter = limiter or AuthLimiter()
        self.gateway = Gateway(registry, max_inputs=MAX_INPUTS if max_inputs is None else max_inputs,
                               sparse_language=sparse_language)
        self.service = EmbedderService(self.gateway, stream_window=stream_window)
        self.health = health.aio.HealthServicer()
        self.extras: list = []
        self._max_message_bytes = max_message_bytes
        self._server: grpc.aio.Server | None = None
        self._stopped = asyncio.Event()
        self._stopping = False

    @property
    def target(self) -> str:
        """The address clients use: "host:port", or "unix:/path" when there is no TCP listener."""
        if not self.tcp:
            return self.unix_socket.address
        return self._tcp_target

    @property
    def _tcp_target(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def addresses(self) -> list[str]:
        """Every address the gRPC server listens on."""
        return [*([self._tcp_target] if self.tcp else []),
                *([self.unix_socket.address] if self.unix_socket is not None else [])]

    async def start(self) -> None:
        """Start the schedulers, bind and start the server, then report SERVING."""
        await self.registry.start()
        # The request log comes first, so that refused tokens are logged too.
        interceptors = [RequestLogInterceptor(), *([TokenAuth(self.tokens, self.limiter)] if self.tokens else [])]
        server = grpc.aio.server(interceptors=interceptors, options=server_options(self._max_message_bytes)
                                 + balancing.server_options(self._max_connection_age_s))
        add_embedder(self.service, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        enable_reflection(server)
        if self.tcp:
            try:
                if self.tls is None:
                    bound = server.add_insecure_port(self._tcp_target)
                else:
                    bound = server.add_secure_port(self._tcp_target, self.tls.grpc_credentials())
            except RuntimeError:  # grpc's "Failed to bind"
                bound = 0
            if bound == 0:
                raise OSError(f"could not bind {self._tcp_target} (port in use, or not an "
                              "address of this host?)")
            self.port = bound
        if self.unix_socket is not None:
            self._socket_inode = _bind_unix(server, self.unix_socket)
        try:
            await server.start()
            self._server = server
            for extra in self.extras:
                await extra.start()
        except BaseException:  # a door that failed to start: leave no socket file behind
            if self.unix_socket is not None:
                unixsocket.remove(self.unix_socket.path, self._socket_inode)
            raise
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info("fern sidecar serving %s on %s%s", ", ".join(s.name for s in self.gateway.models()),
                 ", ".join(self.addresses), "" if self.tls is None or not self.tcp
                 else " (TLS, client certificates required)" if self.tls.mutual else " (TLS)")

    async def stop(self, grace: float = DEFAULT_GRACE_S) -> None:
        """Drain and stop: NOT_SERVING, refuse new calls, finish calls in flight, close."""
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        await self.health.enter_graceful_shutdown()
        # Extras first: the Postgres worker finishes its batch while gRPC still takes it.
        for extra in reversed(self.extras):
            await extra.stop()
        loop = asyncio.get_running_loop()
        drain_ends = loop.time() + grace
        self.service.begin_drain()
        if self._server is not None:
            # The server keeps taking calls while those in flight finish, so that a new call reaches
            # a handler and is refused with UNAVAILABLE, which clients retry elsewhere: once gRPC's
            # own shutdown has begun, it cancels a call that arrives on an open connection, and a
            # bare CANCELLED is not retried.
            if not await self.service.wait_idle(grace):
                log.warning("calls still running after %.1fs of drain; cancelling them", grace)
            # What is left of `grace` goes to calls gRPC has accepted that are not yet in a handler
            # (held by the auth back-off, or with a body still arriving), which the service's own
            # count cannot see. Calls still running after it are cancelled, dropping queued work.
            await self._server.stop(max(0.0, drain_ends - loop.time()))
        if self.unix_socket is not None:
            unixsocket.remove(self.unix_socket.path, self._socket_inode)
        await self.registry.drain()
        self.registry.close()
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()
