from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Lane(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LANE_ONLINE: _ClassVar[Lane]
    LANE_BATCH: _ClassVar[Lane]

class Truncation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRUNCATION_END: _ClassVar[Truncation]
    TRUNCATION_ERROR: _ClassVar[Truncation]

class Encoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENCODING_FLOAT32: _ClassVar[Encoding]
    ENCODING_FLOAT16: _ClassVar[Encoding]
    ENCODING_INT8: _ClassVar[Encoding]
    ENCODING_BINARY: _ClassVar[Encoding]
LANE_ONLINE: Lane
LANE_BATCH: Lane
TRUNCATION_END: Truncation
TRUNCATION_ERROR: Truncation
ENCODING_FLOAT32: Encoding
ENCODING_FLOAT16: Encoding
ENCODING_INT8: Encoding
ENCODING_BINARY: Encoding

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("request_id", "model", "texts", "token_ids", "lane", "prompt_name", "normalize", "truncation", "dimensions", "encoding", "return_sparse", "return_multivector")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    RETURN_SPARSE_FIELD_NUMBER: _ClassVar[int]
    RETURN_MULTIVECTOR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    texts: _containers.RepeatedScalarFieldContainer[str]
    token_ids: _containers.RepeatedCompositeFieldContainer[TokenIds]
    lane: Lane
    prompt_name: str
    normalize: bool
    truncation: Truncation
    dimensions: int
    encoding: Encoding
    return_sparse: bool
    return_multivector: bool
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., texts: _Optional[_Iterable[str]] = ..., token_ids: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., lane: _Optional[_Union[Lane, str]] = ..., prompt_name: _Optional[str] = ..., normalize: _Optional[bool] = ..., truncation: _Optional[_Union[Truncation, str]] = ..., dimensions: _Optional[int] = ..., encoding: _Optional[_Union[Encoding, str]] = ..., return_sparse: _Optional[bool] = ..., return_multivector: _Optional[bool] = ...) -> None: ...

class SparseVector(_message.Message):
    __slots__ = ("indices", "values")
    INDICES_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    indices: _containers.RepeatedScalarFieldContainer[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, indices: _Optional[_Iterable[int]] = ..., values: _Optional[_Iterable[float]] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "message", "index")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    index: int
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., index: _Optional[int] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("request_id", "model", "count", "dimensions", "encoding", "vectors", "token_counts", "sparse", "error", "multivectors", "multivector_counts", "multivector_dimensions")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    VECTORS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MULTIVECTORS_FIELD_NUMBER: _ClassVar[int]
    MULTIVECTOR_COUNTS_FIELD_NUMBER: _ClassVar[int]
    MULTIVECTOR_DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    count: int
    dimensions: int
    encoding: Encoding
    vectors: bytes
    token_counts: _containers.RepeatedScalarFieldContainer[int]
    sparse: _containers.RepeatedCompositeFieldContainer[SparseVector]
    error: Error
    multivectors: bytes
    multivector_counts: _containers.RepeatedScalarFieldContainer[int]
    multivector_dimensions: int
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., count: _Optional[int] = ..., dimensions: _Optional[int] = ..., encoding: _Optional[_Union[Encoding, str]] = ..., vectors: _Optional[bytes] = ..., token_counts: _Optional[_Iterable[int]] = ..., sparse: _Optional[_Iterable[_Union[SparseVector, _Mapping]]] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., multivectors: _Optional[bytes] = ..., multivector_counts: _Optional[_Iterable[int]] = ..., multivector_dimensions: _Optional[int] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("name", "text")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    name: str
    text: str
    def __init__(self, name: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "dimensions", "max_tokens", "pooling", "prompts", "default_prompt_name", "normalize", "matryoshka_dimensions", "vocab_size", "distance", "native_int8", "learned_sparse", "multivector_dimensions", "kind")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    MATRYOSHKA_DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DISTANCE_FIELD_NUMBER: _ClassVar[int]
    NATIVE_INT8_FIELD_NUMBER: _ClassVar[int]
    LEARNED_SPARSE_FIELD_NUMBER: _ClassVar[int]
    MULTIVECTOR_DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    name: str
    dimensions: int
    max_tokens: int
    pooling: str
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    default_prompt_name: str
    normalize: bool
    matryoshka_dimensions: _containers.RepeatedScalarFieldContainer[int]
    vocab_size: int
    distance: str
    native_int8: bool
    learned_sparse: bool
    multivector_dimensions: int
    kind: str
    def __init__(self, name: _Optional[str] = ..., dimensions: _Optional[int] = ..., max_tokens: _Optional[int] = ..., pooling: _Optional[str] = ..., prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., default_prompt_name: _Optional[str] = ..., normalize: _Optional[bool] = ..., matryoshka_dimensions: _Optional[_Iterable[int]] = ..., vocab_size: _Optional[int] = ..., distance: _Optional[str] = ..., native_int8: _Optional[bool] = ..., learned_sparse: _Optional[bool] = ..., multivector_dimensions: _Optional[int] = ..., kind: _Optional[str] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models", "default_model")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MODEL_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    default_model: str
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ..., default_model: _Optional[str] = ...) -> None: ...

class RerankRequest(_message.Message):
    __slots__ = ("request_id", "model", "query", "documents", "top_n", "raw_scores", "return_documents", "truncation", "lane")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    TOP_N_FIELD_NUMBER: _ClassVar[int]
    RAW_SCORES_FIELD_NUMBER: _ClassVar[int]
    RETURN_DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    query: str
    documents: _containers.RepeatedScalarFieldContainer[str]
    top_n: int
    raw_scores: bool
    return_documents: bool
    truncation: Truncation
    lane: Lane
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., query: _Optional[str] = ..., documents: _Optional[_Iterable[str]] = ..., top_n: _Optional[int] = ..., raw_scores: _Optional[bool] = ..., return_documents: _Optional[bool] = ..., truncation: _Optional[_Union[Truncation, str]] = ..., lane: _Optional[_Union[Lane, str]] = ...) -> None: ...

class RankedDocument(_message.Message):
    __slots__ = ("index", "score", "document")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_FIELD_NUMBER: _ClassVar[int]
    index: int
    score: float
    document: str
    def __init__(self, index: _Optional[int] = ..., score: _Optional[float] = ..., document: _Optional[str] = ...) -> None: ...

class RerankResponse(_message.Message):
    __slots__ = ("request_id", "model", "results", "token_counts")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    results: _containers.RepeatedCompositeFieldContainer[RankedDocument]
    token_counts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., results: _Optional[_Iterable[_Union[RankedDocument, _Mapping]]] = ..., token_counts: _Optional[_Iterable[int]] = ...) -> None: ...
