"""Finds the Fern-model `models.Document`s inside a qdrant-client request and swaps in sidecar vectors.

A request (points, a Batch, update operations, a query with prefetches, ...) is walked
through qdrant-client's public pydantic models. Documents whose `model` names a Fern
model are collected, embedded with one sidecar call per distinct set of options (so
one call for an ordinary request), and replaced by plain vectors: a dense
`list[float]`, or a `models.SparseVector` when the Document asks for the sparse lexical
vector. Every other object, including Documents for other models, is passed on as the
very same object, so qdrant-client handles them exactly as it would without Fern.

Document options Fern reads (all optional): ``prompt`` (a prompt name the model
defines), ``normalize`` (bool), ``dimensions`` (Matryoshka truncation), ``truncate``
(bool, default true), ``sparse`` (bool: the BM25 sparse vector instead of the dense one;
with prompt "query", BM25's query form; a model's learned sparse weights where it has a
learned sparse head) and ``multivector`` (bool: the model's ColBERT multi-vector, a list of
vectors, for a MaxSim vector; models with a ColBERT head only).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from qdrant_client import models

from sidecar.client import AsyncFernClient, Embeddings, FernClient, FernError, SparseVector

FERN_PREFIX = "fern/"
_OPTIONS = ("prompt", "normalize", "dimensions", "truncate", "sparse", "multivector")
# User JSON that qdrant-client never embeds: not worth walking value by value.
_SKIPPED_FIELDS = frozenset({"payload", "payloads"})


@dataclass(frozen=True)
class FernModels:
    """Which Document model names Fern serves: `prefix` + sidecar model name, or a mapping.

    ``fern/all-MiniLM-L6-v2`` asks the sidecar for ``all-MiniLM-L6-v2``; ``fern/`` or
    ``fern/default`` for its default model. `mapping` routes other names, e.g.
    ``{"sentence-transformers/all-MiniLM-L6-v2": "all-MiniLM-L6-v2"}`` lets code written for
    FastEmbed run on Fern unchanged.
    """

    prefix: str = FERN_PREFIX
    mapping: Mapping[str, str] = field(default_factory=dict)

    def resolve(self, model: str) -> str | None:
        """The sidecar model name for a Document model name ("" = default), or None if not Fern's."""
        if model in self.mapping:
            return self.mapping[model]
        if self.prefix and model.startswith(self.prefix):
            name = model[len(self.prefix):]
            return "" if name in ("", "default") else name
        return None


@dataclass(frozen=True)
class EmbedKey:
    """The sidecar options one Document needs; Documents with equal keys share one call."""

    model: str
    prompt: str | None = None
    normalize: bool | None = None
    dimensions: int = 0
    truncate: bool = True


def document_key(doc: models.Document, sidecar_model: str) -> tuple[EmbedKey, bool]:
    """The call options and the sparse flag of a Fern Document; bad options raise ValueError."""
    options = doc.options or {}
    if not isinstance(options, Mapping):
        raise ValueError(f"Document(model={doc.model!r}): options must be a dict for a Fern model, "
                         f"got {type(options).__name__}")
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise ValueError(f"Document(model={doc.model!r}): unknown option(s) {unknown}; "
                         f"Fern reads {list(_OPTIONS)}")
    key = EmbedKey(
        model=sidecar_model,
        prompt=options.get("prompt"),
        normalize=options.get("normalize"),
        dimensions=int(options.get("dimensions", 0)),
        truncate=bool(options.get("truncate", True)),
    )
    return key, bool(options.get("sparse", False))


@dataclass
class _Group:
    """The distinct texts of one EmbedKey, and whether any Document wants sparse / multi-vectors."""

    texts: dict[str, int] = field(default_factory=dict)
    sparse: bool = False
    multivector: bool = False


@dataclass
class DocumentPlan:
    """The Fern Documents found in one request, grouped into as few sidecar calls as possible."""

    documents: list[tuple[models.Document, EmbedKey, bool]]
    groups: dict[EmbedKey, _Group]
    # Documents (by id) that asked for the multi-vector.
    multivector: set[int] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.documents)

    def embed(self, fern: FernClient, lane: str) -> dict[int, Any]:
        """Embed every group (one call each); returns id(Document) -> replacement vector."""
        results = {key: self._call(fern.embed, key, group, lane) for key, group in self.groups.items()}
        return self._replacements(results)

    async def aembed(self, fern: AsyncFernClient, lane: str) -> dict[int, Any]:
        """Async twin of `embed`."""
        results = {}
        for key, group in self.groups.items():
            results[key] = await self._acall(fern.embed, key, group, lane)
        return self._replacements(results)

    def _call(self, embed: Callable[..., Embeddings], key: EmbedKey, group: _Group,
              lane: str) -> Embeddings:
        try:
            return embed(list(group.texts), **_call_options(key, group, lane))
        except FernError as err:
            raise _named_error(err, key, group) from err

    async def _acall(self, embed: Callable[..., Any], key: EmbedKey, group: _Group,
                     lane: str) -> Embeddings:
        try:
            return await embed(list(group.texts), **_call_options(key, group, lane))
        except FernError as err:
            raise _named_error(err, key, group) from err

    def _replacements(self, results: dict[EmbedKey, Embeddings]) -> dict[int, Any]:
        out: dict[int, Any] = {}
        for doc, key, sparse in self.documents:
            row = self.groups[key].texts[doc.text]
            emb = results[key]
            if id(doc) in self.multivector:
                out[id(doc)] = emb.multivectors[row].tolist()
            elif sparse:
                out[id(doc)] = qdrant_sparse(emb.sparse[row])
            else:
                out[id(doc)] = emb.vectors[row].astype("float32", copy=False).tolist()
        return out


def qdrant_sparse(vector: SparseVector) -> models.SparseVector:
    """A sidecar sparse vector as qdrant-client's SparseVector, with plain Python lists."""
    return models.SparseVector(indices=vector.indices.tolist(), values=vector.values.tolist())


def _call_options(key: EmbedKey, group: _Group, lane: str) -> dict[str, Any]:
    return dict(model=key.model, lane=lane, prompt=key.prompt, normalize=key.normalize,
                dimensions=key.dimensions, truncate=key.truncate, sparse=group.sparse,
                multivector=group.multivector)


def _named_error(err: FernError, key: EmbedKey, group: _Group) -> FernError:
    """The sidecar's error, saying which Document text it was about when it names an input."""
    where = f"Documents for model {key.model or '(default)'!r}"
    if err.index is not None and 0 <= err.index < len(group.texts):
        text = list(group.texts)[err.index]
        shown = text if len(text) <= 60 else text[:57] + "..."
        where = f"Document(text={shown!r})"
    return FernError(err.code, f"{where}: {err.message}", err.index)


class DocumentEmbedder:
    """Plans and applies the Document -> vector substitution for one FernModels configuration."""

    def __init__(self, fern_models: FernModels):
        self.models = fern_models

    def plan(self, request: Any) -> DocumentPlan:
        """Collect the Fern Documents of `request` (any nesting of qdrant-client models)."""
        documents: list[tuple[models.Document, EmbedKey, bool]] = []
        groups: dict[EmbedKey, _Group] = {}
        multivector: set[int] = set()

        def visit(doc: models.Document) -> None:
            sidecar_model = self.models.resolve(doc.model)
            if sidecar_model is None:
                return None
            key, sparse = document_key(doc, sidecar_model)
            group = groups.setdefault(key, _Group())
            group.texts.setdefault(doc.text, len(group.texts))
            group.sparse = group.sparse or sparse
            if (doc.options or {}).get("multivector", False):
                if sparse:
                    raise ValueError(f"Document(model={doc.model!r}): options sparse and multivector "
                                     "ask for two vectors; a Document is one of them")
                multivector.add(id(doc))
                group.multivector = True
            documents.append((doc, key, sparse))
            return None

        walk(request, visit)
        return DocumentPlan(documents, groups, multivector)

    def substitute(self, request: Any, fern: FernClient, lane: str) -> Any:
        """`request` with its Fern Documents replaced by sidecar vectors (one call per option set)."""
        plan = self.plan(request)
        if not plan:
            return request
        replacements = plan.embed(fern, lane)
        return walk(request, lambda doc: replacements.get(id(doc)))

    async def asubstitute(self, request: Any, fern: AsyncFernClient, lane: str) -> Any:
        """Async twin of `substitute`."""
        plan = self.plan(request)
        if not plan:
            return request
        replacements = await plan.aembed(fern, lane)
        return walk(request, lambda doc: replacements.get(id(doc)))


def walk(obj: Any, on_document: Callable[[models.Document], Any]) -> Any:
    """Rebuild `obj` with each Document replaced by `on_document(doc)` where that is not None.

    Unchanged parts are returned as the same objects (nothing is copied unless a Document
    inside it was replaced), so qdrant-client sees the caller's own objects.
    """
    if isinstance(obj, models.Document):
        new = on_document(obj)
        return obj if new is None else new
    if isinstance(obj, BaseModel):
        updates = {}
        for name in type(obj).model_fields:
            if name in _SKIPPED_FIELDS:
                continue
            value = getattr(obj, name)
            new = walk(value, on_document)
            if new is not value:
                updates[name] = new
        return obj.model_copy(update=updates) if updates else obj
    if isinstance(obj, (list, tuple)):
        # Plain vectors are long lists of numbers: skip them without visiting each one.
        if not obj or isinstance(obj[0], (int, float)):
            return obj
        items = [walk(v, on_document) for v in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        return items if isinstance(obj, list) else tuple(items)
    if isinstance(obj, dict):
        updated = {k: walk(v, on_document) for k, v in obj.items()}
        if all(updated[k] is v for k, v in obj.items()):
            return obj
        return updated
    return obj
