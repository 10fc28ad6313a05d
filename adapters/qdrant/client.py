"""FernQdrantClient: a QdrantClient whose Fern-model Documents are embedded by the Fern sidecar.

It subclasses QdrantClient rather than wrapping it, so it *is* a QdrantClient: every
method, argument and return type is qdrant-client's own, `isinstance` checks and type
hints keep working, and local mode (`:memory:` or a path) and a server URL run the same
code. Only the methods that carry vectors are overridden, and only to replace Fern
Documents (see documents.py) with sidecar vectors before qdrant-client's own code runs:
writes through the BATCH lane, queries through the ONLINE lane, one sidecar call per API
call (per chunk of `batch_size` points for the streaming upload methods, to keep memory
bounded). The substitution happens in the calling process, so `upload_points(...,
parallel=N)` workers receive plain vectors. Documents for other models reach
qdrant-client unchanged and it embeds them as it always does (FastEmbed, cloud inference).
The constructor takes qdrant-client's arguments as qdrant-client does (positional too),
and a client copies and pickles where qdrant-client's does (local mode in memory): the
copy opens its own channel to the same sidecar.

The async twin (async_client.py) shares FernQdrantMixin rather than being generated from
this class: the two subclass different qdrant-client bases, so only the calls are written twice.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from qdrant_client import QdrantClient, models

from adapters.qdrant import collection as _collection
from adapters.qdrant import ingest as _ingest
from adapters.qdrant import search as _search
from adapters.qdrant.collection import DENSE, SPARSE, CollectionLayout
from adapters.qdrant.connection import FernConnection
from adapters.qdrant.documents import FERN_PREFIX, DocumentEmbedder, FernModels
from adapters.qdrant.ingest import IdSpec, IngestSummary, PayloadSpec, TextSpec
from adapters.qdrant.uploads import embedded
from sidecar.client import AsyncFernClient, FernClient, ModelInfo

WRITE_LANE = "batch"
QUERY_LANE = "online"


class FernQdrantMixin:
    """What FernQdrantClient and AsyncFernQdrantClient share: the Fern client, pickling, uploads, layouts.

    It comes before the Qdrant base class, so its methods reach qdrant-client's through super().
    Each twin adds `_fern_class`, `_reconnect`, `_write_embedder` and the overridden calls.
    """

    _fern_class: type[FernClient] | type[AsyncFernClient]

    def _init_fern(self, fern: FernClient | AsyncFernClient | str | None,
                   fern_models: Mapping[str, str] | None, fern_prefix: str) -> None:
        self._owns_fern = fern is None or isinstance(fern, str)
        self.fern = self._fern_class(fern) if self._owns_fern else fern
        self.documents = DocumentEmbedder(FernModels(fern_prefix, dict(fern_models or {})))

    def _reconnect(self, connection: FernConnection) -> FernClient | AsyncFernClient:
        raise NotImplementedError

    def _write_embedder(self) -> Callable[[list[Any]], list[Any]]:
        raise NotImplementedError

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["fern"] = FernConnection.of(self.fern)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        connection: FernConnection = state.pop("fern")
        self.__dict__.update(state)
        self.fern = self._reconnect(connection)
        self._owns_fern = True

    # Streaming uploads (blocking on both qdrant-clients): Documents embedded per batch, BATCH lane.

    def upload_points(self, collection_name: str, points: Iterable[models.PointStruct],
                      batch_size: int = 64, *args: Any, **kwargs: Any) -> None:
        """qdrant-client's upload_points, Fern Documents embedded per batch of `batch_size` points."""
        points = embedded(points, self._write_embedder(), batch_size)
        return super().upload_points(  # type: ignore[misc]
            collection_name, points, batch_size, *args, **kwargs)

    def upload_collection(self, collection_name: str, vectors: Any, payload: Any = None,
                          ids: Any = None, batch_size: int = 64, *args: Any,
                          **kwargs: Any) -> None:
        """qdrant-client's upload_collection, Fern Documents embedded per batch of `batch_size` vectors."""
        vectors = embedded(vectors, self._write_embedder(), batch_size)
        return super().upload_collection(collection_name, vectors, payload, ids,  # type: ignore[misc]
                                         batch_size, *args, **kwargs)

    @staticmethod
    def _with_model(layout: CollectionLayout, model: str | None) -> CollectionLayout:
        """A collection's layout, its model replaced by `model` when one is given."""
        return layout if model is None else replace(layout, model=model)


class FernQdrantClient(FernQdrantMixin, QdrantClient):
    """QdrantClient plus Fern: same constructor arguments, plus `fern` (a FernClient or target).

    fern_models maps Document model names to sidecar model names (in addition to the
    ``fern/<name>`` prefix), e.g. ``{"sentence-transformers/all-MiniLM-L6-v2": "all-MiniLM-L6-v2"}``.
    """

    _fern_class = FernClient

    def __init__(self, *args: Any, fern: FernClient | str | None = None,
                 fern_models: Mapping[str, str] | None = None, fern_prefix: str = FERN_PREFIX,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.fern: FernClient
        self._init_fern(fern, fern_models, fern_prefix)
        self._model_info: dict[str, ModelInfo] = {}

    def _reconnect(self, connection: FernConnection) -> FernClient:
        return connection.blocking()

    # Writes: BATCH lane.

    def upsert(self, collection_name: str, points: models.Batch | Sequence[models.PointStruct],
               *args: Any, **kwargs: Any) -> models.UpdateResult:
        points = self.documents.substitute(points, self.fern, WRITE_LANE)
        return super().upsert(collection_name, points, *args, **kwargs)

    def update_vectors(self, collection_name: str, points: Sequence[models.PointVectors],
                       *args: Any, **kwargs: Any) -> models.UpdateResult:
        points = self.documents.substitute(points, self.fern, WRITE_LANE)
        return super().update_vectors(collection_name, points, *args, **kwargs)

    def batch_update_points(self, collection_name: str,
                            update_operations: Sequence[models.UpdateOperation],
                            *args: Any, **kwargs: Any) -> list[models.UpdateResult]:
        update_operations = self.documents.substitute(update_operations, self.fern, WRITE_LANE)
        return super().batch_update_points(collection_name, update_operations, *args, **kwargs)

    def _write_embedder(self) -> Callable[[list[Any]], list[Any]]:
        """Embeds the Documents of one batch of points or vectors: one sidecar call."""
        return lambda chunk: self.documents.substitute(chunk, self.fern, WRITE_LANE)

    # Queries: ONLINE lane.

    def query_points(self, collection_name: str, query: Any = None, using: str | None = None,
                     prefetch: models.Prefetch | list[models.Prefetch] | None = None,
                     *args: Any, **kwargs: Any) -> models.QueryResponse:
        query, prefetch = self.documents.substitute((query, prefetch), self.fern, QUERY_LANE)
        return super().query_points(collection_name, query, using, prefetch, *args, **kwargs)

    def query_batch_points(self, collection_name: str, requests: Sequence[models.QueryRequest],
                           *args: Any, **kwargs: Any) -> list[models.QueryResponse]:
        requests = self.documents.substitute(requests, self.fern, QUERY_LANE)
        return super().query_batch_points(collection_name, requests, *args, **kwargs)

    def query_points_groups(self, collection_name: str, group_by: str, query: Any = None,
                            using: str | None = None,
                            prefetch: models.Prefetch | list[models.Prefetch] | None = None,
                            *args: Any, **kwargs: Any) -> models.GroupsResult:
        query, prefetch = self.documents.substitute((query, prefetch), self.fern, QUERY_LANE)
        return super().query_points_groups(collection_name, group_by, query, using, prefetch,
                                           *args, **kwargs)

    # Fern's own verbs: collection setup, bulk ingest, text search.

    def setup_collection(self, collection_name: str, model: str = "", *, dense: str = DENSE,
                         sparse: str | None = SPARSE, quantization: str | None = None,
                         datatype: str = "float32", on_disk: bool = False,
                         multivector: str | bool | None = None) -> CollectionLayout:
        """Create a collection shaped for `model` (see collection.setup_collection)."""
        return _collection.setup_collection(self, self.fern, collection_name, model, dense=dense,
                                            sparse=sparse, quantization=quantization,
                                            datatype=datatype, on_disk=on_disk, multivector=multivector)

    def ingest(self, collection_name: str, records: Iterable[Any], *, text: TextSpec = "text",
               id: IdSpec = "id", payload: PayloadSpec = None, model: str | None = None,
               batch_size: int = 64, max_in_flight: int = 8, prompt: str | None = None,
               progress: bool | None = None, wait: bool = True) -> IngestSummary:
        """Stream `records` through the sidecar and upsert them (see ingest.ingest).

        The collection's layout (model, vector names) comes from setup_collection's
        metadata; `model` overrides the model.
        """
        layout = self._layout(collection_name, model)
        return _ingest.ingest(self, self.fern, collection_name, records, layout=layout, text=text,
                              id=id, payload=payload, batch_size=batch_size,
                              max_in_flight=max_in_flight, prompt=prompt, progress=progress,
                              wait=wait)

    def search(self, collection_name: str, text: str, k: int = 10,
               filter: models.Filter | None = None, hybrid: bool = True, *,
               model: str | None = None, prompt: str | None = None,
               prefetch_limit: int | None = None,
               with_payload: bool | list[str] = True, rerank: bool | None = None,
               rerank_text: TextSpec | None = None, rerank_top: int | None = None,
               rerank_model: str = "") -> list[models.ScoredPoint]:
        """The `k` best points for `text`: dense + sparse fused by RRF, or dense only; reranked by
        the multi-vector's MaxSim when the collection has one (rerank=False: not).

        The query is embedded with prompt "query": the model's query prompt where it defines
        one, and BM25's query form of the sparse vector.

        With `rerank_text` (where a point's text is: a payload field, a template such as
        "{title}\n\n{body}", or a callable(payload)), the best `rerank_top` points (default
        max(4k, 20)) are rescored by a cross-encoder on the sidecar (`rerank_model`, "": its first
        reranker) in one more call, and the best k come back in its order with its score:

            qc.search("docs", "how often to water?", k=3, rerank_text="{title}\n\n{body}")
        """
        layout = self._layout(collection_name, model)
        if prompt is None:
            prompt = self._query_prompt(layout.model)
        return _search.search(self, self.fern, collection_name, text, k, filter, hybrid,
                              layout=layout, prompt=prompt, prefetch_limit=prefetch_limit,
                              with_payload=with_payload, rerank=rerank, rerank_text=rerank_text,
                              rerank_top=rerank_top, rerank_model=rerank_model)

    def _layout(self, collection_name: str, model: str | None) -> CollectionLayout:
        return self._with_model(_collection.collection_layout(self, collection_name), model)

    def _query_prompt(self, model: str) -> str | None:
        if model not in self._model_info:
            self._model_info[model] = self.fern.model(model)
        return _search.query_prompt(self._model_info[model])

    def close(self, *args: Any, **kwargs: Any) -> None:
        super().close(*args, **kwargs)
        if getattr(self, "_owns_fern", False) and hasattr(self, "fern"):
            self.fern.close()


def with_fern_parameters(stock_init: Callable[..., Any], own_init: Callable[..., Any]) -> inspect.Signature:
    """`stock_init`'s signature with `own_init`'s keyword-only Fern parameters, for help() and IDEs."""
    stock = list(inspect.signature(stock_init).parameters.values())
    fern = [p for p in inspect.signature(own_init).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY]
    rest = [p for p in stock if p.kind is not inspect.Parameter.VAR_KEYWORD]
    var_keyword = [p for p in stock if p.kind is inspect.Parameter.VAR_KEYWORD]
    return inspect.Signature(rest + fern + var_keyword)


FernQdrantClient.__init__.__signature__ = with_fern_parameters(  # type: ignore[attr-defined]
    QdrantClient.__init__, FernQdrantClient.__init__)
