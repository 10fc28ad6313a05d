"""BGE-M3's three outputs from one forward pass (dense, learned sparse, ColBERT) against the model card's formulas."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from core_engine.config import load_spec
from core_engine.engine import Engine
from core_engine.token_outputs import StepResult, learned_sparse
from tests.bge_m3_checkpoint import build_bge_m3, m3_reference, sparse_gap, xlmr_tokenizer

TEXTS = ["Hello, world!", "the quick brown fox jumps over the lazy dog, the dog", "a",
         "vector search with late interaction retrieval in qdrant and postgres " * 3,
         "東京 café", "what is the capital of france?"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    return build_bge_m3(tmp_path_factory.mktemp("bge-m3") / "bge-m3", seed=11)


@pytest.fixture(scope="module")
def sequences() -> list[list[int]]:
    tokenizer = xlmr_tokenizer()
    seqs = [tokenizer.encode(t).ids for t in TEXTS]
    seqs.append([0, 2])  # nothing between CLS and EOS: one multi-vector (EOS), an empty sparse vector
    return seqs


def assert_outputs_match(result: StepResult, refs, sequences, unused, *, atol: float = 1e-4,
                         sparse_atol: float | None = None, colbert_cos: float | None = None) -> None:
    pooled = result.pooled / np.linalg.norm(result.pooled, axis=1, keepdims=True)
    np.testing.assert_allclose(pooled, torch.stack([r.dense for r in refs]).numpy(), atol=atol)
    for i, (seq, ref) in enumerate(zip(sequences, refs)):
        rows = result.tokens.rows(i)
        indices, values = learned_sparse(seq, rows.weights, unused)
        ours = dict(zip(indices.tolist(), values.tolist()))
        if colbert_cos is None:  # fp32: the same token set exactly
            assert indices.tolist() == sorted(ref.sparse), f"text {i}: sparse token ids"
        for token in set(ours) | set(ref.sparse):  # bf16 may move a weight near 0 across relu
            assert ours.get(token, 0.0) == pytest.approx(ref.sparse.get(token, 0.0),
                                                         abs=sparse_atol or atol), f"text {i}, token {token}"
        assert rows.multivector.shape == tuple(ref.colbert.shape) == (len(seq) - 1, ref.colbert.shape[1])
        if colbert_cos is None:
            np.testing.assert_allclose(rows.multivector, ref.colbert.numpy(), atol=atol)
        else:
            cos = (rows.multivector * ref.colbert.numpy()).sum(1)
            assert cos.min() >= colbert_cos, f"text {i}: ColBERT cosines {cos}"


def test_spec_reads_both_heads_and_the_tokens_sparse_leaves_out(checkpoint) -> None:
    spec = load_spec(checkpoint.path)
    assert (spec.family, spec.pooling, spec.normalize) == ("xlm-roberta", "cls", True)
    assert (spec.sparse_head, spec.colbert_dim, spec.unused_token_ids) == (True, 64, (0, 1, 2, 3))


@pytest.mark.parametrize("pad_to_buckets", [False, True])
def test_one_packed_step_gives_dense_sparse_and_colbert_of_the_reference(checkpoint, sequences,
                                                                         pad_to_buckets) -> None:
    engine = Engine(checkpoint.path, device="cpu", dtype="fp32", pad_to_buckets=pad_to_buckets)
    result = engine.step(engine.prepare(sequences, token_outputs=True)).result()
    assert isinstance(result, StepResult)
    refs = m3_reference(checkpoint, sequences)
    assert any(ref.sparse for ref in refs) and not refs[-1].sparse
    assert_outputs_match(result, refs, sequences, engine.spec.unused_token_ids)
    # The dense-only step (last layer on the CLS rows alone) gives the same pooled vectors.
    np.testing.assert_allclose(engine.embed(sequences), result.pooled, atol=1e-5)


def test_the_reference_would_catch_a_wrong_token_set_or_a_missing_normalization(checkpoint, sequences) -> None:
    engine = Engine(checkpoint.path, device="cpu", dtype="fp32")
    result = engine.step(engine.prepare(sequences, token_outputs=True)).result()
    rows = result.tokens.rows(1)
    # Keeping the special tokens would put some of them (CLS, EOS, UNK) into the sparse vectors.
    extra = set()
    for i, seq in enumerate(sequences):
        kept, _ = learned_sparse(seq, result.tokens.rows(i).weights)
        dropped, _ = learned_sparse(seq, result.tokens.rows(i).weights, engine.spec.unused_token_ids)
        extra |= set(kept.tolist()) - set(dropped.tolist())
    assert extra and extra <= {0, 1, 2, 3}
    # ColBERT rows are unit vectors, and they are the rows after CLS (EOS included).
    np.testing.assert_allclose(np.linalg.norm(rows.multivector, axis=1), 1.0, atol=1e-5)
    ref = m3_reference(checkpoint, [sequences[1]])[0].colbert.numpy()
    assert not np.allclose(result.tokens.rows(1).multivector[:-1], ref[1:], atol=1e-2)


def test_one_head_alone(tmp_path: Path, sequences) -> None:
    only_colbert = build_bge_m3(tmp_path / "colbert", seed=3, sparse=False, colbert_dim=24)
    spec = load_spec(only_colbert.path)
    assert (spec.sparse_head, spec.colbert_dim) == (False, 24)
    engine = Engine(only_colbert.path, device="cpu", dtype="fp32")
    result = engine.step(engine.prepare(sequences, token_outputs=True)).result()
    refs = m3_reference(only_colbert, sequences)
    for i, ref in enumerate(refs):
        rows = result.tokens.rows(i)
        assert rows.weights is None
        np.testing.assert_allclose(rows.multivector, ref.colbert.numpy(), atol=1e-4)
    only_sparse = build_bge_m3(tmp_path / "sparse", seed=4, colbert=False)
    engine = Engine(only_sparse.path, device="cpu", dtype="fp32")
    result = engine.step(engine.prepare(sequences, token_outputs=True)).result()
    for i, ref in enumerate(m3_reference(only_sparse, sequences)):
        rows = result.tokens.rows(i)
        assert rows.multivector is None
        indices, values = learned_sparse(sequences[i], rows.weights, engine.spec.unused_token_ids)
        assert dict(zip(indices.tolist(), values.tolist())) == pytest.approx(ref.sparse, abs=1e-4)


def test_a_model_without_heads_refuses_token_outputs(tmp_path: Path) -> None:
    ckpt = build_bge_m3(tmp_path / "plain", seed=5, sparse=False, colbert=False)
    engine = Engine(ckpt.path, device="cpu", dtype="fp32")
    assert not engine.has_token_heads
    with pytest.raises(ValueError, match="has no sparse_linear.pt or colbert_linear.pt head"):
        engine.prepare([[0, 5, 2]], token_outputs=True)


def test_bad_head_files_are_named(tmp_path: Path) -> None:
    ckpt = build_bge_m3(tmp_path / "bad", seed=6)
    torch.save({"weight": torch.zeros(1, 32), "bias": torch.zeros(1)}, ckpt.path / "sparse_linear.pt")
    with pytest.raises(ValueError, match=r"sparse_linear.pt: weight \(1, 32\).*Linear\(64, out\)"):
        load_spec(ckpt.path)
    torch.save({"weight": torch.zeros(2, 64), "bias": torch.zeros(2)}, ckpt.path / "sparse_linear.pt")
    with pytest.raises(ValueError, match="sparse_linear.pt: a sparse head has one output"):
        load_spec(ckpt.path)
    torch.save({"w": torch.zeros(1, 64)}, ckpt.path / "sparse_linear.pt")
    with pytest.raises(ValueError, match="sparse_linear.pt: expected a Linear state dict"):
        load_spec(ckpt.path)
    (ckpt.path / "colbert_linear.pt").write_bytes(b"not a checkpoint")
    (ckpt.path / "sparse_linear.pt").unlink()
    with pytest.raises(ValueError, match="colbert_linear.pt: not a readable torch state dict"):
        load_spec(ckpt.path)


def test_unused_tokens_fall_back_to_config_ids_without_tokenizer_config(tmp_path: Path) -> None:
    ckpt = build_bge_m3(tmp_path / "m3", seed=8)
    (ckpt.path / "tokenizer_config.json").unlink()
    assert load_spec(ckpt.path).unused_token_ids == (0, 1, 2, 3)  # bos, pad, eos from config; unk from Unigram
    (ckpt.path / "special_tokens_map.json").write_text(json.dumps({"cls_token": "<s>", "unk_token": "<unk>"}))
    assert load_spec(ckpt.path).unused_token_ids == (0, 3)


def test_learned_sparse_takes_the_largest_weight_per_token_and_drops_zeros() -> None:
    indices, values = learned_sparse([0, 9, 5, 9, 7, 2], np.array([3.0, 0.5, 0.0, 0.25, 1.5, 4.0]), (0, 2))
    assert indices.tolist() == [7, 9] and values.tolist() == [1.5, 0.5]
    assert indices.dtype == np.uint32 and values.dtype == np.float32
    with pytest.raises(ValueError, match="3 token ids but 2 weights"):
        learned_sparse([1, 2, 3], np.zeros(2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_on_the_gpu_eager_captured_and_replayed_matches_the_fp32_reference(checkpoint, sequences) -> None:
    engine = Engine(checkpoint.path, device="cuda", dtype="bf16", cuda_graphs=True, eager_hits=1)
    refs = m3_reference(checkpoint, sequences)
    # A sparse weight is a linear of the whole hidden state, so bf16's error in that state
    # reaches it undivided: transformers itself in bf16 moves these weights by ~0.03 (up to
    # ~4). Fern may stray twice as far as that; a wrong head or token set strays by whole units.
    sparse_atol = max(3e-2, 2 * sparse_gap(m3_reference(checkpoint, sequences, torch.bfloat16), refs))
    for _ in range(3):  # eager, capture, replay
        result = engine.step(engine.prepare(sequences, token_outputs=True)).result()
        assert_outputs_match(result, refs, sequences, engine.spec.unused_token_ids, atol=3e-2,
                             sparse_atol=sparse_atol, colbert_cos=0.995)
    assert engine.counters.replays >= 1 and engine.counters.captures >= 1
    # A dense-only step between token-output steps keeps its own graph and its own vectors.
    dense = engine.embed(sequences)
    np.testing.assert_allclose(dense / np.linalg.norm(dense, axis=1, keepdims=True),
                               torch.stack([r.dense for r in refs]).numpy(), atol=3e-2)
