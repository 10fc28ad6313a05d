"""Creates a Qdrant collection shaped for a sidecar model (from ListModels) and reads that shape back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qdrant_client import QdrantClient, models

from sidecar import encodings
from sidecar.client import FernClient, ModelInfo

DENSE = "dense"
SPARSE = "sparse"
MULTIVECTOR = "colbert"
_METADATA_KEY = "fern"
_DISTANCES = {"cosine": models.Distance.COSINE, "dot": models.Distance.DOT}
# Fern's encodings as Qdrant stores them: floats as a vector datatype, int8/binary as quantization.
_DATATYPES = {encodings.FLOAT32.name: models.Datatype.FLOAT32, encodings.FLOAT16.name: models.Datatype.FLOAT16}
QUANTIZATIONS = (encodings.INT8.name, encodings.BINARY.name)


@dataclass(frozen=True)
class CollectionLayout:
    """Which sidecar model fills a collection and under which vector names.

    `model` is the sidecar's model name (as ListModels gives it); `sparse` is None for a
    collection without the sparse lexical vector (no hybrid search); `multivector` names the
    model's multi-vectors (ColBERT, compared by MaxSim; searches rerank by it), None without.
    """

    model: str
    dense: str = DENSE
    sparse: str | None = SPARSE
    multivector: str | None = None

    def metadata(self) -> dict[str, Any]:
        stored = {"model": self.model, "dense": self.dense, "sparse": self.sparse}
        if self.multivector is not None:
            stored["multivector"] = self.multivector
        return {_METADATA_KEY: stored}


def quantization_config(quantization: str | None) -> models.QuantizationConfig | None:
    """Qdrant's quantization settings matching a Fern output encoding ("int8", "binary" or None)."""
    if quantization is None:
        return None
    if quantization == "int8":
        return models.ScalarQuantization(scalar=models.ScalarQuantizationConfig(
            type=models.ScalarType.INT8, always_ram=True))
    if quantization == "binary":
        return models.BinaryQuantization(binary=models.BinaryQuantizationConfig(always_ram=True))
    raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)} or None, got {quantization!r}")


def setup_collection(client: QdrantClient, fern: FernClient, collection: str, model: str = "", *,
                     dense: str = DENSE, sparse: str | bool | None = SPARSE,
                     quantization: str | None = None, datatype: str = "float32",
                     on_disk: bool = False, multivector: str | bool | None = None) -> CollectionLayout:
    """Create `collection` for `model` unless it exists; returns its layout.

    The dense vector gets the model's size and distance (ListModels), the sparse one
    Qdrant's IDF modifier (the sidecar sends BM25 term weights, the modifier adds the IDF; a model with
    a learned sparse head, BGE-M3, sends finished weights and gets none). An existing
    collection is checked, not changed: a dense vector of the wrong size is an error naming
    the collection. `sparse` is the sparse vector's name (True: "sparse"; None or False: no
    sparse vector). `multivector` adds the model's multi-vectors (True: "colbert"), compared
    by MaxSim and used to rerank what the dense and sparse vectors find; without an HNSW
    graph of their own, as nothing searches them directly. A model without a ColBERT head
    (ListModels' multivector_dimensions 0) cannot have one.
    """
    if isinstance(sparse, bool):
        sparse = SPARSE if sparse else None
    if isinstance(multivector, bool):
        multivector = MULTIVECTOR if multivector else None
    info = fern.model(model)
    if multivector and not info.multivector_dimensions:
        raise ValueError(f"model {info.name!r} has no multi-vector (ColBERT) head; "
                         f"create {collection!r} without multivector=")
    layout = CollectionLayout(model=info.name, dense=dense, sparse=sparse, multivector=multivector)
    if client.collection_exists(collection):
        _check_existing(client, collection, layout, info)
        return layout
    if datatype not in _DATATYPES:
        raise ValueError(f"datatype must be one of {list(_DATATYPES)}, got {datatype!r}")
    if info.distance not in _DISTANCES:
        raise ValueError(f"model {info.name!r} suggests distance {info.distance!r}, "
                         f"which has no Qdrant equivalent here ({list(_DISTANCES)})")
    vectors_config = {dense: models.VectorParams(
        size=info.dimensions, distance=_DISTANCES[info.distance],
        datatype=_DATATYPES[datatype], on_disk=on_disk)}
    if multivector:
        vectors_config[multivector] = multivector_params(info, datatype, on_disk)
    modifier = None if info.learned_sparse else models.Modifier.IDF
    client.create_collection(
        collection,
        vectors_config=vectors_config,
        sparse_vectors_config=(
            {sparse: models.SparseVectorParams(modifier=modifier)} if sparse else None),
        quantization_config=quantization_config(quantization),
        metadata=layout.metadata(),
    )
    return layout


def multivector_params(info: ModelInfo, datatype: str = "float32", on_disk: bool = False) -> models.VectorParams:
    """The multi-vector of a model with a ColBERT head: its width, cosine (the vectors are
    unit length), MaxSim between a query's and a point's vectors, no HNSW graph (m=0)."""
    return models.VectorParams(
        size=info.multivector_dimensions, distance=models.Distance.COSINE, datatype=_DATATYPES[datatype],
        on_disk=on_disk, multivector_config=models.MultiVectorConfig(comparator=models.MultiVectorComparator.MAX_SIM),
        hnsw_config=models.HnswConfigDiff(m=0))


def collection_layout(client: QdrantClient, collection: str) -> CollectionLayout:
    """The layout setup_collection stored in the collection's metadata, else one inferred from it.

    For a collection made elsewhere: the dense vector is the one named "dense" or the only
    named one, the sparse vector "sparse" if present, the model the sidecar's default.
    """
    return layout_from_config(collection, client.get_collection(collection).config)


def layout_from_config(collection: str, config: models.CollectionConfig) -> CollectionLayout:
    """collection_layout's reading of an already fetched collection config."""
    stored = (config.metadata or {}).get(_METADATA_KEY)
    if isinstance(stored, dict) and stored.get("dense"):
        return CollectionLayout(model=stored.get("model") or "", dense=stored["dense"],
                                sparse=stored.get("sparse"), multivector=stored.get("multivector"))
    vectors = config.params.vectors
    if not isinstance(vectors, dict) or not vectors:
        raise ValueError(f"collection {collection!r} has no named dense vector; "
                         f"create it with setup_collection()")
    dense = DENSE if DENSE in vectors else next(iter(vectors)) if len(vectors) == 1 else None
    if dense is None:
        raise ValueError(f"collection {collection!r} has several dense vectors "
                         f"({sorted(vectors)}) and none named {DENSE!r}: say which with dense=")
    sparse_vectors = config.params.sparse_vectors or {}
    return CollectionLayout(model="", dense=dense, sparse=SPARSE if SPARSE in sparse_vectors else None)


def _check_existing(client: QdrantClient, collection: str, layout: CollectionLayout,
                    info: ModelInfo) -> None:
    params = client.get_collection(collection).config.params
    vectors = params.vectors if isinstance(params.vectors, dict) else {}
    if layout.dense not in vectors:
        raise ValueError(f"collection {collection!r} exists without a dense vector named "
                         f"{layout.dense!r} (it has {sorted(vectors)})")
    size = vectors[layout.dense].size
    if size != info.dimensions:
        raise ValueError(f"collection {collection!r}: vector {layout.dense!r} has size {size}, "
                         f"but model {info.name!r} gives {info.dimensions} dimensions")
    if layout.sparse and layout.sparse not in (params.sparse_vectors or {}):
        raise ValueError(f"collection {collection!r} exists without a sparse vector named "
                         f"{layout.sparse!r}; pass sparse=None for dense-only ingest")
    if layout.multivector and (layout.multivector not in vectors
                               or vectors[layout.multivector].multivector_config is None):
        raise ValueError(f"collection {collection!r} exists without a multi-vector named "
                         f"{layout.multivector!r}; leave multivector= out for it")
