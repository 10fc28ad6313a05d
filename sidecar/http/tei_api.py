"""Text Embeddings Inference's API over the gateway: /embed, /embed_sparse, /tokenize and /info, as TEI shapes them.

As in TEI, `truncate` defaults to false (an input over the model's limit is a 413) and
`normalize` to true; `truncation_direction` "right" is the only one Fern cuts by (the end
of the text). Fern's extras: `model` (a served name; default the default model), `lane`
(or the X-Fern-Lane header), `dimensions` and `sparse_language` (the BM25 sparse vectors').
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np
from tokenizers import Tokenizer

from core_engine.config import ModelSpec
from sidecar.gateway import EmbedParams, EmbedResult
from sidecar.http.body import get_bool, get_dimensions, get_lane, get_str, get_texts
from sidecar.http.errors import HttpError

FIELD = "inputs"
VERSION = "fern-0.1.0"


def token_refusal() -> HttpError:
    return HttpError(422, "inputs: token ids are not accepted over HTTP; send text (token ids in the "
                          "model's own vocabulary go over gRPC: FernClient.embed_tokens)", param=FIELD)


def _truncate(payload: dict) -> bool:
    truncate = bool(get_bool(payload, "truncate", False))
    direction = get_str(payload, "truncation_direction", "right")
    if direction.lower() != "right":
        raise HttpError(422, f"truncation_direction: {direction!r} is not supported; Fern truncates at the "
                             "end of the text (\"right\")", param="truncation_direction")
    return truncate


def parse_embed(payload: dict, lane_header: str | None, max_inputs: int, *, sparse: bool = False) -> EmbedParams:
    """The gateway's params for a TEI /embed (or /embed_sparse) request."""
    return EmbedParams(
        texts=get_texts(payload, FIELD, max_inputs, token_refusal), model=get_str(payload, "model"),
        lane=get_lane(payload, lane_header), prompt_name=get_str(payload, "prompt_name"),
        normalize=get_bool(payload, "normalize", True), truncate=_truncate(payload),
        dimensions=get_dimensions(payload), return_sparse=sparse, dense=not sparse,
        sparse_language=get_str(payload, "sparse_language"))


def embed_response(result: EmbedResult) -> np.ndarray:
    """TEI's /embed body: one array of numbers per input (orjson writes the matrix as nested lists)."""
    return np.ascontiguousarray(result.vectors)


def sparse_response(result: EmbedResult) -> list[list[dict]]:
    """TEI's /embed_sparse body: [[{"index", "value"}, ...], ...] from Fern's sparse vectors: term
    frequencies, or the learned sparse head's weights for a model that has one (BGE-M3)."""
    return [[{"index": int(i), "value": float(v)} for i, v in zip(indices.tolist(), values.tolist())]
            for indices, values in result.sparse or ()]


@dataclass
class Tokenizers:
    """Each served model's tokenizer with offsets, loaded on first use, for /tokenize (TEI's shape)."""

    _loaded: dict[str, Tokenizer] = field(default_factory=dict)

    def _get(self, spec: ModelSpec) -> Tokenizer:
        tokenizer = self._loaded.get(spec.name)
        if tokenizer is None:
            tokenizer = Tokenizer.from_file(str(spec.tokenizer_path))
            tokenizer.no_padding()
            tokenizer.no_truncation()
            self._loaded[spec.name] = tokenizer
        return tokenizer

    async def tokenize(self, spec: ModelSpec, texts: list[str], add_special_tokens: bool) -> list[list[dict]]:
        """[[{"id", "text", "special", "start", "stop"}]] per text, tokenized off the event loop."""
        tokenizer = self._get(spec)

        def run() -> list[list[dict]]:
            out = []
            for text, encoding in zip(texts, tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)):
                tokens = []
                for token_id, piece, special, (start, stop) in zip(
                        encoding.ids, encoding.tokens, encoding.special_tokens_mask, encoding.offsets):
                    tokens.append({"id": token_id, "text": piece if special else text[start:stop],
                                   "special": bool(special), "start": None if special else start,
                                   "stop": None if special else stop})
                out.append(tokens)
            return out

        return await asyncio.to_thread(run)


def parse_tokenize(payload: dict, max_inputs: int) -> tuple[str, list[str], bool, str]:
    """A /tokenize request: (model, texts, add_special_tokens, prompt_name)."""
    texts = get_texts(payload, FIELD, max_inputs, token_refusal)
    return (get_str(payload, "model"), texts, bool(get_bool(payload, "add_special_tokens", True)),
            get_str(payload, "prompt_name"))


def info(spec: ModelSpec, max_inputs: int, max_batch_tokens: int) -> dict:
    """TEI's GET /info for the default model."""
    pooling = {"last": "last_token"}.get(spec.pooling, spec.pooling)
    model_type: dict = {"embedding": {"pooling": pooling}}
    if spec.kind == "reranker":  # TEI describes a reranker by its labels
        labels = spec.config.get("id2label") or {"0": "LABEL_0"}
        model_type = {"reranker": {"id2label": labels, "label2id": {v: int(k) for k, v in labels.items()}}}
    return {"model_id": spec.name, "model_sha": None, "model_dtype": "float32", "model_type":
            model_type, "max_concurrent_requests": None,
            "max_input_length": spec.max_tokens, "max_batch_tokens": max_batch_tokens,
            "max_batch_requests": None, "max_client_batch_size": max_inputs, "auto_truncate": False,
            "tokenization_workers": None, "version": VERSION, "sha": None, "docker_label": None,
            "prompts": spec.prompts, "default_prompt_name": spec.default_prompt_name}
