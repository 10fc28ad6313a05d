"""Engine on the CPU: defaults, packing layout, vectors against sentence-transformers, batch composition, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from core_engine.engine import Engine, PreparedBatch
from core_engine.graphs import GraphKey

TEXTS = [
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    "東京は日本の首都です。 Привет, мир! 😀",
    "def add(a, b):\n    return a + b\n",
    "Fern packs sequences end to end without padding. " * 30,  # past 256 tokens: truncated
]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine()


@pytest.fixture(scope="module")
def padded_engine() -> Engine:
    # The CUDA packing (token buckets, slot buckets, a padding slot) exercised on the CPU.
    return Engine(pad_to_buckets=True)


@pytest.fixture(scope="module")
def token_ids(engine: Engine) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(engine.spec.tokenizer_path))
    tok.no_padding()
    tok.enable_truncation(engine.spec.max_tokens)
    return [e.ids for e in tok.encode_batch(TEXTS)]


@pytest.fixture(scope="module")
def reference(engine: Engine) -> np.ndarray:
    """sentence-transformers' raw pooled vectors (Transformer + Pooling, Normalize left out)."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(engine.spec.path), device="cpu")
    raw = SentenceTransformer(modules=[st[0], st[1]], device="cpu")
    raw.max_seq_length = engine.spec.max_tokens
    return raw.encode(TEXTS, convert_to_numpy=True, batch_size=len(TEXTS))


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_defaults_are_the_bundled_model_on_cpu_in_fp32(engine: Engine) -> None:
    assert engine.spec.name == "all-MiniLM-L6-v2"
    assert engine.spec.dimensions == 384
    assert engine.device == torch.device("cpu")
    assert engine.dtype == torch.float32
    assert engine.attention.name == "cpu"


def test_vectors_match_sentence_transformers(engine: Engine, token_ids: list[list[int]],
                                             reference: np.ndarray) -> None:
    vectors = engine.embed(token_ids)
    assert vectors.dtype == np.float32 and vectors.shape == (len(TEXTS), 384)
    assert np.all(_cosine(vectors, reference) >= 0.99999)
    # Raw pooled, not normalized: the norms agree with the reference's too.
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), np.linalg.norm(reference, axis=1), rtol=1e-4)


def test_batch_composition_and_bucket_padding_do_not_change_vectors(
        engine: Engine, padded_engine: Engine, token_ids: list[list[int]]) -> None:
    together = engine.embed(token_ids)
    alone = np.stack([engine.embed([ids])[0] for ids in token_ids])
    shuffled = engine.embed(token_ids[::-1])[::-1]
    padded = padded_engine.embed(token_ids)
    padded_alone = padded_engine.embed([token_ids[2]])
    for other in (alone, shuffled, padded):
        np.testing.assert_allclose(other, together, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(padded_alone[0], together[2], atol=2e-5, rtol=1e-4)


def test_prepare_packs_tokens_positions_and_slots(engine: Engine) -> None:
    batch = engine.prepare([[101, 7, 102], [101, 8, 9, 10, 102]])
    assert isinstance(batch, PreparedBatch)
    assert batch.key == GraphKey(tokens=8, slots=2, max_seqlen=5)
    assert batch.input_ids.tolist() == [101, 7, 102, 101, 8, 9, 10, 102]
    assert batch.positions.tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    assert batch.seq_ids.tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert batch.cu_seqlens.tolist() == [0, 3, 8]
    assert batch.seq_lens.tolist() == [3, 5]
    assert batch.cu_seqlens_cpu.dtype == torch.int32


def test_padded_prepare_puts_padding_in_the_last_slot(padded_engine: Engine) -> None:
    batch = padded_engine.prepare([[101, 7, 102], [101, 8, 9, 10, 102]])
    assert batch.key == GraphKey(tokens=64, slots=4, max_seqlen=64)
    assert batch.num_seqs == 2 and batch.num_tokens == 8
    assert batch.cu_seqlens.tolist() == [0, 3, 8, 8, 64]  # slot 2 empty, slot 3 = 56 padding tokens
    assert batch.seq_lens.tolist() == [3, 5, 0, 56]
    assert batch.seq_ids[8:].tolist() == [3] * 56
    assert batch.positions[8:].tolist() == list(range(56))
    assert batch.input_ids[8:].tolist() == [0] * 56


def test_step_returns_a_finished_handle_on_cpu(engine: Engine, token_ids: list[list[int]]) -> None:
    before = engine.counters.eager_runs
    handle = engine.step(engine.prepare(token_ids[:2]))
    assert handle.done()
    assert handle.rows == 2
    assert handle.result().shape == (2, 384)
    assert engine.counters.eager_runs == before + 1


def test_bad_inputs_name_the_sequence(engine: Engine) -> None:
    with pytest.raises(ValueError, match="empty batch"):
        engine.prepare([])
    with pytest.raises(ValueError, match=r"sequences\[1\]: 0 tokens"):
        engine.prepare([[101, 102], []])
    with pytest.raises(ValueError, match=r"sequences\[0\]: 257 tokens"):
        engine.prepare([[5] * 257])


def test_bad_engine_options_are_named() -> None:
    with pytest.raises(ValueError, match="dtype 'fp64'"):
        Engine(dtype="fp64")
    with pytest.raises(ValueError, match="device 'tpu:0'"):
        Engine(device="tpu:0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            Engine(device="cuda")
        with pytest.raises(ValueError, match="attention 'varlen' needs a CUDA device"):
            Engine(attention="varlen")
    with pytest.raises(ValueError, match="attention backend 'nope' is unknown"):
        Engine(attention="nope")


@pytest.mark.slow
def test_compiled_forward_gives_the_same_vectors(tmp_path, monkeypatch) -> None:
    """The torch.compile path (attention outside the compiled regions) on the CPU, through
    aot_eager so no C++ toolchain is needed; on CUDA the default inductor backend runs."""
    from benchmarks.models import build_random_model

    monkeypatch.setenv("FERN_COMPILE_BACKEND", "aot_eager")
    model = build_random_model("bert", tmp_path / "bert", seed=3)
    plain = Engine(model, compile=False, pad_to_buckets=True)
    compiled = Engine(model, compile=True, pad_to_buckets=True)
    assert compiled.compiled and not plain.compiled
    rng = np.random.default_rng(0)
    for lengths in ([5, 40, 130], [7]):
        seqs = [[101, *rng.integers(1000, 30000, size=n - 2).tolist(), 102] for n in lengths]
        np.testing.assert_allclose(compiled.embed(seqs), plain.embed(seqs), atol=1e-5, rtol=1e-5)
