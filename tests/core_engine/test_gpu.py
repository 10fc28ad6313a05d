"""GPU parity: every family and CUDA attention backend in bf16 against transformers fp32, eager and replayed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.models import TINY, build_random_model, reference_pooled, transformers_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

FAMILIES = list(TINY)  # bert, xlm-roberta, qwen3-causal, qwen3-bidirectional


def _flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


BACKENDS = ["varlen", pytest.param("flashinfer", marks=pytest.mark.skipif(
    not _flashinfer_available(), reason="flashinfer is not installed"))]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: build_random_model(name, root / name, seed=7) for name in FAMILIES}


@pytest.fixture(scope="module")
def references(model_dirs: dict[str, Path]) -> dict[str, torch.nn.Module]:
    from safetensors.torch import load_file

    refs = {}
    for name, path in model_dirs.items():
        model = transformers_model(TINY[name])
        model.load_state_dict(load_file(str(path / "model.safetensors")), strict=False)
        refs[name] = model.to("cuda", torch.float32).eval()
    return refs


def _sequences(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[101, *rng.integers(1000, 30000, size=n - 2).tolist(), 102] for n in lengths]


LENGTHS = [3, 7, 16, 31, 64, 65, 100, 128, 200, 257, 300, 511, 5, 12]


def _cosines(vectors: np.ndarray, ref: np.ndarray) -> np.ndarray:
    return (vectors * ref).sum(1) / (np.linalg.norm(vectors, axis=1) * np.linalg.norm(ref, axis=1))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_parity_across_compositions_and_graph_replay(family: str, backend: str,
                                                          model_dirs: dict[str, Path],
                                                          references: dict[str, torch.nn.Module]) -> None:
    from core_engine.engine import Engine

    engine = Engine(model_dirs[family], device="cuda", attention=backend)
    assert engine.dtype == torch.bfloat16 and engine.attention.name == backend
    seqs = _sequences(1, LENGTHS)
    arch = TINY[family]
    ref = np.stack([reference_pooled(references[family], s, arch.pooling, engine.spec.causal).numpy()
                    for s in seqs])

    runs = [engine.embed(seqs) for _ in range(3)]  # eager, capture, replay
    c = engine.counters
    assert (c.eager_runs, c.captures, c.replays) == (1, 1, 1)
    for vectors in runs:
        assert np.all(_cosines(vectors, ref) >= 0.999), _cosines(vectors, ref)
    np.testing.assert_allclose(runs[2], runs[0], rtol=2e-2, atol=2e-2)

    alone = np.stack([engine.embed([s])[0] for s in seqs])
    assert np.all(_cosines(alone, ref) >= 0.999)
    order = np.random.default_rng(2).permutation(len(seqs))
    halves = [order[: len(order) // 2], order[len(order) // 2:]]
    mixed = np.zeros_like(ref)
    for part in halves:
        for _ in range(3):  # the third pass replays this composition's graph
            mixed[part] = engine.embed([seqs[i] for i in part])
    assert np.all(_cosines(mixed, ref) >= 0.999)
    assert engine.counters.replays >= 3


def test_handle_is_asynchronous_and_result_waits(model_dirs: dict[str, Path]) -> None:
    from core_engine.engine import Engine

    engine = Engine(model_dirs["bert"], device="cuda", attention="varlen")
    batch = engine.prepare(_sequences(3, [500] * 64))
    assert batch.packed.is_pinned()
    handle = engine.step(batch)
    vectors = handle.result()
    assert handle.done()
    assert vectors.shape == (64, 256) and vectors.dtype == np.float32 and np.isfinite(vectors).all()


def test_prewarm_captures_at_start_and_lru_bound_keeps_results_right(model_dirs: dict[str, Path],
                                                                     references: dict[str, torch.nn.Module]) -> None:
    from core_engine.engine import Engine

    engine = Engine(model_dirs["qwen3-bidirectional"], device="cuda", attention="varlen",
                    prewarm=[(128, 1)], max_graphs=1)
    assert engine.counters.captures == 1
    seqs = _sequences(4, [128])
    engine.embed(seqs)
    assert engine.counters.replays == 1
    ref = reference_pooled(references["qwen3-bidirectional"], seqs[0], "mean", False).numpy()[None]
    other = _sequences(5, [40, 41])
    for _ in range(3):
        engine.embed(other)  # captures a second key: the first graph is evicted
    assert engine.counters.evictions == 1
    for _ in range(3):
        assert _cosines(engine.embed(seqs), ref)[0] >= 0.999


def test_auto_attention_measures_each_candidate(model_dirs: dict[str, Path]) -> None:
    from core_engine.engine import Engine

    engine = Engine(model_dirs["qwen3-causal"], device="cuda")
    assert set(engine.attention.measurements) == {"small", "large"}
    for cls, times in engine.attention.measurements.items():
        assert "varlen" in times and engine.attention.choices[cls] == min(times, key=times.get)


def test_qk_norm_rope_triton_kernel_serves_on_this_gpu():
    # The Qwen3 parity tests pass whether the Triton kernel or its torch fallback served; this
    # one fails when the kernel fell back, so a broken kernel shows up here, not as lost speed.
    pytest.importorskip("triton")
    from core_engine.layers import qk_norm_rope as m

    device = torch.device("cuda", torch.cuda.current_device())
    assert m._check(device), "the Triton q/k norm + rotary kernel failed its check (see the log)"
    torch.manual_seed(0)
    t, q_heads, kv_heads, d = 300, 16, 8, 128
    wide = torch.randn(t, (q_heads + 2 * kv_heads) * d, device=device, dtype=torch.bfloat16)
    qk = wide[:, : (q_heads + kv_heads) * d].view(t, q_heads + kv_heads, d)
    weight = torch.rand(q_heads + kv_heads, d, device=device, dtype=torch.bfloat16) + 0.5
    angles = torch.rand(t, 1, d // 2, device=device) * 100
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    q, k = m._triton_qk_norm_rope(qk, weight, cos, sin, 1e-6, q_heads)
    want = m.qk_norm_rope_reference(qk.float(), weight.float(), cos.float(), sin.float(), 1e-6)
    torch.testing.assert_close(q.float(), want[:, :q_heads], rtol=0.02, atol=0.05)
    torch.testing.assert_close(k.float(), want[:, q_heads:], rtol=0.02, atol=0.05)
