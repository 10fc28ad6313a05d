"""Unit checks of the model's parts: CPU attention, pooling on padded batches, capture safety, spec reading."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from core_engine.attention import backend_names, get_backend
from core_engine.attention.base import AttentionBackend, AttentionMetadata
from core_engine.batch import model_inputs, pack
from core_engine.config import load_spec
from core_engine.graphs import GraphKey
from core_engine.loader import build_model, default_model_dir
from core_engine.models import FAMILIES
from core_engine.pooling import pool
from core_engine.settings import KernelOptions


def naive_attention(q, k, v, cu: list[int], causal: bool) -> torch.Tensor:
    """Explicit softmax(q k^T / sqrt(d)) v per sequence, K/V heads repeated for GQA."""
    out = torch.zeros_like(q)
    group = q.shape[1] // k.shape[1]
    for s, e in zip(cu[:-1], cu[1:]):
        if e == s:
            continue
        qs, ks, vs = q[s:e], k[s:e].repeat_interleave(group, 1), v[s:e].repeat_interleave(group, 1)
        scores = torch.einsum("ihd,jhd->hij", qs, ks) / qs.shape[-1] ** 0.5
        if causal:
            scores = scores.masked_fill(torch.ones(e - s, e - s, dtype=torch.bool).triu(1), float("-inf"))
        out[s:e] = torch.einsum("hij,jhd->ihd", scores.softmax(-1), vs)
    return out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_cpu_attention_matches_naive_attention(causal: bool, kv_heads: int) -> None:
    g = torch.Generator().manual_seed(0)
    lens = [5, 0, 1, 17, 0, 9]
    _, _, meta = model_inputs(*pack([[1] * n for n in lens]), causal)
    t = sum(lens)
    q = torch.randn(t, 4, 8, generator=g)
    k = torch.randn(t, kv_heads, 8, generator=g)
    v = torch.randn(t, kv_heads, 8, generator=g)
    got = get_backend("cpu")(q, k, v, meta)
    want = naive_attention(q, k, v, meta.cu_seqlens.tolist(), causal)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Without the host copy of cu_seqlens the backend reads the device tensor instead.
    meta.cu_seqlens_cpu = None
    torch.testing.assert_close(get_backend("cpu")(q, k, v, meta), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["bert", "qwen3-causal"])
def test_cls_and_last_token_models_run_the_last_layer_on_the_pooled_rows_only(tmp_path, arch: str) -> None:
    """After the last attention, a CLS or last-token model carries one row per slot, not every token.

    Same vectors as the full last layer (KernelOptions(pool_early=False)), on a batch padded the way
    graphs pad it: empty slots in the middle and before the last, and the bucket padding as
    the last slot, whose first row a CLS model reads for the empty slot before it.
    """
    from benchmarks.models import build_random_model

    spec = load_spec(build_random_model(arch, tmp_path / arch, seed=0))
    assert spec.pooling in ("cls", "last")
    inputs = model_inputs(*pack([list(range(100, 105)), [], list(range(200, 207)), [7]], GraphKey(20, 6, 64)),
                          spec.causal)

    def run(full: str) -> tuple[torch.Tensor, list[int]]:
        kernels = KernelOptions.from_env({"FERN_FULL_LAST_LAYER": full})
        model = build_model(spec, "cpu", torch.float32, get_backend("cpu"), kernels)
        rows: list[int] = []
        model.layers[-1].mlp.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0]))
        model.layers[0].mlp.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0]))
        with torch.inference_mode():
            return model(*inputs), rows

    early, early_rows = run("0")
    full, full_rows = run("1")
    assert early_rows == [20, 6] and full_rows == [20, 20]
    assert early.shape == (6, spec.config["hidden_size"]) and torch.isfinite(early).all()
    assert not early[[1, 4]].any()  # the empty slots (the last is the padding's own)
    torch.testing.assert_close(early, full, rtol=1e-5, atol=1e-5)


def test_unknown_backend_names_the_choices() -> None:
    assert "cpu" in backend_names()
    with pytest.raises(ValueError, match="'nope' is unknown"):
        get_backend("nope")


def test_pooling_with_empty_slots_and_nan_padding_rows() -> None:
    # Slots of 0, 3, 0 and 2 tokens, two empty slots after them, and three rows of no slot
    # (seq_ids = B) that may hold anything: the metadata contract, whoever packs the batch.
    cu = torch.tensor([0, 0, 3, 3, 5, 5, 5], dtype=torch.int32)
    meta = AttentionMetadata(cu_seqlens=cu, max_seqlen=8, seq_ids=torch.tensor([1, 1, 1, 3, 3, 6, 6, 6]),
                             seq_lens=torch.tensor([0, 3, 0, 2, 0, 0]), causal=False, cu_seqlens_cpu=cu)
    hidden = torch.arange(8 * 2, dtype=torch.float32).view(8, 2)
    hidden[5:] = float("nan")
    mean = pool(hidden, meta, "mean")
    cls = pool(hidden, meta, "cls")
    last = pool(hidden, meta, "last")
    for out in (mean, cls, last):
        assert out.shape == (6, 2) and out.dtype == torch.float32 and torch.isfinite(out).all()
        assert not out[[0, 2, 4, 5]].any()
    torch.testing.assert_close(mean[1], hidden[0:3].mean(0))
    torch.testing.assert_close(mean[3], hidden[3:5].mean(0))
    torch.testing.assert_close(cls[[1, 3]], hidden[[0, 3]])
    torch.testing.assert_close(last[[1, 3]], hidden[[2, 4]])
    with pytest.raises(ValueError, match="pooling 'max'"):
        pool(hidden, meta, "max")


class ShapeOnlyAttention:
    """A stand-in backend that only keeps shapes, so the model can run on the meta device."""

    name = "shape-only"

    def __call__(self, q, k, v, meta):
        return q * 1.0


@pytest.mark.parametrize("family", ["bert", "qwen3"])
def test_forward_never_reads_tensor_values_on_the_host(family: str) -> None:
    # Meta tensors have no data: .item(), .tolist(), bool(t) or data-dependent shapes fail on
    # them. A forward that runs on meta inputs therefore has no host sync of its own and can
    # be captured in a CUDA graph (given a capturable attention backend).
    spec = load_spec(default_model_dir())
    if family == "qwen3":
        cfg = dict(
            model_type="qwen3", vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        )
        spec = dataclasses.replace(spec, family="qwen3", config=cfg, pooling="last", causal=True)
    backend: AttentionBackend = ShapeOnlyAttention()
    with torch.device("meta"):
        model = FAMILIES[family].module(spec, backend)
    model.to("meta")
    buf, key = pack([[1, 2, 3], [], [4]], GraphKey(8, 5, 8))
    out = model(*model_inputs(buf.to("meta"), key, spec.causal))
    assert out.device.type == "meta" and out.shape == (5, spec.dimensions if family == "bert" else 32)
    assert out.dtype == torch.float32


def test_model_rejects_a_mismatched_causal_flag() -> None:
    spec = load_spec(default_model_dir())
    model = build_model(spec, "cpu", torch.float32, get_backend("cpu"))
    with pytest.raises(ValueError, match="causal"):
        model(*model_inputs(*pack([[101, 102]]), True))


def test_bfloat16_stays_close_to_float32() -> None:
    spec = load_spec(default_model_dir())
    seqs = [[101, 7592, 2088, 102], [101] + list(range(2000, 2030)) + [102]]
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = build_model(spec, "cpu", dtype, get_backend("cpu"))
        assert next(model.parameters()).dtype == dtype
        with torch.inference_mode():
            out[dtype] = model(*model_inputs(*pack(seqs), False))
    assert out[torch.bfloat16].dtype == torch.float32
    cos = torch.nn.functional.cosine_similarity(out[torch.float32], out[torch.bfloat16])
    assert cos.min() > 0.999


# -- load_spec -----------------------------------------------------------------------------


def write_dir(path: Path, config: dict, **files: object) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    files.setdefault("tokenizer.json", {"post_processor": None})
    for name, content in files.items():
        target = path / name.replace("__", "/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(content))
    return path


QWEN3 = {"model_type": "qwen3", "hidden_size": 1024, "vocab_size": 151669, "max_position_embeddings": 32768, "eos_token_id": 151643}


def test_spec_for_a_qwen3_embedding_directory(tmp_path: Path) -> None:
    eos_template = {
        "type": "TemplateProcessing",
        "single": [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [151643], "tokens": ["<|endoftext|>"]}},
    }
    prompts = {"query": "Instruct: Given a web search query, retrieve relevant passages\nQuery:", "document": ""}
    path = write_dir(
        tmp_path / "models--Qwen--Qwen3-Embedding-0.6B" / "snapshots" / "abc123",
        QWEN3,
        **{
            "modules.json": [
                {"path": "", "type": "sentence_transformers.models.Transformer"},
                {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                {"path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
            ],
            "1_Pooling__config.json": {"pooling_mode_lasttoken": True},
            "config_sentence_transformers.json": {"prompts": prompts, "default_prompt_name": None, "similarity_fn_name": "cosine"},
            "sentence_bert_config.json": {"max_seq_length": 8192},
            "tokenizer.json": {"post_processor": eos_template},
        },
    )
    spec = load_spec(path)
    assert spec.name == "Qwen3-Embedding-0.6B"
    assert (spec.family, spec.causal, spec.pooling, spec.normalize, spec.max_tokens) == ("qwen3", True, "last", True, 8192)
    assert spec.prompts == prompts and spec.default_prompt_name is None and spec.distance == "cosine"
    assert spec.eos_token_id == 151643 and not spec.append_eos  # the tokenizer already appends it
    assert load_spec(path, name="qwen").name == "qwen"


def test_spec_for_a_pplx_embed_style_directory(tmp_path: Path) -> None:
    path = write_dir(
        tmp_path / "pplx",
        {**QWEN3, "model_type": "bidirectional_pplx_qwen3"},
        **{
            "modules.json": [
                {"path": "", "type": "sentence_transformers.models.Transformer"},
                {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                {"path": "2_Quantizer", "type": "st_quantize.FlexibleQuantizer"},
            ],
            "1_Pooling__config.json": {"pooling_mode": "mean"},
            "fern.json": {"matryoshka_dimensions": [1024, 512, 128]},
        },
    )
    spec = load_spec(path)
    assert (spec.family, spec.causal, spec.pooling, spec.native_int8, spec.normalize) == ("qwen3", False, "mean", True, False)
    assert spec.matryoshka_dimensions == (1024, 512, 128) and not spec.append_eos
    assert spec.max_tokens == 32768


def test_spec_reads_bidirectional_flags_and_xlmr_limits(tmp_path: Path) -> None:
    spec = load_spec(write_dir(tmp_path / "q", {**QWEN3, "is_causal": False}))
    assert not spec.causal and spec.pooling == "mean"
    xlmr = {"model_type": "xlm-roberta", "hidden_size": 1024, "vocab_size": 250002, "max_position_embeddings": 8194, "pad_token_id": 1}
    spec = load_spec(write_dir(tmp_path / "m3", xlmr, **{"1_Pooling__config.json": {"pooling_mode_cls_token": True}}))
    assert (spec.family, spec.position_offset, spec.max_tokens, spec.pooling) == ("xlm-roberta", 2, 8192, "cls")


@pytest.mark.parametrize(
    ("config", "files", "match"),
    [
        ({"model_type": "t5", "hidden_size": 8, "vocab_size": 8}, {}, "model_type 't5'"),
        ({**QWEN3}, {"config_sentence_transformers.json": {"prompts": {"query": "q: "}, "default_prompt_name": "doc"}}, "default_prompt_name 'doc'"),
        ({**QWEN3}, {"sentence_bert_config.json": {"max_seq_length": 40000}}, "max_tokens 40000"),
        ({**QWEN3}, {"1_Pooling__config.json": {"pooling_mode_max_tokens": True}}, "unsupported pooling"),
        ({**QWEN3}, {"fern.json": {"pooling": "max"}}, "pooling 'max'"),
        ({**QWEN3}, {"fern.json": {"casual": False}}, "unknown key 'casual'"),
        ({**QWEN3}, {"fern.json": {"causal": "false"}}, "causal must be a JSON bool"),
        ({**QWEN3}, {"fern.json": {"max_tokens": True}}, "max_tokens must be a JSON int"),
    ],
)
def test_spec_errors_name_the_file_and_value(tmp_path: Path, config: dict, files: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_spec(write_dir(tmp_path / "bad", config, **files))


def test_spec_errors_for_missing_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_spec(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_spec(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_spec(tmp_path / "empty")


def test_linear_gelu_op_matches_linear_then_gelu_also_under_compile():
    # The CUDA fast path's op: on the CPU it is exact, so this checks its plumbing (schema,
    # fake implementation under torch.compile) against the plain two-step computation.
    from core_engine.layers.mlp import linear_gelu

    torch.manual_seed(0)
    x, w, b = torch.randn(7, 16), torch.randn(48, 16), torch.randn(48)
    expected = torch.nn.functional.gelu(torch.nn.functional.linear(x, w, b))
    with torch.inference_mode():
        torch.testing.assert_close(linear_gelu(x, w, b), expected)
        compiled = torch.compile(lambda t: linear_gelu(t, w, b), dynamic=True)
        torch.testing.assert_close(compiled(x), expected)
        torch.testing.assert_close(compiled(x[:3]), expected[:3])


_TRITON_INTERPRET_CHECK = r"""
import torch
from core_engine.layers import qk_norm_rope as m
torch.manual_seed(0)
for t, heads, d in ((1, 3, 64), (37, 24, 128), (5, 2, 32)):
    wide = torch.randn(t, heads * d + 2 * d)
    qk = wide[:, : heads * d].view(t, heads, d)
    weight = torch.rand(heads, d) + 0.5
    angles = torch.rand(t, 1, d // 2) * 6.0
    q_heads = max(1, 2 * heads // 3)
    q, k = m._triton_qk_norm_rope(qk, weight, angles.cos(), angles.sin(), 1e-6, q_heads)
    want = m.qk_norm_rope_reference(qk, weight, angles.cos(), angles.sin(), 1e-6)
    assert q.is_contiguous() and k.is_contiguous()
    torch.testing.assert_close(q, want[:, :q_heads], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, want[:, q_heads:], rtol=1e-5, atol=1e-5)
print("ok")
"""


def test_qk_norm_rope_triton_kernel_matches_torch_formula_in_interpreter():
    # The CUDA kernel's arithmetic and indexing (strided rows, halves, per-head weight), run by
    # Triton's CPU interpreter in float32 against the torch formula. Needs Triton installed
    # (it is on GPU hosts; the CPU install has none, and the engine then uses the formula).
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", _TRITON_INTERPRET_CHECK], env=env, capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_qk_norm_rope_op_on_cpu_is_the_torch_formula_under_compile():
    from core_engine.layers.qk_norm_rope import qk_norm_rope, qk_norm_rope_reference

    torch.manual_seed(0)
    wide = torch.randn(9, 6 * 64 + 64)
    qk = wide[:, : 6 * 64].view(9, 6, 64)
    weight, angles = torch.rand(6, 64) + 0.5, torch.rand(9, 1, 32)
    want = qk_norm_rope_reference(qk, weight, angles.cos(), angles.sin(), 1e-6)
    with torch.inference_mode():
        compiled = torch.compile(lambda x: qk_norm_rope(x, weight, angles.cos(), angles.sin(), 1e-6, 4),
                                 dynamic=True)
        q, k = compiled(qk)
    torch.testing.assert_close(q, want[:, :4])
    torch.testing.assert_close(k, want[:, 4:])
    assert q.is_contiguous() and k.is_contiguous()


def test_flashinfer_workspace_grows_with_the_largest_step():
    from core_engine.attention.flashinfer import WORKSPACE_BYTES, workspace_bytes
    from core_engine.attention.base import AttentionShape

    bge_m3 = AttentionShape(num_qo_heads=16, num_kv_heads=16, head_dim=64)
    assert workspace_bytes(bge_m3, 8192) == WORKSPACE_BYTES
    # What FlashInfer 0.7.4 asked for on an H200 for one 65,536-token step of this shape.
    assert workspace_bytes(bge_m3, 65536) > 200_802_304


def test_qk_norm_rope_kernel_can_be_switched_off(tmp_path, monkeypatch):
    from benchmarks.models import build_random_model
    from core_engine.layers import qk_norm_rope as m

    spec = load_spec(build_random_model("qwen3-bidirectional", tmp_path / "qwen3", seed=0))
    model = build_model(spec, "cpu", torch.float32, get_backend("cpu"),
                        KernelOptions.from_env({"FERN_TRITON_KERNELS": "0"}))
    assert all(layer.triton is False for layer in model.layers)
    # Switched off, the op never asks whether the kernel works, even for CUDA-looking input.
    monkeypatch.setattr(m, "_kernel_ok", lambda device: pytest.fail("kernel checked"))
    qk, weight = torch.randn(3, 6, 8), torch.ones(6, 8)
    angles = torch.rand(3, 1, 4)
    q, k = m.qk_norm_rope(qk, weight, angles.cos(), angles.sin(), 1e-6, 4, False)
    want = m.qk_norm_rope_reference(qk, weight, angles.cos(), angles.sin(), 1e-6)
    torch.testing.assert_close(torch.cat([q, k], dim=1), want)


def test_varlen_attention_calls_the_flash_op_directly_with_the_packed_metadata():
    # On CUDA the FlashAttention-2 op is called without varlen_attn's wrapper (which fills a
    # zero rng-state tensor on the device per call: a kernel per layer). Its arguments are the
    # packed layout's: cu_seqlens for both q and k, the graph key's max length, causal as the
    # model says, no dropout; grouped K/V heads go in as they are.
    from core_engine.attention.varlen import VarlenAttention

    calls = []

    def flash(*args):
        calls.append(args)
        return (torch.full((5, 4, 8), 7.0), "lse", "rng", "unused", "debug")

    backend = VarlenAttention()
    backend._flash = flash
    q, k, v = torch.zeros(5, 4, 8), torch.zeros(5, 2, 8), torch.zeros(5, 2, 8)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    for causal in (False, True):
        meta = AttentionMetadata(cu_seqlens=cu, max_seqlen=64, seq_ids=None, seq_lens=None, causal=causal,
                                 cu_seqlens_cpu=cu)
        out = backend(q, k, v, meta)
        assert torch.equal(out, torch.full((5, 4, 8), 7.0))
        args = calls[-1]
        assert args[0] is q and args[1] is k and args[2] is v
        assert args[3] is cu and args[4] is cu and args[5:] == (64, 64, 0.0, causal, False)


def _qwen3_compiled_code(tmp_path: Path, addmm_residual: str) -> str:
    """Inductor's generated code for a two-layer random Qwen3 model (CPU attention), dynamic shapes."""
    from torch._inductor.utils import run_and_get_code

    from benchmarks.models import build_random_model

    spec = load_spec(build_random_model("qwen3-bidirectional", tmp_path / "qwen3", seed=0))
    model = build_model(spec, "cpu", torch.float32, get_backend("cpu"),
                        KernelOptions.from_env({"FERN_ADDMM_RESIDUAL": addmm_residual}))
    args = model_inputs(*pack([list(range(100, 105)), list(range(200, 207))]), False)
    torch._dynamo.reset()
    with torch.inference_mode():
        want = model(*args)
        got, code = run_and_get_code(torch.compile(model, dynamic=True), *args)
    torch._dynamo.reset()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    return "\n".join(code)


def test_qwen3_residual_adds_fuse_into_the_norms_not_the_matmuls(tmp_path) -> None:
    """Each residual add is fused into the RMSNorm that reads the sum: no addmm, no kernel of its own.

    Left alone, torch.compile folds x + out(a) into addmm(x, a, W^T), which on CUDA copies x
    before the matmul (two device-to-device copies per layer); and an add at the end of a
    layer is a kernel of its own, as attention ends each compiled region there. The check
    reads what torch.compile generates; with opaque_residual=False (the folded form) it sees
    addmm, so it would see a regression.
    """
    code = _qwen3_compiled_code(tmp_path / "a", "0")
    assert "addmm" not in code
    assert not re.findall(r"\w*_fused_add_\d+\b", code)  # an add alone in a kernel
    assert "addmm" in _qwen3_compiled_code(tmp_path / "b", "1")
