"""Lazy Document embedding for upload_points / upload_collection that keeps the shape qdrant-client checks.

qdrant-client checks `ids` and `payload` against the number of vectors only when the
vectors are a list, tuple or array (a stream has no length): shorter ones raise
ValueError before anything is uploaded. So a list or tuple of points or vectors stays a
Sequence of the same length here, embedded batch by batch as qdrant-client iterates it,
and a stream stays a stream. Either way at most one batch of embedded vectors is held
beyond what qdrant-client itself holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import islice
from typing import Any

EmbedChunk = Callable[[list[Any]], list[Any]]


class EmbeddedSequence(Sequence):
    """`items` (a list or tuple) with their Fern Documents embedded `batch_size` items at a time, when read."""

    def __init__(self, items: Sequence[Any], embed: EmbedChunk, batch_size: int):
        self.items = items
        self.embed = embed
        self.batch_size = max(batch_size, 1)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return self.embed(list(self.items[index]))
        return self.embed([self.items[index]])[0]

    def __iter__(self) -> Iterator[Any]:
        for start in range(0, len(self.items), self.batch_size):
            yield from self.embed(list(self.items[start:start + self.batch_size]))


def embedded(items: Any, embed: EmbedChunk, batch_size: int) -> Any:
    """`items` as qdrant-client would see them, with Fern Documents embedded lazily per batch.

    Named numpy arrays (a Mapping) and arrays hold no Documents and are returned as they are.
    """
    if isinstance(items, Mapping) or hasattr(items, "shape"):
        return items
    if isinstance(items, Sequence):
        return EmbeddedSequence(items, embed, batch_size)
    return _embedded_stream(items, embed, batch_size)


def _embedded_stream(items: Iterable[Any], embed: EmbedChunk, batch_size: int) -> Iterator[Any]:
    it = iter(items)
    while chunk := list(islice(it, max(batch_size, 1))):
        yield from embed(chunk)
