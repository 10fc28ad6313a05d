"""AsyncFernQdrantClient: AsyncQdrantClient whose Fern-model Documents are embedded by the sidecar (awaited).

The asyncio twin of FernQdrantClient, on AsyncFernClient: the same overridden methods,
lanes and one-call-per-API-call rule. Bulk `ingest` and `setup_collection` stay on
the blocking FernQdrantClient (ingest runs its own gRPC stream thread); `search` is here.
`upload_points` and `upload_collection` are plain (blocking) methods, as they are on
AsyncQdrantClient, so they embed through a blocking FernClient on the same connection.
What the twins share (the Fern client, pickling, uploads, layouts) is FernQdrantMixin.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from qdrant_client import AsyncQdrantClient, models

from adapters.qdrant.client import QUERY_LANE, WRITE_LANE, FernQdrantMixin, with_fern_parameters
from adapters.qdrant.collection import CollectionLayout, layout_from_config
from adapters.qdrant.connection import FernConnection
from adapters.qdrant.ingest import TextSpec
from adapters.qdrant.search import (candidates, check_search, documents_to_rerank, query_arguments, query_prompt,
                                    reranked, reranks)
from adapters.qdrant.documents import FERN_PREFIX
from sidecar.client import AsyncFernClient, FernClient


class AsyncFernQdrantClient(FernQdrantMixin, AsyncQdrantClient):
    """AsyncQdrantClient plus Fern: same constructor arguments, plus `fern` (an AsyncFernClient or target)."""

    _fern_class = AsyncFernClient

    def __init__(self, *args: Any, fern: AsyncFernClient | str | None = None,
                 fern_models: Mapping[str, str] | None = None, fern_prefix: str = FERN_PREFIX,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.fern: AsyncFernClient
        self._init_fern(fern, fern_models, fern_prefix)
        self._blocking_fern: FernClient | None = None

    def _reconnect(self, connection: FernConnection) -> AsyncFernClient:
        return connection.asyncio()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_blocking_fern"] = None
        return state

    async def upsert(self, collection_name: str, points: Any, *args: Any,
                     **kwargs: Any) -> models.UpdateResult:
        points = await self.documents.asubstitute(points, self.fern, WRITE_LANE)
        return await super().upsert(collection_name, points, *args, **kwargs)

    async def update_vectors(self, collection_name: str, points: Sequence[models.PointVectors],
                             *args: Any, **kwargs: Any) -> models.UpdateResult:
        points = await self.documents.asubstitute(points, self.fern, WRITE_LANE)
        return await super().update_vectors(collection_name, points, *args, **kwargs)

    async def batch_update_points(self, collection_name: str,
                                  update_operations: Sequence[models.UpdateOperation],
                                  *args: Any, **kwargs: Any) -> list[models.UpdateResult]:
        update_operations = await self.documents.asubstitute(update_operations, self.fern,
                                                             WRITE_LANE)
        return await super().batch_update_points(collection_name, update_operations, *args,
                                                 **kwargs)

    def _write_embedder(self) -> Callable[[list[Any]], list[Any]]:
        def embed(chunk: list[Any]) -> list[Any]:
            if not self.documents.plan(chunk):
                return chunk
            if self._blocking_fern is None:
                self._blocking_fern = FernConnection.of(self.fern).blocking()
            return self.documents.substitute(chunk, self._blocking_fern, WRITE_LANE)
        return embed

    async def query_points(self, collection_name: str, query: Any = None,
                           using: str | None = None,
                           prefetch: models.Prefetch | list[models.Prefetch] | None = None,
                           *args: Any, **kwargs: Any) -> models.QueryResponse:
        query, prefetch = await self.documents.asubstitute((query, prefetch), self.fern,
                                                           QUERY_LANE)
        return await super().query_points(collection_name, query, using, prefetch, *args,
                                          **kwargs)

    async def query_batch_points(self, collection_name: str,
                                 requests: Sequence[models.QueryRequest],
                                 *args: Any, **kwargs: Any) -> list[models.QueryResponse]:
        requests = await self.documents.asubstitute(requests, self.fern, QUERY_LANE)
        return await super().query_batch_points(collection_name, requests, *args, **kwargs)

    async def query_points_groups(self, collection_name: str, group_by: str, query: Any = None,
                                  using: str | None = None,
                                  prefetch: models.Prefetch | list[models.Prefetch] | None = None,
                                  *args: Any, **kwargs: Any) -> models.GroupsResult:
        query, prefetch = await self.documents.asubstitute((query, prefetch), self.fern,
                                                           QUERY_LANE)
        return await super().query_points_groups(collection_name, group_by, query, using,
                                                 prefetch, *args, **kwargs)

    async def search(self, collection_name: str, text: str, k: int = 10,
                     filter: models.Filter | None = None, hybrid: bool = True, *,
                     model: str | None = None, prompt: str | None = None,
                     prefetch_limit: int | None = None,
                     with_payload: bool | list[str] = True,
                     rerank: bool | None = None, rerank_text: TextSpec | None = None,
                     rerank_top: int | None = None, rerank_model: str = "") -> list[models.ScoredPoint]:
        """The `k` best points for `text` (see FernQdrantClient.search): one sidecar call, one query, and
        with `rerank_text` one Rerank call."""
        layout = await self._layout(collection_name, model)
        rerank = reranks(layout, rerank)
        check_search(collection_name, text, k, hybrid, layout, rerank, rerank_text, rerank_top, rerank_model)
        if prompt is None:
            prompt = query_prompt(await self.fern.model(layout.model))
        emb = await self.fern.embed([text], model=layout.model, lane=QUERY_LANE, prompt=prompt,
                                    sparse=hybrid, multivector=rerank)
        if rerank_text is None:
            arguments = query_arguments(emb, layout, k, filter, hybrid, prefetch_limit, with_payload, rerank)
            return (await super().query_points(collection_name, **arguments)).points
        arguments = query_arguments(emb, layout, candidates(k, rerank_top), filter, hybrid, prefetch_limit, True,
                                    rerank)
        points = (await super().query_points(collection_name, **arguments)).points
        scored, texts = documents_to_rerank(points, rerank_text)
        ranking = await self.fern.rerank(text, texts, model=rerank_model, top_n=k, lane=QUERY_LANE) \
            if texts else None
        return reranked(points, scored, ranking, k, with_payload)

    async def _layout(self, collection_name: str, model: str | None) -> CollectionLayout:
        config = (await self.get_collection(collection_name)).config
        return self._with_model(layout_from_config(collection_name, config), model)

    async def close(self, *args: Any, **kwargs: Any) -> None:
        await super().close(*args, **kwargs)
        if getattr(self, "_blocking_fern", None) is not None:
            self._blocking_fern.close()
            self._blocking_fern = None
        if getattr(self, "_owns_fern", False) and hasattr(self, "fern"):
            await self.fern.close()


AsyncFernQdrantClient.__init__.__signature__ = with_fern_parameters(  # type: ignore[attr-defined]
    AsyncQdrantClient.__init__, AsyncFernQdrantClient.__init__)
