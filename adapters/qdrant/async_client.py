"""AsyncFernQdrantClient: AsyncQdrantClient whose Fern-model Documents are embedded by the sidecar (awaited).

The asyncio twin of FernQdrantClient, on AsyncFernClient: the same overridden methods,
lanes and one-call-per-API-call rule. Bulk `ingest` and `setup_collection` stay on
the blocking FernQdrantClient (ingest runs its own gRPC stream thread); `search` is here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from itertools import islice
from typing import Any

from qdrant_client import AsyncQdrantClient, models

from adapters.qdrant.client import QUERY_LANE, WRITE_LANE
from adapters.qdrant.collection import CollectionLayout, layout_from_config
from adapters.qdrant.search import check_search, query_arguments, query_prompt
from adapters.qdrant.documents import FERN_PREFIX, DocumentEmbedder, FernModels
from sidecar.client import AsyncFernClient

# upload_points/upload_collection embed this many batches per sidecar call, then upload them.
_UPLOAD_BATCHES_PER_CALL = 16


class AsyncFernQdrantClient(AsyncQdrantClient):
    """AsyncQdrantClient plus Fern: same constructor arguments, plus `fern` (an AsyncFernClient or target)."""

    def __init__(self, location: str | None = None, *, fern: AsyncFernClient | str | None = None,
                 fern_models: Mapping[str, str] | None = None, fern_prefix: str = FERN_PREFIX,
                 **kwargs: Any):
        super().__init__(location, **kwargs)
        self._owns_fern = fern is None or isinstance(fern, str)
        self.fern: AsyncFernClient = AsyncFernClient(fern) if self._owns_fern else fern
        self.documents = DocumentEmbedder(FernModels(fern_prefix, dict(fern_models or {})))

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

    async def upload_points(self, collection_name: str, points: Iterable[models.PointStruct],
                            batch_size: int = 64, *args: Any, **kwargs: Any) -> None:
        """Embeds and uploads `points` in slices of 16 batches, so memory stays bounded."""
        it = iter(points)
        while chunk := list(islice(it, max(batch_size, 1) * _UPLOAD_BATCHES_PER_CALL)):
            chunk = await self.documents.asubstitute(chunk, self.fern, WRITE_LANE)
            await super().upload_points(collection_name, chunk, batch_size, *args, **kwargs)

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
                     with_payload: bool | list[str] = True) -> list[models.ScoredPoint]:
        """The `k` best points for `text` (see FernQdrantClient.search): one sidecar call, one query."""
        layout = await self._layout(collection_name, model)
        check_search(collection_name, text, k, hybrid, layout)
        if prompt is None:
            prompt = query_prompt(await self.fern.model(layout.model))
        emb = await self.fern.embed([text], model=layout.model, lane=QUERY_LANE, prompt=prompt,
                                    sparse=hybrid)
        arguments = query_arguments(emb, layout, k, filter, hybrid, prefetch_limit, with_payload)
        return (await super().query_points(collection_name, **arguments)).points

    async def _layout(self, collection_name: str, model: str | None) -> CollectionLayout:
        config = (await self.get_collection(collection_name)).config
        layout = layout_from_config(collection_name, config)
        if model is not None:
            layout = replace(layout, model=model)
        return layout

    async def close(self, *args: Any, **kwargs: Any) -> None:
        await super().close(*args, **kwargs)
        if getattr(self, "_owns_fern", False) and hasattr(self, "fern"):
            await self.fern.close()
