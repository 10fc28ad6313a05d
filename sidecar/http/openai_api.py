"""OpenAI's embeddings API over the gateway: `POST /v1/embeddings` requests in, OpenAI-shaped responses out.

Beyond OpenAI's fields (`input`, `model`, `dimensions`, `encoding_format`, `user`) a request
may carry Fern's: `lane` ("online" | "batch"; or the X-Fern-Lane header), `prompt_name`,
`normalize`, `truncate` (default true: cut at the model's limit), `encoding` (float32,
float16, int8, binary: the vector's storage type) and `sparse` (also return each input's
sparse lexical vector as `data[].sparse`).
"""

from __future__ import annotations

import base64

import numpy as np

from core_engine.config import ModelSpec
from sidecar import encodings
from sidecar.gateway import EmbedParams, EmbedResult
from sidecar.http.body import get_bool, get_dimensions, get_encoding, get_lane, get_str, get_texts
from sidecar.http.errors import HttpError

FIELD = "input"
ENCODING_FORMATS = ("float", "base64")


def token_refusal(model: str) -> HttpError:
    """Why token-id input is refused: its ids are tiktoken's, not the served model's vocabulary."""
    return HttpError(
        400, f"input: token ids are not accepted here. OpenAI clients tokenize with tiktoken "
             f"(cl100k_base), whose ids are not the vocabulary of {model!r}: embedding them would "
             "give meaningless vectors. Send the text instead; with LangChain, "
             "OpenAIEmbeddings(..., check_embedding_ctx_length=False) does. Token ids in the model's "
             "own vocabulary go over gRPC (FernClient.embed_tokens).",
        param=FIELD, code="token_ids_not_supported")


def parse(payload: dict, lane_header: str | None, default_model: str, max_inputs: int) -> tuple[EmbedParams, str]:
    """The gateway's params for an OpenAI request, and its `encoding_format`."""
    model = get_str(payload, "model") or default_model
    texts = get_texts(payload, FIELD, max_inputs, lambda: token_refusal(model))
    encoding_format = get_str(payload, "encoding_format", "float")
    if encoding_format not in ENCODING_FORMATS:
        raise HttpError(400, f"encoding_format: {encoding_format!r} is not one of float, base64",
                        param="encoding_format", code="invalid_value")
    params = EmbedParams(
        texts=texts, model=model, lane=get_lane(payload, lane_header),
        prompt_name=get_str(payload, "prompt_name"), normalize=get_bool(payload, "normalize", None),
        truncate=bool(get_bool(payload, "truncate", True)), dimensions=get_dimensions(payload),
        encoding=get_encoding(payload), return_sparse=bool(get_bool(payload, "sparse", False)),
        sparse_language=get_str(payload, "sparse_language"))
    return params, encoding_format


def response(result: EmbedResult, encoding_format: str) -> dict:
    """OpenAI's response body: data[].embedding as numbers, or as base64 of the little-endian row."""
    vectors = np.ascontiguousarray(result.vectors, dtype=encodings.BY_NAME[result.encoding].dtype)
    if encoding_format == "base64":
        embeddings: list = [base64.b64encode(row.tobytes()).decode() for row in vectors]
    else:
        embeddings = list(vectors)  # numpy rows: orjson writes them as numbers
    data = [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(embeddings)]
    if result.sparse is not None:
        for item, (indices, values) in zip(data, result.sparse):
            item["sparse"] = {"indices": indices, "values": values}
    tokens = int(sum(result.token_counts))
    return {"object": "list", "data": data, "model": result.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def model_entry(spec: ModelSpec) -> dict:
    """A served model as GET /v1/models lists it (OpenAI's fields, then Fern's)."""
    return {"id": spec.name, "object": "model", "created": 0, "owned_by": "fern",
            "dimensions": spec.dimensions, "max_tokens": spec.max_tokens, "pooling": spec.pooling,
            "normalize": spec.normalize, "prompts": spec.prompts,
            "matryoshka_dimensions": list(spec.matryoshka_dimensions), "kind": spec.kind}
