"""Typed Python client for the Fern sidecar (sync and async), returning numpy arrays.

It imports only grpc, protobuf and numpy, so adapters and their workers install and run on a
database host without torch.

FernClient and AsyncFernClient are thin twins over one core (_ClientCore and the module's
functions: requests, decoding, errors) rather than one generated from the other: grpc and
grpc.aio already give both call styles over the same stubs, so only the calls differ.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterable, AsyncIterator, Iterable, Iterator, Sequence

import grpc
import grpc.aio
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sidecar import encodings
from sidecar.balancing import channel_options, channel_target
from sidecar.errors import INPUT_INDEX_KEY
from sidecar.security import ClientTls
from sidecar.wire import embedder_pb2 as pb
from sidecar.wire import embedder_pb2_grpc as pb_grpc

DEFAULT_TARGET = "127.0.0.1:50051"
# Vectors of a 100-text request at 4096 dims in float32 are ~1.6 MB; long requests more.
_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
# The sidecar runs on the same host, so reconnecting is cheap: retry a refused connection
# at most 1 s apart (gRPC's default backoff grows to 120 s, so a client that saw the sidecar
# down for a while kept failing for seconds to minutes after it came back).
_RECONNECT_BACKOFF_MS = 1000
_CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", _RECONNECT_BACKOFF_MS),
)

# Calls one client has in flight at once; more wait in the client for a free slot. A burst of
# thousands of calls then reaches the sidecar as a steady queue instead of all at once (each
# pending call costs memory on both sides). Set `client.max_in_flight` before the first call
# to change it; None lifts the bound.
DEFAULT_MAX_IN_FLIGHT = 512

_LANES = {"online": pb.LANE_ONLINE, "batch": pb.LANE_BATCH}
_STATUS_BY_NUMBER = {status.value[0]: status for status in grpc.StatusCode}


class FernError(Exception):
    """A request the sidecar refused or could not serve, with the gRPC status and input index."""

    def __init__(self, code: grpc.StatusCode, message: str, index: int | None = None):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.index = index

    @classmethod
    def from_rpc_error(cls, err: grpc.RpcError) -> "FernError":
        code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
        details = err.details() if callable(getattr(err, "details", None)) else str(err)
        return cls(code, details or code.name, _index_from_metadata(err))


class InvalidRequest(FernError, ValueError):
    """A request the client refuses before sending it (INVALID_ARGUMENT, naming the input):
    a value the wire cannot carry, such as a negative `dimensions` or a token id over 2**32."""

    def __init__(self, message: str, index: int | None = None):
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message, index)


_UINT32_MAX = 2**32 - 1


def _check_uint32(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidRequest(f"{name}: expected an integer, got {type(value).__name__} {value!r}")
    if not 0 <= value <= _UINT32_MAX:
        raise InvalidRequest(f"{name}: {value} is out of range (0..{_UINT32_MAX})")


def _located(field_name: str, items: Sequence, check) -> InvalidRequest:
    """The InvalidRequest naming the first of `items` that `check` refuses (protobuf said one is bad)."""
    for i, item in enumerate(items):
        try:
            check(item)
        except (TypeError, ValueError) as error:
            return InvalidRequest(f"{field_name}[{i}]: {error}", i)
    return InvalidRequest(f"{field_name}: not a sequence the request can carry")


def _check_ids(ids) -> None:
    if isinstance(ids, (str, bytes)):
        raise TypeError(f"expected a sequence of token ids, got {type(ids).__name__}")
    for k, token in enumerate(ids):
        try:
            _check_uint32("token id", token)
        except InvalidRequest as error:
            raise ValueError(f"position {k}: {error.message}") from None


def _check_text(text) -> None:
    if not isinstance(text, str):
        raise TypeError(f"expected str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"a lone surrogate at position {error.start}, which UTF-8 cannot carry") from None


@dataclass(frozen=True)
class SparseVector:
    """A sparse vector: indices ascending (uint32) and their weights (float32); BM25 lexical
    terms and saturated term frequencies for a model without a learned sparse head."""

    indices: np.ndarray
    values: np.ndarray


@dataclass(frozen=True)
class Embeddings:
    """The vectors of one request: `vectors` has one row per input, in input order."""

    vectors: np.ndarray
    dimensions: int
    encoding: str
    token_counts: np.ndarray
    model: str
    request_id: str = ""
    sparse: list[SparseVector] | None = None
    # With multivector=True: one float32 [n_i, dim] array per input (ColBERT vectors, views
    # into one buffer).
    multivectors: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return self.vectors.shape[0]


@dataclass(frozen=True)
class StreamResult:
    """One EmbedStream response: either `embeddings` or `error` is set."""

    request_id: str
    embeddings: Embeddings | None = None
    error: FernError | None = None


@dataclass(frozen=True)
class ModelInfo:
    """A model the sidecar serves, as ListModels describes it."""

    name: str
    dimensions: int
    max_tokens: int
    pooling: str
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str = ""
    normalize: bool = True
    matryoshka_dimensions: tuple[int, ...] = ()
    vocab_size: int = 0
    distance: str = "cosine"
    native_int8: bool = False
    learned_sparse: bool = False  # sparse vectors are the model's learned weights (BGE-M3)
    multivector_dimensions: int = 0  # width of its multi-vectors (ColBERT head); 0: none
    kind: str = "embedding"  # "reranker": served through rerank(), not embed()

    @property
    def outputs(self) -> tuple[str, ...]:
        """What the model can return: "dense", "sparse" (lexical or learned) and, with a ColBERT head,
        "multivector"; a reranker returns "score" (through rerank())."""
        if self.kind == "reranker":
            return ("score",)
        return ("dense", "sparse") + (("multivector",) if self.multivector_dimensions else ())


@dataclass(frozen=True)
class RankedDocument:
    """One reranked document: its position in the request, its score, and its text when asked for."""

    index: int
    score: float
    document: str | None = None


@dataclass(frozen=True)
class Reranking:
    """A rerank's answer: `results` best first (top_n of them, or all), every pair's token count."""

    model: str
    results: list[RankedDocument]
    token_counts: list[int]

    def __len__(self) -> int:
        return len(self.results)

    @property
    def indices(self) -> list[int]:
        """The documents' positions in the request, best first."""
        return [r.index for r in self.results]


def rerank_request(query: str, documents: Sequence[str], *, model: str = "", top_n: int = 0,
                   raw_scores: bool = False, return_documents: bool = False, truncate: bool = True,
                   lane: str = "online", request_id: str = "") -> pb.RerankRequest:
    """The Rerank request for these arguments; a value the wire cannot carry is refused here, naming it."""
    if isinstance(documents, str):
        raise InvalidRequest("documents: expected a list of strings, got one string")
    if lane not in _LANES:
        raise InvalidRequest(f"lane: {lane!r} is not one of {', '.join(_LANES)}")
    if isinstance(top_n, bool) or not isinstance(top_n, int) or not 0 <= top_n < 2 ** 32:
        raise InvalidRequest(f"top_n: {top_n!r} is not a count (0 for every document)")
    if not isinstance(query, str):
        raise InvalidRequest(f"query: expected a string, got {type(query).__name__}")
    documents = list(documents)
    for i, document in enumerate(documents):
        if not isinstance(document, str):
            raise InvalidRequest(f"documents[{i}]: expected a string, got {type(document).__name__}", i)
    return pb.RerankRequest(request_id=request_id, model=model, query=query, documents=documents, top_n=top_n,
                            raw_scores=raw_scores, return_documents=return_documents,
                            truncation=pb.TRUNCATION_END if truncate else pb.TRUNCATION_ERROR,
                            lane=_LANES[lane])


def decode_rerank(resp: pb.RerankResponse, return_documents: bool) -> Reranking:
    """A RerankResponse as a Reranking (documents only when they were asked for)."""
    return Reranking(model=resp.model, token_counts=list(resp.token_counts), results=[
        RankedDocument(r.index, r.score, r.document if return_documents else None) for r in resp.results])


@dataclass(frozen=True)
class EmbedOptions:
    """Per-request options shared by embed, embed_tokens and embed_stream."""

    model: str = ""
    lane: str = "online"
    prompt: str | None = None
    normalize: bool | None = None
    truncate: bool = True
    dimensions: int = 0
    encoding: str = "float32"
    sparse: bool = False
    multivector: bool = False

    def request(self, request_id: str = "", texts: Sequence[str] | None = None,
                token_ids: Sequence[Sequence[int]] | None = None) -> pb.EmbedRequest:
        if isinstance(texts, str):
            raise TypeError("texts must be a sequence of strings, not one string")
        req = pb.EmbedRequest(request_id=request_id)
        req.MergeFrom(self._options_message)
        if texts is not None:
            try:
                req.texts.extend(texts)
            except (TypeError, ValueError):  # protobuf's own message names no input
                raise _located("texts", list(texts), _check_text) from None
        if token_ids is not None:
            try:
                req.token_ids.extend(pb.TokenIds(ids=list(ids)) for ids in token_ids)
            except (TypeError, ValueError):
                raise _located("token_ids", list(token_ids), _check_ids) from None
        return req

    @functools.cached_property
    def _options_message(self) -> pb.EmbedRequest:
        """These options as a request with no inputs: checked and built once, merged into each request."""
        if self.lane not in _LANES:
            raise InvalidRequest(f"lane must be one of {sorted(_LANES)}, got {self.lane!r}")
        if self.encoding not in encodings.BY_NAME:
            raise InvalidRequest(f"encoding must be one of {sorted(encodings.NAMES)}, got {self.encoding!r}")
        # The sidecar checks it against the model; here only what the wire (uint32) cannot carry.
        _check_uint32("dimensions", self.dimensions)
        req = pb.EmbedRequest(
            model=self.model,
            lane=_LANES[self.lane],
            prompt_name=self.prompt or "",
            truncation=pb.TRUNCATION_END if self.truncate else pb.TRUNCATION_ERROR,
            dimensions=self.dimensions,
            encoding=encodings.BY_NAME[self.encoding].wire,
            return_sparse=self.sparse,
            return_multivector=self.multivector,
        )
        if self.normalize is not None:
            req.normalize = self.normalize
        return req


_DEFAULT_OPTIONS = EmbedOptions()


def _options(options: dict) -> EmbedOptions:
    """The EmbedOptions of a call's keyword arguments (the shared default one when there are none)."""
    return EmbedOptions(**options) if options else _DEFAULT_OPTIONS


def _array(repeated, dtype: type) -> np.ndarray:
    """A protobuf repeated scalar field as a numpy array.

    np.fromiter, not np.asarray: asarray probes the container for the array protocols
    before it iterates, which cost ~0.1 ms per call on a query's path (measured, 2-core host).
    """
    return np.fromiter(repeated, dtype=dtype, count=len(repeated))


def decode_response(resp: pb.EmbedResponse) -> Embeddings:
    """Turns an EmbedResponse into numpy arrays without one Python object per value."""
    encoding = encodings.BY_WIRE[resp.encoding]
    cols = encoding.columns(resp.dimensions)
    vectors = np.frombuffer(resp.vectors, dtype=encoding.dtype).reshape(resp.count, cols)
    sparse = None
    if len(resp.sparse):
        sparse = [SparseVector(_array(s.indices, np.uint32), _array(s.values, np.float32))
                  for s in resp.sparse]
    multivectors = _multivectors(resp) if len(resp.multivector_counts) else None
    return Embeddings(
        vectors=vectors,
        dimensions=resp.dimensions,
        encoding=encoding.name,
        token_counts=_array(resp.token_counts, np.int64),
        model=resp.model,
        request_id=resp.request_id,
        sparse=sparse,
        multivectors=multivectors,
    )


def _multivectors(resp: pb.EmbedResponse) -> list[np.ndarray]:
    """The packed multi-vector buffer as one [n_i, dim] float32 view per input."""
    dim = resp.multivector_dimensions
    rows = np.frombuffer(resp.multivectors, dtype="<f4").reshape(-1, dim) if dim else np.zeros((0, 0), "<f4")
    counts = _array(resp.multivector_counts, np.int64)
    if counts.sum() != rows.shape[0]:
        raise ValueError(f"response {resp.request_id!r}: multivector_counts add up to {counts.sum()} rows, "
                         f"the buffer holds {rows.shape[0]}")
    return np.split(rows, np.cumsum(counts)[:-1])


def _stream_result(resp: pb.EmbedResponse) -> StreamResult:
    if resp.HasField("error"):
        index = resp.error.index if resp.error.index >= 0 else None
        code = _STATUS_BY_NUMBER.get(resp.error.code, grpc.StatusCode.UNKNOWN)
        err = FernError(code, resp.error.message, index)
        return StreamResult(resp.request_id, error=err)
    return StreamResult(resp.request_id, embeddings=decode_response(resp))


def _index_from_metadata(err: grpc.RpcError) -> int | None:
    trailing = err.trailing_metadata() if callable(getattr(err, "trailing_metadata", None)) else None
    for key, value in trailing or ():
        if key == INPUT_INDEX_KEY:
            return int(value)
    return None


def _model_info(m: pb.ModelInfo) -> ModelInfo:
    return ModelInfo(
        name=m.name,
        dimensions=m.dimensions,
        max_tokens=m.max_tokens,
        pooling=m.pooling,
        prompts={p.name: p.text for p in m.prompts},
        default_prompt_name=m.default_prompt_name,
        normalize=m.normalize,
        matryoshka_dimensions=tuple(m.matryoshka_dimensions),
        vocab_size=m.vocab_size,
        distance=m.distance,
        native_int8=m.native_int8,
        learned_sparse=m.learned_sparse,
        multivector_dimensions=m.multivector_dimensions,
        kind=m.kind or "embedding",
    )


def _stream_request(item, n: int, options: EmbedOptions) -> pb.EmbedRequest:
    """A stream item is an EmbedRequest, a (request_id, texts) pair, or texts (id = position)."""
    if isinstance(item, pb.EmbedRequest):
        return item
    request_id, texts = item if isinstance(item, tuple) else (n, item)
    return options.request(str(request_id), texts=texts)


def _stream_items(items: Iterable, options: EmbedOptions) -> Iterator[pb.EmbedRequest]:
    for n, item in enumerate(items):
        yield _stream_request(item, n, options)


def _ordered_models(resp: pb.ListModelsResponse) -> list[ModelInfo]:
    models = [_model_info(m) for m in resp.models]
    return sorted(models, key=lambda m: m.name != resp.default_model)


def _pick_model(resp: pb.ListModelsResponse, name: str) -> ModelInfo:
    wanted = name or resp.default_model
    for m in resp.models:
        if m.name == wanted:
            return _model_info(m)
    served = ", ".join(m.name for m in resp.models)
    raise FernError(grpc.StatusCode.NOT_FOUND, f"model {wanted!r} is not served here (served: {served})")


def _auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def client_tls(tls: bool | None = None, tls_ca: str | os.PathLike | None = None,
               tls_client_cert: str | os.PathLike | None = None,
               tls_client_key: str | os.PathLike | None = None,
               tls_server_name: str | None = None) -> ClientTls | None:
    """The client's TLS settings, each falling back to its FERN_TLS_… variable; None for plaintext.

    TLS is on when `tls` is True or any file is given; `tls_ca` None then trusts the
    system's roots.
    """
    env = os.environ.get
    ca = tls_ca or env("FERN_TLS_CA") or None
    cert = tls_client_cert or env("FERN_TLS_CLIENT_CERT") or None
    key = tls_client_key or env("FERN_TLS_CLIENT_KEY") or None
    name = tls_server_name or env("FERN_TLS_SERVER_NAME") or None
    if tls is False or not (tls or ca or cert or key):
        return None
    return ClientTls(Path(ca) if ca else None, Path(cert) if cert else None,
                     Path(key) if key else None, name)


def _make_channel(module, target: str, tls: ClientTls | None):
    """A plaintext or TLS channel of `module` (grpc or grpc.aio) with the client's options.

    A target naming several sidecars is balanced round-robin with retries (sidecar.balancing)."""
    options = _CHANNEL_OPTIONS + channel_options(target)
    target = channel_target(target)
    if tls is None:
        return module.insecure_channel(target, options=options)
    return module.secure_channel(target, tls.grpc_credentials(), options=options + tls.grpc_options())


class _RaiseFernError:
    """A context manager that re-raises a grpc.RpcError as the FernError it means (status, message, index).

    A class rather than contextlib.contextmanager: it is entered on every call, and this costs less.
    """

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None and issubclass(exc_type, grpc.RpcError):
            raise FernError.from_rpc_error(exc) from None
        return False


_RPC_ERRORS = _RaiseFernError()


class _ClientCore:
    """What FernClient and AsyncFernClient share: the connection, the calls' arguments and errors.

    The twins add only the calls themselves (blocking or awaited) and their in-flight bound
    (a thread or an asyncio semaphore), so they cannot drift apart in what they send or raise.
    """

    max_in_flight: int | None = DEFAULT_MAX_IN_FLIGHT

    def _connect(self, module, target: str | None, token: str | None, timeout: float | None,
                 channel, tls_args: tuple) -> None:
        """Opens the channel (of `module`, grpc or grpc.aio, unless `channel` is given) and its stubs."""
        self.target = target or os.environ.get("FERN_TARGET", DEFAULT_TARGET)
        self._channel = channel or _make_channel(module, self.target, client_tls(*tls_args))
        self._stub = pb_grpc.EmbedderStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._metadata = _auth_metadata(token if token is not None else os.environ.get("FERN_TOKEN"))
        self.timeout = timeout

    def _open_stream(self, requests, timeout: float | None):
        """The EmbedStream call over `requests` (an iterator, or an async one on grpc.aio)."""
        return self._stub.EmbedStream(requests, metadata=self._metadata, timeout=timeout or self.timeout)

    def _list_models_call(self, timeout: float | None):
        """The ListModels call: its response, or on grpc.aio the awaitable of it."""
        return self._stub.ListModels(pb.ListModelsRequest(), metadata=self._metadata,
                                     timeout=timeout or self.timeout)

    def _health_call(self, timeout: float):
        return self._health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)

    def _embed_call(self, request: pb.EmbedRequest, timeout: float | None):
        return self._stub.Embed(request, metadata=self._metadata, timeout=timeout)

    def _rerank_call(self, request: pb.RerankRequest, timeout: float | None):
        return self._stub.Rerank(request, metadata=self._metadata, timeout=timeout)

    def _no_slot(self) -> FernError:
        return FernError(grpc.StatusCode.DEADLINE_EXCEEDED,
                         f"the deadline passed while waiting for one of this client's "
                         f"{self.max_in_flight} call slots (max_in_flight)")


def _stream_options(options: dict) -> EmbedOptions:
    """A stream's options: the BATCH lane unless told otherwise."""
    options.setdefault("lane", "batch")
    return EmbedOptions(**options)


def _serving(resp: health_pb2.HealthCheckResponse) -> bool:
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def _remaining(timeout: float | None, started: float) -> float | None:
    """What is left of `timeout` after waiting since `started` for a call slot."""
    return None if timeout is None else max(0.0, timeout - (time.monotonic() - started))


class FernClient(_ClientCore):
    """Blocking client. `FernClient()` talks to $FERN_TARGET or 127.0.0.1:50051.

    TLS: `tls_ca` (the CA that signed the sidecar's certificate; `tls=True` alone trusts
    the system's roots), and for mutual TLS `tls_client_cert` + `tls_client_key`; each
    falls back to FERN_TLS_CA, FERN_TLS_CLIENT_CERT, FERN_TLS_CLIENT_KEY.

        FernClient("gpu-box:50051", token="…", tls_ca="ca.pem")

    It is safe to share between threads; at most `max_in_flight` calls are in flight at once
    (DEFAULT_MAX_IN_FLIGHT; None: no bound), the others wait their turn in the client.
    """

    _slots: threading.BoundedSemaphore | None = None
    _slots_lock = threading.Lock()

    def _in_flight_slots(self) -> threading.BoundedSemaphore | None:
        if self.max_in_flight is None:
            return None
        if self._slots is None:
            with self._slots_lock:
                if self._slots is None:
                    self._slots = threading.BoundedSemaphore(self.max_in_flight)
        return self._slots

    def __init__(self, target: str | None = None, *, token: str | None = None,
                 timeout: float | None = None, channel: grpc.Channel | None = None,
                 tls: bool | None = None, tls_ca: str | os.PathLike | None = None,
                 tls_client_cert: str | os.PathLike | None = None,
                 tls_client_key: str | os.PathLike | None = None,
                 tls_server_name: str | None = None):
        self._connect(grpc, target, token, timeout, channel,
                      (tls, tls_ca, tls_client_cert, tls_client_key, tls_server_name))

    def embed(self, texts: Sequence[str], *, timeout: float | None = None, **options) -> Embeddings:
        """Embeds texts; options are EmbedOptions' fields (model, lane, prompt, normalize, ...)."""
        return self._call(_options(options).request(texts=texts), timeout)

    def embed_tokens(self, token_ids: Sequence[Sequence[int]], *, timeout: float | None = None,
                     **options) -> Embeddings:
        """Embeds pre-tokenized inputs (special tokens included)."""
        return self._call(_options(options).request(token_ids=token_ids), timeout)

    def embed_stream(self, items: Iterable, *, timeout: float | None = None,
                     **options) -> Iterator[StreamResult]:
        """Streams requests through EmbedStream (BATCH lane unless told otherwise).

        `items` yields (request_id, texts) pairs, lists of texts (ids are their positions) or
        ready EmbedRequests. gRPC pulls the next item only when the server has read the
        previous ones, so memory stays bounded on both sides. Results may come out of order.
        """
        call = self._open_stream(_stream_items(items, _stream_options(options)), timeout)
        try:
            with _RPC_ERRORS:
                for resp in call:
                    yield _stream_result(resp)
        finally:
            call.cancel()

    def list_models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        """The served models, the default one first."""
        with _RPC_ERRORS:
            return _ordered_models(self._list_models_call(timeout))

    def model(self, name: str = "", *, timeout: float | None = None) -> ModelInfo:
        """The ModelInfo of `name`, or of the default model when `name` is empty."""
        with _RPC_ERRORS:
            return _pick_model(self._list_models_call(timeout), name)

    def health(self, *, timeout: float = 5.0) -> bool:
        """True when the sidecar reports SERVING."""
        try:
            return _serving(self._health_call(timeout))
        except grpc.RpcError:
            return False

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Blocks until the sidecar is SERVING; raises FernError(UNAVAILABLE) after `timeout`."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise FernError(grpc.StatusCode.UNAVAILABLE,
                            f"no sidecar answered at {self.target} within {timeout:g}s") from None
        deadline = time.monotonic() + timeout
        while not self.health(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise FernError(grpc.StatusCode.UNAVAILABLE,
                                f"sidecar at {self.target} is not SERVING after {timeout:g}s")
            time.sleep(0.05)

    def _call(self, request: pb.EmbedRequest, timeout: float | None) -> Embeddings:
        return decode_response(self._unary(self._embed_call, request, timeout))

    def rerank(self, query: str, documents: Sequence[str], *, timeout: float | None = None,
               **options) -> Reranking:
        """Scores `documents` against `query` with a reranker, best first.

        Options: model, top_n (0: all), raw_scores (logits instead of sigmoid in 0..1),
        return_documents, truncate (cut a document's end to fit; the query is never cut), lane.

            client.rerank("what is a vector database?", docs, top_n=3).indices
        """
        request = rerank_request(query, documents, **options)
        return decode_rerank(self._unary(self._rerank_call, request, timeout), request.return_documents)

    def _unary(self, call, request, timeout: float | None):
        """A unary `call` within this client's in-flight bound."""
        slots = self._in_flight_slots()
        timeout = timeout or self.timeout
        if slots is not None:
            started = time.monotonic()
            if not slots.acquire(timeout=-1 if timeout is None else timeout):
                raise self._no_slot()
            timeout = _remaining(timeout, started)
        try:
            with _RPC_ERRORS:
                return call(request, timeout)
        finally:
            if slots is not None:
                slots.release()

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "FernClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncFernClient(_ClientCore):
    """asyncio client with the same methods as FernClient, awaited; at most `max_in_flight`
    unary calls in flight at once (DEFAULT_MAX_IN_FLIGHT; None: no bound)."""

    _slots: asyncio.Semaphore | None = None

    def __init__(self, target: str | None = None, *, token: str | None = None,
                 timeout: float | None = None, tls: bool | None = None,
                 tls_ca: str | os.PathLike | None = None,
                 tls_client_cert: str | os.PathLike | None = None,
                 tls_client_key: str | os.PathLike | None = None,
                 tls_server_name: str | None = None):
        self._connect(grpc.aio, target, token, timeout, None,
                      (tls, tls_ca, tls_client_cert, tls_client_key, tls_server_name))

    async def embed(self, texts: Sequence[str], *, timeout: float | None = None,
                    **options) -> Embeddings:
        return await self._call(_options(options).request(texts=texts), timeout)

    async def embed_tokens(self, token_ids: Sequence[Sequence[int]], *,
                           timeout: float | None = None, **options) -> Embeddings:
        return await self._call(_options(options).request(token_ids=token_ids), timeout)

    async def embed_stream(self, items: Iterable | AsyncIterable, *,
                           timeout: float | None = None, **options) -> AsyncIterator[StreamResult]:
        """Async twin of FernClient.embed_stream; `items` may be a sync or async iterable."""
        opts = _stream_options(options)

        async def requests() -> AsyncIterator[pb.EmbedRequest]:
            if hasattr(items, "__aiter__"):
                n = 0
                async for item in items:
                    yield _stream_request(item, n, opts)
                    n += 1
            else:
                for req in _stream_items(items, opts):
                    yield req

        call = self._open_stream(requests(), timeout)
        try:
            with _RPC_ERRORS:
                async for resp in call:
                    yield _stream_result(resp)
        finally:
            call.cancel()

    async def list_models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        with _RPC_ERRORS:
            return _ordered_models(await self._list_models_call(timeout))

    async def model(self, name: str = "", *, timeout: float | None = None) -> ModelInfo:
        with _RPC_ERRORS:
            return _pick_model(await self._list_models_call(timeout), name)

    async def health(self, *, timeout: float = 5.0) -> bool:
        try:
            return _serving(await self._health_call(timeout))
        except grpc.RpcError:
            return False

    async def _call(self, request: pb.EmbedRequest, timeout: float | None) -> Embeddings:
        return decode_response(await self._unary(self._embed_call, request, timeout))

    async def rerank(self, query: str, documents: Sequence[str], *, timeout: float | None = None,
                     **options) -> Reranking:
        """Async twin of FernClient.rerank."""
        request = rerank_request(query, documents, **options)
        return decode_rerank(await self._unary(self._rerank_call, request, timeout), request.return_documents)

    async def _unary(self, call, request, timeout: float | None):
        """A unary `call`, awaited within this client's in-flight bound."""
        timeout = timeout or self.timeout
        if self.max_in_flight is not None:
            if self._slots is None:
                self._slots = asyncio.Semaphore(self.max_in_flight)
            started = time.monotonic()
            try:
                await asyncio.wait_for(self._slots.acquire(), timeout)
            except TimeoutError:
                raise self._no_slot() from None
            timeout = _remaining(timeout, started)
        try:
            with _RPC_ERRORS:
                return await call(request, timeout)
        finally:
            if self.max_in_flight is not None:
                self._slots.release()

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncFernClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
