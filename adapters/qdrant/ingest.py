"""Bulk ingest: stream records through the sidecar's EmbedStream (BATCH lane) and upsert them in batches.

Memory stays bounded: records are read lazily, at most `max_in_flight` requests of
`batch_size` records are between the reader and Qdrant at any time. Point ids are
UUIDv5s of the record ids, so an ingest stopped half-way (sidecar gone, crash, ^C)
converges when run again: the same records land on the same points, no duplicates.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice
from string import Formatter
from typing import Any

from qdrant_client import QdrantClient, models

from adapters.qdrant.collection import CollectionLayout
from adapters.qdrant.documents import qdrant_sparse
from adapters.progress import Progress
from sidecar.client import Embeddings, FernClient, FernError

# Fixed namespace: the same record id gives the same point id in every run and process.
POINT_NAMESPACE = uuid.UUID("8d5f3c1e-6a0b-5e7c-9b2d-4f1a0c3e5d7b")

TextSpec = str | Callable[[Any], str]
IdSpec = str | Callable[[Any], Any]
PayloadSpec = Sequence[str] | Callable[[Any], dict[str, Any]] | bool | None


def point_id(record_id: Any) -> str:
    """The Qdrant point id (a UUID string) of a record id; equal ids give equal points."""
    return str(uuid.uuid5(POINT_NAMESPACE, str(record_id)))


@dataclass(frozen=True)
class IngestSummary:
    """What an ingest did: rows upserted, wall time and throughput."""

    collection: str
    rows: int
    seconds: float
    requests: int

    @property
    def rows_per_second(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0

    def __str__(self) -> str:
        return (f"ingested {self.rows:,} rows into {self.collection!r} in {self.seconds:.2f}s "
                f"({self.rows_per_second:,.0f} rows/s, {self.requests:,} sidecar "
                f"request{'' if self.requests == 1 else 's'})")


class IngestError(RuntimeError):
    """Ingest stopped; `rows_upserted` rows are in the collection and re-running completes it."""

    def __init__(self, message: str, *, collection: str, rows_upserted: int, rows_read: int):
        super().__init__(message)
        self.collection = collection
        self.rows_upserted = rows_upserted
        self.rows_read = rows_read


@dataclass
class _Chunk:
    """One sidecar request's worth of records, waiting for its vectors."""

    first_row: int
    record_ids: list[Any]
    payloads: list[dict[str, Any] | None]


@dataclass
class _Reader:
    """Turns records into stream requests on gRPC's request thread, within the in-flight bound."""

    records: Iterable[Any]
    text: Callable[[Any], str]
    record_id: Callable[[Any], Any]
    payload: Callable[[Any], dict[str, Any] | None]
    batch_size: int
    max_in_flight: int
    pending: dict[str, _Chunk] = field(default_factory=dict)
    rows_read: int = 0
    error: BaseException | None = None

    def __post_init__(self) -> None:
        self.slots = threading.Semaphore(self.max_in_flight)
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def requests(self) -> Iterator[tuple[str, list[str]]]:
        records = iter(self.records)
        n = 0
        while not self.stop.is_set():
            while not self.slots.acquire(timeout=0.1):
                if self.stop.is_set():
                    return
            try:
                batch = list(islice(records, self.batch_size))
                chunk, texts = self._chunk(batch)
            except Exception as err:  # relayed to the caller's thread by ingest()
                self.error = err
                return
            if not batch:
                return
            request_id = str(n)
            n += 1
            with self.lock:
                self.pending[request_id] = chunk
            yield request_id, texts

    def take(self, request_id: str) -> _Chunk:
        with self.lock:
            chunk = self.pending.pop(request_id)
        return chunk

    def release(self) -> None:
        self.slots.release()

    def _chunk(self, batch: list[Any]) -> tuple[_Chunk, list[str]]:
        chunk = _Chunk(first_row=self.rows_read, record_ids=[], payloads=[])
        texts = []
        for offset, record in enumerate(batch):
            row = self.rows_read + offset
            rid = _describe(lambda: self.record_id(record), row, "id")
            if rid is None:
                raise ValueError(f"record {row}: its id is None (every record needs an id so "
                                 f"re-running converges)")
            text = _describe(lambda: self.text(record), row, "text", rid)
            if not isinstance(text, str):
                raise ValueError(f"record {row} (id {rid!r}): text is {type(text).__name__}, not str")
            chunk.record_ids.append(rid)
            chunk.payloads.append(_describe(lambda: self.payload(record), row, "payload", rid))
            texts.append(text)
        self.rows_read += len(batch)
        return chunk, texts


def _describe(get: Callable[[], Any], row: int, what: str, rid: Any = None) -> Any:
    """Run one accessor; a missing field becomes an error naming the record and field."""
    try:
        return get()
    except (KeyError, AttributeError, IndexError) as err:
        named = f"record {row}" + ("" if rid is None else f" (id {rid!r})")
        raise ValueError(f"{named}: cannot build its {what}: missing field {err}") from None


def ingest(client: QdrantClient, fern: FernClient, collection: str, records: Iterable[Any], *,
           layout: CollectionLayout, text: TextSpec = "text", id: IdSpec = "id",
           payload: PayloadSpec = None, batch_size: int = 64, max_in_flight: int = 8,
           prompt: str | None = None, progress: bool | None = None,
           wait: bool = True) -> IngestSummary:
    """Embed `records` through EmbedStream and upsert them into `collection`; returns a summary.

    text: a field name, a template such as "{title}\\n\\n{body}", or a callable(record).
    id: a field name or a callable(record); points get `point_id(record id)`.
    payload: None for the whole record (a Mapping or a dataclass-like object's fields), a
    list of field names, a callable(record) -> dict, or False for none.
    progress: a status line on stderr; None shows it only when stderr is a terminal.
    Raises IngestError (with rows_upserted) when the sidecar, Qdrant or the records fail
    mid-way; running the same ingest again completes the collection.
    """
    if batch_size < 1 or max_in_flight < 1:
        raise ValueError(f"batch_size and max_in_flight must be >= 1, got {batch_size} and "
                         f"{max_in_flight}")
    reader = _Reader(records, text_getter(text), id_getter(id), payload_getter(payload),
                     batch_size, max_in_flight)
    total = len(records) if isinstance(records, Sequence) else None
    bar = Progress(f"ingest {collection}", total=total, enabled=progress)
    rows = requests = 0
    start = time.perf_counter()

    def stopped(why: str) -> IngestError:
        return IngestError(
            f"ingest into {collection!r} stopped after {rows:,} rows upserted "
            f"({reader.rows_read:,} read): {why}. Run the same ingest again to complete it: "
            f"point ids derive from record ids, so nothing is duplicated.",
            collection=collection, rows_upserted=rows, rows_read=reader.rows_read)

    stream = fern.embed_stream(reader.requests(), model=layout.model, lane="batch",
                               prompt=prompt, sparse=layout.sparse is not None,
                               multivector=layout.multivector is not None)
    try:
        for result in stream:
            chunk = reader.take(result.request_id)
            if result.error is not None:
                raise stopped(_record_error(result.error, chunk))
            try:
                client.upsert(collection, _batch(chunk, result.embeddings, layout), wait=wait)
            except Exception as err:  # any Qdrant failure: re-raised with how far ingest got
                raise stopped(f"upsert into Qdrant failed: {err}") from err
            rows += len(chunk.record_ids)
            requests += 1
            reader.release()
            bar.update(rows)
    except FernError as err:
        raise stopped(f"sidecar at {fern.target} failed: {err}") from err
    finally:
        reader.stop.set()
        stream.close()
        bar.close(rows)
    if reader.error is not None:
        raise stopped(f"reading records failed: {reader.error}") from reader.error
    if reader.pending:
        raise stopped(f"the sidecar closed the stream with {len(reader.pending)} request(s) "
                      f"unanswered")
    return IngestSummary(collection, rows, time.perf_counter() - start, requests)


def _record_error(err: FernError, chunk: _Chunk) -> str:
    if err.index is not None and 0 <= err.index < len(chunk.record_ids):
        row = chunk.first_row + err.index
        return f"the sidecar rejected record {row} (id {chunk.record_ids[err.index]!r}): {err}"
    return f"the sidecar rejected records {chunk.first_row}..{chunk.first_row + len(chunk.record_ids) - 1}: {err}"


def _batch(chunk: _Chunk, emb: Embeddings, layout: CollectionLayout) -> models.Batch:
    vectors: dict[str, list[Any]] = {layout.dense: emb.vectors.astype("float32", copy=False).tolist()}
    if layout.sparse is not None:
        vectors[layout.sparse] = [qdrant_sparse(s) for s in emb.sparse or ()]
    if layout.multivector is not None:
        vectors[layout.multivector] = [m.tolist() for m in emb.multivectors or ()]
    payloads = chunk.payloads if any(p is not None for p in chunk.payloads) else None
    return models.Batch(ids=[point_id(r) for r in chunk.record_ids], vectors=vectors,
                        payloads=payloads)


def _field(record: Any, name: str) -> Any:
    return record[name] if isinstance(record, Mapping) else getattr(record, name)


class _Fields(Mapping):
    """A record seen as a mapping, so str.format_map works on objects as well as dicts."""

    def __init__(self, record: Any):
        self.record = record

    def __getitem__(self, name: str) -> Any:
        return _field(self.record, name)

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


def text_getter(text: TextSpec) -> Callable[[Any], str]:
    if callable(text):
        return text
    if any(name for _, name, _, _ in Formatter().parse(text)):
        return lambda record: text.format_map(_Fields(record))
    return lambda record: _field(record, text)


def id_getter(spec: IdSpec) -> Callable[[Any], Any]:
    if callable(spec):
        return spec
    return lambda record: _field(record, spec)


def payload_getter(spec: PayloadSpec) -> Callable[[Any], dict[str, Any] | None]:
    if spec is False:
        return lambda record: None
    if spec is None or spec is True:
        return _whole_record
    if callable(spec):
        return spec
    if isinstance(spec, str):
        raise ValueError(f"payload must be a list of field names, not the string {spec!r}")
    names = list(spec)
    return lambda record: {name: _field(record, name) for name in names}


def _whole_record(record: Any) -> dict[str, Any]:
    if isinstance(record, Mapping):
        return dict(record)
    if hasattr(record, "__dataclass_fields__"):
        return {name: getattr(record, name) for name in record.__dataclass_fields__}
    raise ValueError(f"payload=None stores the whole record, but a {type(record).__name__} is "
                     f"not a mapping or dataclass: pass payload=[field names] or a callable")
