"""Fern's packed BERT path equals sentence-transformers on the bundled all-MiniLM-L6-v2."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from core_engine.attention import get_backend
from core_engine.batch import model_inputs, pack
from core_engine.config import ModelSpec, load_spec
from core_engine.graphs import GraphKey
from core_engine.loader import build_model, default_model_dir


@pytest.fixture(scope="module")
def spec() -> ModelSpec:
    return load_spec(default_model_dir())


@pytest.fixture(scope="module")
def model(spec: ModelSpec) -> torch.nn.Module:
    return build_model(spec, torch.device("cpu"), torch.float32, get_backend("cpu"))


@pytest.fixture(scope="module")
def token_ids(spec: ModelSpec, varied_texts: list[str]) -> list[list[int]]:
    # What the gateway does: no padding, truncation at the model's real limit.
    tok = Tokenizer.from_file(str(spec.tokenizer_path))
    tok.no_padding()
    tok.enable_truncation(spec.max_tokens)
    return [e.ids for e in tok.encode_batch(varied_texts)]


@pytest.fixture(scope="module")
def together(model: torch.nn.Module, spec: ModelSpec, token_ids: list[list[int]]) -> np.ndarray:
    """Every text in one packed batch."""
    return embed(model, spec, token_ids)


@pytest.fixture(scope="module")
def reference(varied_texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(default_model_dir()), device="cpu")
    return st.encode(varied_texts, batch_size=64, convert_to_numpy=True)


def embed(model: torch.nn.Module, spec: ModelSpec, seqs: list[list[int]], key: GraphKey | None = None) -> np.ndarray:
    with torch.inference_mode():
        return model(*model_inputs(*pack(seqs, key), spec.causal)).numpy()


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_spec_reads_sentence_transformers_files(spec: ModelSpec) -> None:
    assert spec.name == "all-MiniLM-L6-v2"
    assert (spec.family, spec.dimensions, spec.pooling) == ("bert", 384, "mean")
    assert spec.max_tokens == 256  # sentence_bert_config.json, not tokenizer.json's 128
    assert spec.normalize and not spec.causal and spec.position_offset == 0
    assert spec.vocab_size == 30522 and spec.tokenizer_path.name == "tokenizer.json"
    # Usable as a dict key (registries keep one engine per spec).
    assert {spec: 1}[load_spec(default_model_dir())] == 1


def test_texts_reach_past_the_limit(token_ids: list[list[int]], spec: ModelSpec) -> None:
    lengths = [len(t) for t in token_ids]
    assert max(lengths) == spec.max_tokens
    assert sum(n == spec.max_tokens for n in lengths) >= 10
    assert min(lengths) == 2  # whitespace-only: [CLS] [SEP]


def test_every_text_matches_sentence_transformers(
    together: np.ndarray, reference: np.ndarray, varied_texts: list[str]
) -> None:
    ours = together
    assert ours.shape == reference.shape == (len(varied_texts), 384)
    cos = cosine(ours, reference)
    worst = int(np.argmin(cos))
    assert cos.min() >= 0.99999, f"text {worst} {varied_texts[worst][:40]!r}: cosine {cos[worst]}"


def test_batch_composition_does_not_change_vectors(
    model: torch.nn.Module, spec: ModelSpec, token_ids: list[list[int]], together: np.ndarray
) -> None:
    n = len(token_ids)
    alone = np.concatenate([embed(model, spec, [t]) for t in token_ids])
    np.testing.assert_allclose(alone, together, rtol=1e-4, atol=2e-5)

    # One more pass: shuffled order, packed in chunks of varying size (1 to 40 texts).
    rng = random.Random(7)
    order = list(range(n))
    rng.shuffle(order)
    got = np.zeros_like(together)
    i = 0
    while i < n:
        idx = order[i : i + rng.randint(1, 40)]
        got[idx] = embed(model, spec, [token_ids[j] for j in idx])
        i += len(idx)
    np.testing.assert_allclose(got, together, rtol=1e-4, atol=2e-5)


def test_padded_slots_and_tokens_leave_vectors_alone(
    model: torch.nn.Module, spec: ModelSpec, token_ids: list[list[int]]
) -> None:
    # The CUDA-graph shape: bucket-padding tokens and empty trailing slots.
    seqs = token_ids[:9]
    plain = embed(model, spec, seqs)
    total = sum(len(s) for s in seqs)
    longest = max(max(len(s) for s in seqs), 37)
    padded = embed(model, spec, seqs, GraphKey(tokens=total + 37, slots=16, max_seqlen=longest))
    assert padded.shape == (16, 384)
    np.testing.assert_allclose(padded[:9], plain, rtol=1e-4, atol=2e-5)
    # Empty slots pool to zeros; the last slot is the padding's own (discarded) sequence.
    assert np.isfinite(padded).all() and not padded[9:15].any() and padded[15].any()
