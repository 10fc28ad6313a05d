"""The gateway: validates a request, applies the prompt template, tokenizes, splits, schedules, encodes.

Every caller of the engine goes through `Gateway.embed` (the gRPC server, the
Postgres-protocol endpoint, `fern embed --local`), so they all get the same checks and
the same error messages. Errors are `EmbedError`s whose message names the input
(``texts[3]: empty text``).

A request is tokenized in parallel slices on the tokenizer's worker threads (never on the
event loop, so steps keep flowing to the GPU meanwhile) and handed to the scheduler in
chunks of at most CHUNK_TEXTS inputs and never more tokens than the lane may queue. The
first chunk of a unary request meets the lane's bound as it is (RESOURCE_EXHAUSTED when
full); later chunks of an admitted request wait their turn for room, so a big request
flows through bounded queues instead of failing half way.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from core_engine.config import ModelSpec
from core_engine.postprocess import finalize
from core_engine.token_outputs import learned_sparse
from sidecar import encodings
from sidecar.errors import EmbedError, deadline_exceeded, invalid_argument, resource_exhausted, unavailable
from sidecar.lexical import DEFAULT_LANGUAGE, UnknownLanguage, check_language
from sidecar.registry import Registry, ServedModel
from sidecar.scheduler import DeadlineExceeded, Draining, Lane, QueueFull
from sidecar.sparse import is_query, sparse_vectors
from sidecar.tokenize import TextTokenizer
from sidecar.tokenize.pairs import PairTokenizer

ENCODINGS = encodings.NAMES
# Inputs one request may carry; bigger jobs belong on EmbedStream (bounded memory both sides).
MAX_INPUTS = 8192
# Inputs per scheduler chunk.
CHUNK_TEXTS = 256
# Rows of per-row Python work (sparse vectors, their response fields) done on the event loop;
# a request with more has it done on a worker thread, so that one 8,192-text request does not
# hold the loop (health checks, other requests' steps) for seconds.
LOOP_ROWS = 256
# Prompt names every model accepts: where the model defines no such prompt, they add no text,
# so callers (adapters) can always say what the input is without knowing the model.
GENERIC_PROMPTS = ("query", "passage", "document")
# A character a text must hold to be embedded: anything but whitespace, control characters and
# the invisible format characters (soft hyphen, zero-width space and joiners, bidi marks, BOM,
# tags). A text of only those carries nothing to embed: every such text would get the same
# vector (the tokenizer drops them all), so like "" it is refused rather than indexed as noise.
_VISIBLE = re.compile("[^\\s\x00-\x1f\x7f-\x9f\xad\u061c\u180e\u200b-\u200f\u202a-\u202e"
                      "\u2060-\u2064\u2066-\u206f\ufeff\U000e0001\U000e0020-\U000e007f]").search
# Documents one Rerank request may carry (Cohere's recommended bound): a reranker scores the
# candidates of one search, and each is a full pair through the model.
MAX_DOCUMENTS = 1000
# UNAVAILABLE's message once the sidecar drains, whether the gateway or the scheduler saw it first.
DRAINING = "the sidecar is draining for shutdown; retry on another replica"


@dataclass(frozen=True)
class EmbedParams:
    """One embedding request, as every front end (gRPC, pgwire, CLI) describes it.

    Exactly one of `texts` and `token_ids` is non-empty. `model` "" is the default model;
    `prompt_name` "" the model's default prompt; `normalize` None the model's default;
    `dimensions` 0 the full dimension; `deadline` is a time.monotonic() instant or None.
    `dense=False` (with `return_sparse`) answers the sparse vectors alone: they come from the
    text, so no engine step runs and `vectors` has no columns; `sparse_language` is their
    language ("" the gateway's default). A model with a learned sparse head (BGE-M3's
    sparse_linear.pt) answers `return_sparse` with that head's weights instead, from an
    engine step. `return_multivector` asks for the ColBERT head's vectors (models with
    colbert_linear.pt only).
    """

    texts: Sequence[str] = ()
    token_ids: Sequence[Sequence[int]] = ()
    model: str = ""
    lane: Lane = Lane.ONLINE
    prompt_name: str = ""
    normalize: bool | None = None
    truncate: bool = True
    dimensions: int = 0
    encoding: str = "float32"
    return_sparse: bool = False
    dense: bool = True
    deadline: float | None = None
    return_multivector: bool = False
    sparse_language: str = ""


@dataclass(frozen=True)
class EmbedResult:
    """Encoded vectors [N, cols] in input order ('<f4', '<f2', int8, or packbits uint8 rows)."""

    model: str
    vectors: np.ndarray
    dimensions: int
    encoding: str
    token_counts: list[int]
    sparse: list[tuple[np.ndarray, np.ndarray]] | None = None
    # One float32 [n_i, dim] array per input when return_multivector was set (ColBERT vectors,
    # L2-normalized, one per token after CLS).
    multivectors: list[np.ndarray] | None = None


@dataclass
class PreparedRequest:
    """A validated, tokenized request, ready for the scheduler."""

    params: EmbedParams
    served: ServedModel
    # Token id lists, or int32 arrays where a tokenizer worker process made them.
    sequences: list[Sequence[int]]
    dimensions: int
    normalize: bool
    sparse_ids: list[list[int]] | None = field(default=None, repr=False)
    # The sparse vectors come from the model's learned sparse head (an engine step), not the text.
    learned_sparse: bool = False
    # The texts the BM25 sparse vectors are made from (None: none asked for, or learned ones).
    sparse_texts: list[str] | None = field(default=None, repr=False)
    sparse_language: str = DEFAULT_LANGUAGE

    @property
    def token_outputs(self) -> bool:
        """Whether the engine steps must return the token heads' rows."""
        return self.learned_sparse or self.params.return_multivector

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.sequences)


class Gateway:
    """Front door to the engines: `await gateway.embed(EmbedParams(texts=[...]))`,
    `await gateway.rerank(RerankParams(query, documents))` for a reranker."""

    max_documents: int = MAX_DOCUMENTS  # per Rerank request

    def __init__(self, registry: Registry, *, max_inputs: int = MAX_INPUTS,
                 chunk_texts: int = CHUNK_TEXTS, sparse_language: str = DEFAULT_LANGUAGE) -> None:
        self.registry = registry
        self.sparse_language = check_language(sparse_language)
        self.max_inputs = max_inputs
        self.chunk_texts = chunk_texts
        self.draining = False

    @property
    def default_model(self) -> str:
        return self.registry.default_model

    def models(self) -> list[ModelSpec]:
        """The ModelSpecs served, the default first."""
        return self.registry.specs()

    async def embed(self, params: EmbedParams) -> EmbedResult:
        """Validate, tokenize, schedule and encode one request; raises EmbedError."""
        prepared = await self.prepare(params)
        return await self.execute(prepared)

    async def rerank(self, params: RerankParams) -> RerankResult:
        """Score a query's documents with a reranker, best first; raises EmbedError."""
        return await _rerank(self, params)

    async def prepare(self, params: EmbedParams) -> PreparedRequest:
        """Everything before the scheduler: validation, prompt template, tokenization."""
        if self.draining:
            raise unavailable(DRAINING)
        served = self.registry.get(params.model)
        spec = served.spec
        if spec.kind == "reranker":
            raise not_embedding(spec)
        dimensions, normalize = self._check_options(params, spec)
        texts, token_ids = params.texts, params.token_ids
        if len(texts) and len(token_ids):
            raise invalid_argument("request: both texts and token_ids are set; send one of them")
        if not params.dense and not params.return_sparse and not params.return_multivector:
            raise invalid_argument("request: dense=False asks for nothing without return_sparse")
        if params.return_multivector and not spec.colbert_dim:
            raise invalid_argument(f"return_multivector: model {spec.name!r} has no multi-vector (ColBERT) head "
                                   "(colbert_linear.pt); ListModels says which outputs each model offers")
        learned = params.return_sparse and spec.sparse_head
        count = len(texts) or len(token_ids)
        if count == 0:
            raise invalid_argument("request: no inputs (texts and token_ids are both empty)")
        if count > self.max_inputs:
            raise invalid_argument(
                f"request: {count} inputs exceeds the limit of {self.max_inputs} per request; "
                "split it or use EmbedStream")
        tokenizer = served.tokenizer
        sparse_ids = None
        language = self._sparse_language(params)
        if len(texts):
            # Once: a protobuf repeated string field decodes a new str at every access.
            texts = list(texts)
            for i, text in enumerate(texts):
                if not text:
                    raise invalid_argument(f"texts[{i}]: empty text", i)
                if _VISIBLE(text) is None:
                    raise invalid_argument(f"texts[{i}]: empty text (only whitespace, control or "
                                           "zero-width characters)", i)
            sparse_texts = list(texts) if params.return_sparse and not learned else None
            if not params.dense and not learned and not params.return_multivector:
                # sparse alone: the plain texts' ids give the token counts
                sparse_ids = await tokenizer.encode_plain_async(list(texts))
                return PreparedRequest(params, served, [], dimensions, normalize, sparse_ids,
                                       sparse_texts=sparse_texts, sparse_language=language)
            prompt = self._prompt_text(params.prompt_name, spec)
            templated = [prompt + t for t in texts] if prompt else list(texts)
            sequences = await tokenizer.encode_async(templated, truncate=params.truncate)
        else:
            sequences = self._check_token_ids(token_ids, spec, params.truncate, tokenizer)
            sparse_texts = None
            if params.return_sparse and not learned:  # the words of pre-tokenized input: its ids decoded
                sparse_ids = [list(ids) for ids in token_ids]
                sparse_texts = tokenizer.core.full.decode_batch(sparse_ids, skip_special_tokens=True)
        self._check_fits(sequences, served, params.lane)
        return PreparedRequest(params, served, sequences, dimensions, normalize, sparse_ids,
                               learned, sparse_texts, language)

    def _sparse_language(self, params: EmbedParams) -> str:
        if not params.sparse_language:
            return self.sparse_language
        try:
            return check_language(params.sparse_language)
        except UnknownLanguage as error:
            raise invalid_argument(f"sparse_language: {error}") from None

    @staticmethod
    def _check_fits(sequences: list[Sequence[int]], served: ServedModel, lane: Lane) -> None:
        """A sequence longer than the lane's whole queue could never be admitted: refused now,
        naming it, instead of a queue-full answer that would have its client retry forever."""
        bound = served.scheduler.config.bound(lane)
        for i, seq in enumerate(sequences):
            if len(seq) > bound:
                raise invalid_argument(
                    f"texts[{i}]: {len(seq)} tokens exceeds the {lane.name} lane's queue of {bound} tokens, "
                    f"so it never fits: truncate it shorter or raise --max-queued-tokens-{lane.name.lower()}", i)

    async def wait_for_room(self, prepared: PreparedRequest) -> None:
        """Wait until the lane can queue the request's first chunk (stream flow control)."""
        chunk = self._chunks(prepared)[0]
        try:
            await prepared.served.scheduler.wait_for_room(
                prepared.params.lane, sum(len(s) for s in prepared.sequences[chunk]))
        except (QueueFull, Draining, DeadlineExceeded) as error:
            raise _scheduler_error(error, prepared.params.lane) from None

    async def execute(self, prepared: PreparedRequest, *, wait_first: bool = False) -> EmbedResult:
        """Schedule a prepared request in chunks and encode the vectors.

        `wait_first`: wait for room before the first chunk too, instead of failing with
        RESOURCE_EXHAUSTED (streams, whose reader already waited, use it against races).
        """
        params, served = prepared.params, prepared.served
        if not params.dense and not prepared.token_outputs:
            return await self._sparse_only(prepared)
        scheduler = served.scheduler
        extra = {"token_outputs": True} if prepared.token_outputs else {}
        try:
            # The common case (a query): one chunk, awaited directly, without a task per chunk
            # and without walking the sequences to cut chunks.
            if (len(prepared.sequences) <= self.chunk_texts
                    and prepared.tokens <= scheduler.config.bound(params.lane)):
                chunks = None
            else:
                chunks = self._chunks(prepared)
            if chunks is None or len(chunks) == 1:
                pooled = await scheduler.embed(prepared.sequences, params.lane, params.deadline,
                                               wait=wait_first, **extra)
            else:
                pooled = await self._embed_chunks(prepared, chunks, wait_first)
        except (QueueFull, Draining, DeadlineExceeded) as error:
            raise _scheduler_error(error, params.lane) from None
        if prepared.token_outputs:
            return await _with_token_outputs(prepared, *pooled)
        vectors = finalize(pooled, dimensions=prepared.dimensions, normalize=prepared.normalize,
                           encoding=params.encoding, native_int8=served.spec.native_int8)
        return EmbedResult(model=served.spec.name, vectors=vectors, dimensions=prepared.dimensions,
                           encoding=params.encoding, token_counts=[len(s) for s in prepared.sequences],
                           sparse=await _sparse(prepared))

    @staticmethod
    async def _sparse_only(prepared: PreparedRequest) -> EmbedResult:
        ids = prepared.sparse_ids
        return EmbedResult(model=prepared.served.spec.name, vectors=np.zeros((len(ids), 0), np.float32),
                           dimensions=0, encoding="float32", token_counts=[len(i) for i in ids],
                           sparse=await _sparse(prepared))

    @staticmethod
    async def _embed_chunks(prepared: PreparedRequest, chunks: list[slice],
                            wait_first: bool) -> np.ndarray | tuple[np.ndarray, list]:
        """Chunks in flight together; the first failure cancels the rest and is raised."""
        params, scheduler = prepared.params, prepared.served.scheduler
        extra = {"token_outputs": True} if prepared.token_outputs else {}
        try:
            async with asyncio.TaskGroup() as group:
                tasks = []
                for n, chunk in enumerate(chunks):
                    tasks.append(group.create_task(scheduler.embed(
                        prepared.sequences[chunk], params.lane, params.deadline,
                        wait=n > 0 or wait_first, **extra)))
                    # Let the scheduler admit this chunk (or refuse it) before the next one.
                    await asyncio.sleep(0)
        except BaseExceptionGroup as group_error:
            raise group_error.exceptions[0] from None
        if prepared.token_outputs:
            results = [t.result() for t in tasks]
            return np.concatenate([r[0] for r in results]), [row for r in results for row in r[1]]
        return np.concatenate([t.result() for t in tasks])

    def _chunks(self, prepared: PreparedRequest) -> list[slice]:
        """Slices of the request's sequences: ≤ chunk_texts inputs and ≤ the lane's queue bound."""
        limit = prepared.served.scheduler.config.bound(prepared.params.lane)
        chunks, start, tokens = [], 0, 0
        for i, seq in enumerate(prepared.sequences):
            if i > start and (i - start >= self.chunk_texts or tokens + len(seq) > limit):
                chunks.append(slice(start, i))
                start, tokens = i, 0
            tokens += len(seq)
        chunks.append(slice(start, len(prepared.sequences)))
        return chunks

    @staticmethod
    def _check_options(params: EmbedParams, spec: ModelSpec) -> tuple[int, bool]:
        if params.encoding not in ENCODINGS:
            raise invalid_argument(f"encoding: {params.encoding!r} is not one of {', '.join(ENCODINGS)}")
        if not isinstance(params.lane, Lane):
            raise invalid_argument(f"lane: unknown lane {params.lane!r}")
        if params.dimensions < 0 or params.dimensions > spec.dimensions:
            raise invalid_argument(f"dimensions: {params.dimensions} is outside 1..{spec.dimensions} "
                                   f"for model {spec.name!r} (0 means the full {spec.dimensions})")
        dimensions = params.dimensions or spec.dimensions
        normalize = spec.normalize if params.normalize is None else params.normalize
        return dimensions, normalize

    @staticmethod
    def _prompt_text(name: str, spec: ModelSpec) -> str:
        if not name:
            default = spec.default_prompt_name
            return spec.prompts.get(default, "") if default else ""
        if name in spec.prompts:
            return spec.prompts[name]
        if name in GENERIC_PROMPTS:
            return ""
        known = ", ".join(sorted({*spec.prompts, *GENERIC_PROMPTS}))
        raise invalid_argument(f"prompt_name: {name!r} is not a prompt of model {spec.name!r} "
                               f"(known: {known})")

    @staticmethod
    def _check_token_ids(token_ids: Sequence[Sequence[int]], spec: ModelSpec, truncate: bool,
                         tokenizer: TextTokenizer) -> list[list[int]]:
        vocab = spec.vocab_size
        sequences = []
        for i, ids in enumerate(token_ids):
            ids = list(ids)
            if not ids:
                raise invalid_argument(f"token_ids[{i}]: no token ids", i)
            bad = next((t for t in ids if t < 0 or t >= vocab), None)
            if bad is not None:
                raise invalid_argument(f"token_ids[{i}]: token id {bad} is outside the vocabulary "
                                       f"of model {spec.name!r} (0..{vocab - 1})", i)
            if len(ids) > spec.max_tokens:
                if not truncate:
                    raise invalid_argument(
                        f"token_ids[{i}]: {len(ids)} tokens exceeds the model's limit of "
                        f"{spec.max_tokens} tokens (truncation is TRUNCATION_ERROR)", i)
                ids = tokenizer.truncate_ids(ids)
            sequences.append(ids)
        return sequences


async def _sparse(prepared: PreparedRequest) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """The request's BM25 lexical sparse vectors (None when it asked for none, or its model's
    learned sparse head makes them: `learned` in `prepare` picks, `_token_outputs` answers)."""
    texts = prepared.sparse_texts
    if texts is None:
        return None
    query = is_query(prepared.params.prompt_name)
    if len(texts) > LOOP_ROWS:  # ~0.1 ms a passage: off the loop, which keeps answering
        return await asyncio.to_thread(sparse_vectors, texts, language=prepared.sparse_language, query=query)
    return sparse_vectors(texts, language=prepared.sparse_language, query=query)


def _token_outputs(prepared: PreparedRequest, rows: list) -> tuple[list | None, list | None]:
    """The learned sparse vectors and the multi-vectors a request asked for, from its texts' head rows."""
    sparse = None
    if prepared.learned_sparse:
        unused = prepared.served.spec.unused_token_ids
        sparse = [learned_sparse(seq, row.weights, unused) for seq, row in zip(prepared.sequences, rows)]
    multivectors = None
    if prepared.params.return_multivector:
        multivectors = [np.array(row.multivector, dtype=np.float32) for row in rows]
    return sparse, multivectors


async def _with_token_outputs(prepared: PreparedRequest, pooled: np.ndarray, rows: list) -> EmbedResult:
    """The result of a request whose steps returned token heads' rows: its dense vectors (unless
    dense=False), learned sparse vectors and multi-vectors."""
    params, spec = prepared.params, prepared.served.spec
    if params.dense:
        vectors = finalize(pooled, dimensions=prepared.dimensions, normalize=prepared.normalize,
                           encoding=params.encoding, native_int8=spec.native_int8)
        dimensions, encoding = prepared.dimensions, params.encoding
    else:
        vectors, dimensions, encoding = np.zeros((len(rows), 0), np.float32), 0, "float32"
    if len(rows) > LOOP_ROWS:  # per-row Python work: off the loop, which keeps answering
        sparse, multivectors = await asyncio.to_thread(_token_outputs, prepared, rows)
    else:
        sparse, multivectors = _token_outputs(prepared, rows)
    if sparse is None:
        sparse = await _sparse(prepared)
    return EmbedResult(model=spec.name, vectors=vectors, dimensions=dimensions, encoding=encoding,
                       token_counts=[len(s) for s in prepared.sequences], sparse=sparse,
                       multivectors=multivectors)


def _scheduler_error(error: Exception, lane: Lane) -> EmbedError:
    """The status a caller sees for the scheduler's refusals."""
    if isinstance(error, QueueFull):
        return resource_exhausted(f"the {lane.name} lane's queue is full, retry with backoff ({error})")
    if isinstance(error, Draining):
        return unavailable(DRAINING)
    return deadline_exceeded("the deadline passed before the request reached the GPU")


@dataclass(frozen=True)
class RerankParams:
    """One rerank request, as every front end (gRPC, HTTP) describes it.

    `model` "" is the default model if it is a reranker, else the first reranker served;
    `top_n` 0 returns every document; `raw_scores` gives the model's logits instead of
    sigmoid(logit); `truncate` cuts the end of a document whose pair is over the model's
    limit (the query is never cut).
    """

    query: str
    documents: Sequence[str]
    model: str = ""
    top_n: int = 0
    raw_scores: bool = False
    return_documents: bool = False
    truncate: bool = True
    lane: Lane = Lane.ONLINE
    deadline: float | None = None


@dataclass(frozen=True)
class RerankResult:
    """The documents best first: `indices` into the request, their `scores`, and every pair's token count."""

    model: str
    indices: np.ndarray  # int64 [K], K = top_n or all
    scores: np.ndarray  # float32 [K], descending
    token_counts: list[int]  # request order, one per document
    documents: list[str] | None = None  # the texts of `indices`, when asked for


def not_embedding(spec: ModelSpec) -> EmbedError:
    """Why Embed refuses a reranker."""
    return invalid_argument(f"model: {spec.name!r} is a reranker (a cross-encoder): it scores (query, document) "
                            "pairs through Rerank and has no embeddings; ListModels gives each model's kind")


def sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-x)) without overflow for any float32 logit."""
    return (0.5 * (1.0 + np.tanh(0.5 * x.astype(np.float64)))).astype(np.float32)


def _pair_tokenizer(served: ServedModel) -> PairTokenizer:
    """The model's pair tokenizer, made on its first Rerank."""
    pairs = getattr(served, "pairs", None)
    if pairs is None:
        pairs = PairTokenizer.for_spec(served.spec)
        served.pairs = pairs
    return pairs


def _check_rerank(params: RerankParams, spec: ModelSpec, max_documents: int) -> None:
    if spec.kind != "reranker":
        raise invalid_argument(f"model: {spec.name!r} is an {spec.kind} model; Rerank needs a reranker "
                               "(a cross-encoder; ListModels gives each model's kind)")
    if not isinstance(params.lane, Lane):
        raise invalid_argument(f"lane: unknown lane {params.lane!r}")
    if isinstance(params.top_n, bool) or not isinstance(params.top_n, (int, np.integer)) or params.top_n < 0:
        raise invalid_argument(f"top_n: {params.top_n!r} is not a count (0 for every document)")
    if not isinstance(params.query, str) or not params.query or _VISIBLE(params.query) is None:
        raise invalid_argument("query: empty text")
    count = len(params.documents)
    if count == 0:
        raise invalid_argument("documents: empty list; send at least one document to rank")
    if count > max_documents:
        raise invalid_argument(f"documents: {count} documents exceeds the limit of {max_documents} per request; "
                               "rerank the best candidates of a first-stage search, or split them")
    for i, document in enumerate(params.documents):
        if not isinstance(document, str):
            raise invalid_argument(f"documents[{i}]: expected a string, got {type(document).__name__}", i)
        if not document or _VISIBLE(document) is None:
            raise invalid_argument(f"documents[{i}]: empty text", i)


async def _rerank(gateway: Gateway, params: RerankParams) -> RerankResult:
    """Validate, tokenize the pairs, score them on the engine's lanes and sort; raises EmbedError.

    The pairs go through the same scheduler, chunks and lane bounds as embeddings: a
    reranker's engine returns one score per sequence where an embedder returns a vector.
    """
    if gateway.draining:
        raise unavailable(DRAINING)
    served = gateway.registry.get(params.model)
    if not params.model and served.spec.kind != "reranker":
        # No model named and the default one embeds: the first reranker served, if there is one.
        rerankers = [s.name for s in gateway.models() if s.kind == "reranker"]
        if rerankers:
            served = gateway.registry.get(rerankers[0])
    spec = served.spec
    _check_rerank(params, spec, gateway.max_documents)
    pairs = _pair_tokenizer(served)
    documents = list(params.documents)
    if len(documents) <= 4:  # a handful of pairs costs less than the thread hop
        sequences = pairs.encode(params.query, documents, params.truncate)
    else:
        sequences = await asyncio.to_thread(pairs.encode, params.query, documents, params.truncate)
    bound = served.scheduler.config.bound(params.lane)
    for i, seq in enumerate(sequences):
        if len(seq) > bound:
            raise invalid_argument(
                f"documents[{i}]: {len(seq)} tokens exceeds the {params.lane.name} lane's queue of {bound} tokens, "
                f"so it never fits: truncate it shorter or raise --max-queued-tokens-{params.lane.name.lower()}", i)
    prepared = PreparedRequest(EmbedParams(lane=params.lane, deadline=params.deadline), served, sequences,
                               dimensions=spec.dimensions, normalize=False)
    logits = (await gateway.execute(prepared)).vectors[:, 0]
    scores = logits if params.raw_scores else sigmoid(logits)
    order = np.argsort(-scores, kind="stable")
    if params.top_n:
        order = order[: params.top_n]
    return RerankResult(model=spec.name, indices=order.astype(np.int64), scores=scores[order].astype(np.float32),
                        token_counts=[len(s) for s in sequences],
                        documents=[documents[i] for i in order.tolist()] if params.return_documents else None)
