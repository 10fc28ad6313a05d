"""Where the GPU time goes: per-shape matmul rates, attention kernels, and a kernel profile of each model.

`python -m benchmarks.profile_gpu --out DIR` (CUDA only) measures, in one run:

- ``gemm``: every projection shape of the profiled models at several token counts, as
  bf16 ``F.linear`` (what the engine runs) with bias and without (through cuBLAS and
  through cuBLASLt, torch's two BLAS libraries) and, for reference, fp8 rowwise ``_scaled_mm``,
  each in TFLOP/s beside the 8192^3 bf16 peak measured in the same run. This is the
  roofline a packed step can reach: no model can beat the matmuls it is made of.
- ``attention``: ``varlen_attn`` on full 512-token sequences for each model's head layout.
- ``attention_uniform``: the same step's attention through every packed kernel the engine
  has and through SDPA's dense backends (cuDNN, flash, efficient), on strided views.
- ``small``: batch-1 steps (one sequence of 16 / 128 tokens) with the engine's default
  compile (dynamic shapes; cuBLAS picks each matmul's kernel) against a static-shape
  ``max-autotune`` compile (inductor times Triton templates beside cuBLAS for each matmul
  shape and keeps the fastest): replay latency, kernel profile, compile time, and the
  cosine between the two engines' vectors.
- ``models``: for each model, throughput against texts per step (pipelined replays, 512
  tokens a text), batch-1 replay latency, and a kernel profile of one eager (compiled) step
  at the latency and throughput shapes: CUDA time by kernel class (gemm, attention,
  fused elementwise, other) and the top kernels, against the wall time of a graph replay
  of the same shape. The gap between the two is launch and scheduling cost.

Results go to DIR/profile-<tag>.json with the command, the machine and the date.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.models import ARCHS, build_random_model
from benchmarks.pg_common import machine
from benchmarks.suite import _pipelined, _pipelined_once, flops_per_token, matmul_tflops, sustained_matmul_tflops


def _cuda_ms(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median CUDA-event time of `fn()` in milliseconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def projection_shapes(name: str) -> dict[str, tuple[int, int]]:
    """(in, out) of each matmul in one layer of architecture `name`."""
    cfg = ARCHS[name].config
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    d = cfg.get("head_dim") or h // heads
    if ARCHS[name].family == "qwen3":
        return {"qkv": (h, (heads + 2 * kv) * d), "out": (heads * d, h), "gate_up": (h, 2 * inter), "down": (inter, h)}
    return {"qkv": (h, 3 * h), "out": (h, h), "up": (h, inter), "down": (inter, h)}


def part_gemm(models: list[str], token_counts: list[int]) -> dict[str, Any]:
    """Each projection shape as the engine runs it: with bias (cuBLASLt's bias epilogue), and
    without (BGE has biases, Qwen3 none) through each cuBLAS library torch can call."""
    out: dict[str, Any] = {}
    fp8 = hasattr(torch, "float8_e4m3fn") and hasattr(torch, "_scaled_mm")
    for name in models:
        rows = {}
        for label, (k, n) in projection_shapes(name).items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
            b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
            for m in token_counts:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                flop = 2 * m * n * k
                ms = _cuda_ms(lambda: F.linear(x, w, b))
                row = {"bf16_ms": ms, "bf16_tflops": flop / ms / 1e9}
                for library in ("cublas", "cublaslt"):
                    with blas_library(library):
                        ms = _cuda_ms(lambda: F.linear(x, w))
                    row[f"bf16_nobias_{library}_ms"] = ms
                    row[f"bf16_nobias_{library}_tflops"] = flop / ms / 1e9
                if fp8 and m >= 1024:
                    try:
                        xq = x.to(torch.float8_e4m3fn)
                        wq = w.to(torch.float8_e4m3fn)
                        sa = torch.ones(m, 1, device="cuda", dtype=torch.float32)
                        sb = torch.ones(1, n, device="cuda", dtype=torch.float32)
                        ms8 = _cuda_ms(lambda: torch._scaled_mm(xq, wq.t(), scale_a=sa, scale_b=sb,
                                                                 out_dtype=torch.bfloat16))
                        row.update(fp8_ms=ms8, fp8_tflops=flop / ms8 / 1e9)
                    except Exception as exc:  # noqa: BLE001 - a reference figure only
                        row["fp8_error"] = f"{type(exc).__name__}: {exc}"[:200]
                rows[f"{label} {k}->{n} M={m}"] = row
        out[name] = rows
    return out


@contextlib.contextmanager
def blas_library(library: str | None):
    """torch's preferred BLAS library ("cublas", "cublaslt") for the block; None leaves it."""
    if library is None:
        yield
        return
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def part_attention(models: list[str], seqs: int, length: int) -> dict[str, Any]:
    from torch.nn.attention.varlen import varlen_attn

    out = {}
    for name in models:
        cfg = ARCHS[name].config
        heads = cfg["num_attention_heads"]
        d = cfg.get("head_dim") or cfg["hidden_size"] // heads
        t = seqs * length
        q, k, v = (torch.randn(t, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        cu = torch.arange(0, t + 1, length, device="cuda", dtype=torch.int32)
        ms = _cuda_ms(lambda: varlen_attn(q, k, v, cu, cu, length, length))
        flop = 4 * seqs * length * length * heads * d
        out[name] = {"tokens": t, "heads": heads, "head_dim": d, "varlen_ms": ms, "varlen_tflops": flop / ms / 1e9}
    return out


def _flashinfer_planned(backend: str, indptr: torch.Tensor, hq: int, hkv: int, d: int):
    """A FlashInfer ragged-prefill wrapper (`backend` fa3 or fa2) planned for the batch of `indptr`."""
    import flashinfer

    wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
        torch.empty(256 << 20, dtype=torch.uint8, device="cuda"), "NHD", backend=backend)
    wrapper.plan(indptr, indptr, hq, hkv, d, causal=False, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    return wrapper


def _fa3_once(q, k, v, indptr, hq: int, hkv: int, d: int) -> torch.Tensor:
    """FlashInfer's packed attention (fa3) of one batch, planned for it: the reference output."""
    return _flashinfer_planned("fa3", indptr, hq, hkv, d).run(q, k, v)


def _max_diff(fn, reference) -> float | str:
    try:
        return float((fn().float() - reference().float()).abs().max())
    except Exception as exc:  # noqa: BLE001 - a kernel that refuses the batch is a finding
        return f"{type(exc).__name__}: {exc}"[:300]


def part_attention_uniform(models: list[str], seqs: int, length: int) -> dict[str, Any]:
    """One layer's attention over `seqs` sequences of `length` tokens, as packed kernels and as dense SDPA.

    Q, K and V are views into one fused projection output, as the engine passes them. The
    packed kernels are the engine's (FlashInfer fa3 / fa2, planned once; varlen_attn); the
    dense ones are SDPA's backends on [seqs, heads, length, head_dim] views of the same
    tensors, timed with the copy back to the packed [tokens, heads * head_dim] layout the
    next projection reads. Each has its wall time per call (`ms`, launch included) and its
    kernels' time (`kernel_ms`, what it would cost inside a CUDA graph). A uniform-length step
    (every text truncated to the same length) could take the dense path: this says whether it
    would pay. cuDNN is also run on the packed layout itself (`cudnn_ragged`) and checked
    against fa3 on uniform and on mixed lengths.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.varlen import varlen_attn

    out: dict[str, Any] = {}
    for name in models:
        cfg = ARCHS[name].config
        hq = cfg["num_attention_heads"]
        hkv = cfg.get("num_key_value_heads") or hq
        d = cfg.get("head_dim") or cfg["hidden_size"] // hq
        t = seqs * length
        qkv = torch.randn(t, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
        q = qkv[:, :hq * d].view(t, hq, d)
        k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
        v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
        flop = 4 * seqs * length * length * hq * d
        row: dict[str, Any] = {"tokens": t, "q_heads": hq, "kv_heads": hkv, "head_dim": d}

        def timed(label: str, fn) -> None:
            try:
                ms, kernel_ms = _cuda_ms(fn), _kernel_ms(fn)
                row[label] = {"ms": ms, "kernel_ms": kernel_ms, "kernel_tflops": flop / kernel_ms / 1e9}
            except Exception as exc:  # noqa: BLE001 - a backend that refuses the shape is a finding
                row[label] = {"error": f"{type(exc).__name__}: {exc}"[:300]}

        indptr = torch.arange(0, t + 1, length, dtype=torch.int32)
        for backend in ("fa3", "fa2"):
            try:
                wrapper = _flashinfer_planned(backend, indptr, hq, hkv, d)
            except Exception as exc:  # noqa: BLE001
                row[f"flashinfer_{backend}"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                continue
            qc, kc, vc = (q, k, v) if backend == "fa3" else (q.contiguous(), k.contiguous(), v.contiguous())
            timed(f"flashinfer_{backend}", lambda: wrapper.run(qc, kc, vc))
        cu = indptr.to("cuda")
        if hkv == hq:
            timed("varlen", lambda: varlen_attn(q, k, v, cu, cu, length, length))

        def cudnn_ragged(q=q, k=k, v=v, cu=cu, longest=length):
            # cuDNN's SDPA on the packed layout, as nested-tensor SDPA calls it (THD, ragged offsets).
            return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, longest, longest, False)[0]
        timed("cudnn_ragged", cudnn_ragged)
        row["cudnn_ragged_max_abs_diff_vs_fa3"] = _max_diff(
            cudnn_ragged, lambda: _fa3_once(q, k, v, indptr, hq, hkv, d))
        # The same on sequences of mixed lengths (a packed step of real texts), against fa3.
        lengths = [length, 7, 300, 129, 64, 1, 511, 200] * (seqs // 8)
        mixed = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
        tm = int(mixed[-1])
        row["cudnn_ragged_mixed_max_abs_diff_vs_fa3"] = _max_diff(
            lambda: cudnn_ragged(q[:tm], k[:tm], v[:tm], mixed.to("cuda"), max(lengths)),
            lambda: _fa3_once(q[:tm], k[:tm], v[:tm], mixed, hq, hkv, d))
        dense = [x.view(seqs, length, x.shape[1], d).transpose(1, 2) for x in (q, k, v)]
        for backend in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
            def sdpa(backend=backend):
                with sdpa_kernel(getattr(SDPBackend, backend)):
                    o = F.scaled_dot_product_attention(*dense, enable_gqa=hkv != hq)
                return o.transpose(1, 2).reshape(t, hq * d)
            timed(f"sdpa_{backend.lower()}", sdpa)
        out[name] = row
    return out


def _kernel_ms(fn, reps: int = 10) -> float:
    """GPU kernel time of one `fn()` call (the profiler's sum over `reps` calls, divided), which leaves
    out the host's launch cost that `_cuda_ms` includes when a call launches slower than it runs."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return sum(ev.device_time for ev in _gpu_events(prof)) / 1e3 / reps


def _gpu_events(prof) -> list:
    """The profiler's GPU activity (kernels, copies, memsets) that took time."""
    return [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0]


def _kernel_class(name: str) -> str:
    low = name.lower()
    # Attention first: FlashAttention's and FlashInfer's kernel names also carry "cutlass".
    if any(s in low for s in ("flash", "fmha", "attn", "prefill")):
        return "attention"
    if any(s in low for s in ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90_", "sm100_")):
        return "gemm"
    if "triton" in low or "qk_norm_rope" in low:  # inductor's kernels, and Fern's own Triton kernel
        return "fused_elementwise"
    return "other"


def _profile_eager(engine, seqs: list[list[int]]) -> dict[str, Any]:
    """CUDA time by kernel of one eager (compiled, not graphed) step of `seqs`."""
    from torch.profiler import ProfilerActivity, profile

    batch = engine.prepare(seqs)
    key = batch.key

    def eager() -> None:
        with torch.inference_mode():
            engine.attention.activate(key)
            engine.attention.plan(key, batch.cu_seqlens_cpu, for_graph=False)
            buf = batch.packed.to(engine.device, non_blocking=True)
            engine._forward_on(buf, key, batch.cu_seqlens_cpu)

    for _ in range(3):
        eager()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        eager()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for ev in _gpu_events(prof):
        kernels.setdefault(ev.name, []).append(ev.device_time / 1e3)  # ms
    by_class: dict[str, float] = {}
    for kname, times in kernels.items():
        by_class[_kernel_class(kname)] = by_class.get(_kernel_class(kname), 0.0) + sum(times)
    top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:25]
    return {
        "kernel_ms_total": sum(by_class.values()),
        "kernel_launches": sum(len(t) for t in kernels.values()),
        "by_class_ms": by_class,
        "top": [{"kernel": k[:160], "class": _kernel_class(k), "calls": len(t), "total_ms": sum(t)} for k, t in top],
    }


def _profile_pipelined(engine, seqs: list[list[int]], steps: int = 8) -> dict[str, Any]:
    """Where a pipelined step's wall time goes: kernels, or the GPU idle between them.

    Steps `seqs` back to back as the throughput figure does (graph replays, step N+1 prepared
    while N runs) under the profiler, and splits the wall time per step into the kernels'
    busy time (the union of their intervals) and the time the GPU ran no kernel. The sum of
    kernel durations is also given: beside the eager profile's, a rise says the same kernels
    ran slower in a sustained run (clocks), not that the GPU waited.
    """
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        engine.step(engine.prepare(seqs)).result()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        _pipelined_once(engine, [seqs] * steps)
        wall = (time.perf_counter() - start) * 1e3
    spans = sorted((ev.time_range.start, ev.time_range.end) for ev in _gpu_events(prof))
    if not spans:
        return {"error": "the profiler recorded no kernels of the replayed graphs"}
    busy = 0.0
    cur_start, cur_end = spans[0]
    for s0, e0 in spans[1:]:
        if s0 > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = s0, e0
        else:
            cur_end = max(cur_end, e0)
    busy += cur_end - cur_start
    first, last = spans[0][0], max(e for _, e in spans)
    return {"steps": steps, "kernels_per_step": len(spans) / steps,
            "wall_ms_per_step": wall / steps,
            "kernel_sum_ms_per_step": sum(e - s for s, e in spans) / 1e3 / steps,
            "gpu_busy_ms_per_step": busy / 1e3 / steps,
            "gpu_idle_ms_per_step": ((last - first) - busy) / 1e3 / steps}


def _profile_summary(profile: dict[str, Any], top: int = 6) -> dict[str, Any]:
    return {k: v for k, v in profile.items() if k != "top"} | {"top": profile["top"][:top]}


def part_small(models: list[str], models_dir: Path, token_counts: list[int], device: str = "cuda") -> dict[str, Any]:
    """Batch-1 replay latency: default (dynamic) compile against a static max-autotune compile, per model."""
    import torch._dynamo

    from core_engine.attention.select import opaque_selector
    from core_engine.engine import Engine

    out: dict[str, Any] = {}
    for name in models:
        path = build_random_model(ARCHS[name], models_dir / name, seed=0, dtype=torch.bfloat16, device=device)
        queries = {t: [list(range(1000, 1000 + t))] for t in token_counts}
        rows: dict[str, Any] = {str(t): {} for t in token_counts}
        vectors: dict[str, dict[int, torch.Tensor]] = {}
        for mode in ("default", "max-autotune"):
            torch._dynamo.reset()
            engine = Engine(path, name=name, device=device, attention="varlen" if device == "cuda" else "auto",
                            compile=mode == "default")
            if mode != "default":
                # As the engine's own compile does: attention stays out of the compiled regions.
                engine.attention.__class__ = opaque_selector()
                engine._forward_model = torch.compile(engine.model, dynamic=False, mode="max-autotune-no-cudagraphs")
                engine.compiled = True
            vectors[mode] = {}
            for t, q in queries.items():
                started = time.perf_counter()
                vectors[mode][t] = torch.from_numpy(engine.embed(q))  # eager step: compiles this shape
                first = time.perf_counter() - started
                rows[str(t)][mode] = {"first_step_s": round(first, 2), "replay_ms": _replay_ms(engine, q, reps=200),
                                      "profile": _profile_summary(_profile_eager(engine, q)) if device == "cuda" else None}
            del engine
            torch.cuda.empty_cache()
        for t in token_counts:
            rows[str(t)]["cosine"] = float(F.cosine_similarity(vectors["default"][t], vectors["max-autotune"][t], dim=1).min())
        out[name] = rows
        print(json.dumps({name: {t: {m: (r if not isinstance(r, dict) else {k: v for k, v in r.items() if k != "profile"})
                                    for m, r in row.items()} for t, row in rows.items()}}, indent=1), flush=True)
    torch._dynamo.reset()
    return out


def _replay_ms(engine, seqs: list[list[int]], reps: int = 50) -> float:
    """Wall time of prepare + step + result once the shape's graph is captured (median)."""
    batch = engine.prepare(seqs)
    for _ in range(3):
        engine.step(batch).result()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        engine.step(engine.prepare(seqs)).result()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _pipelined_rate(engine, seqs: list[list[int]], seconds: float = 1.5) -> float:
    """Embeddings/s stepping `seqs` back to back, as the suite's throughput part does (after 3 warm steps)."""
    for _ in range(3):
        engine.step(engine.prepare(seqs)).result()
    texts, _, elapsed = _pipelined(engine, [seqs], seconds)
    return texts / elapsed


# Variants: "<model>+<variant>" builds the model with these environment settings and Engine options.
VARIANTS: dict[str, tuple[dict[str, str], dict[str, Any]]] = {
    "exact-gelu": ({"FERN_GELU_EPILOGUE": "0"}, {}),
    "fa2": ({"FERN_FLASHINFER_BACKEND": "fa2", "FERN_FLASHINFER_CONTIGUOUS": "0"}, {"attention": "flashinfer"}),
    "fa3": ({"FERN_FLASHINFER_BACKEND": "fa3", "FERN_FLASHINFER_CONTIGUOUS": "0"}, {"attention": "flashinfer"}),
    "addmm-residual": ({"FERN_ADDMM_RESIDUAL": "1"}, {}),
    "full-last": ({"FERN_FULL_LAST_LAYER": "1"}, {}),
}
# Variants that run the whole model (compile, capture, measurement) under another BLAS library.
BLAS_VARIANTS = {"cublaslt": "cublaslt", "cublas": "cublas"}


def kernel_bound(profile: dict[str, Any], texts: int) -> dict[str, float]:
    """Embeddings/s a step of `texts` texts could reach if only some kernel classes took time.

    From one step's kernel profile: with only its matmuls, and with its matmuls and
    attention (every norm, activation and copy free, no gap between kernels). A goal above
    the second figure needs faster matmul or attention kernels, not less overhead.
    """
    ms = profile["by_class_ms"]
    gemm, attention = ms.get("gemm", 0.0), ms.get("attention", 0.0)
    return {"gemm_only": texts / gemm * 1e3 if gemm else float("nan"),
            "gemm_and_attention": texts / (gemm + attention) * 1e3 if gemm + attention else float("nan")}


def part_models(models: list[str], models_dir: Path, per_step: list[int], peak: float) -> dict[str, Any]:
    out = {}
    reference: dict[str, torch.Tensor] = {}
    for label in models:
        # A label given again (an A/B/A/B run) keeps its own entry: "label #2", ...
        key = label if label not in out else f"{label} #{sum(k.split(' #')[0] == label for k in out) + 1}"
        try:
            with blas_library(BLAS_VARIANTS.get(label.partition("+")[2])):
                out[key] = _profile_model(label, models_dir, per_step, peak, reference)
        except Exception as exc:  # noqa: BLE001 - keep the other models' figures
            traceback.print_exc()
            out[key] = {"error": f"{type(exc).__name__}: {exc}"}
        torch.cuda.empty_cache()
    return out


def _profile_model(label: str, models_dir: Path, per_step: list[int], peak: float,
                   reference: dict[str, torch.Tensor]) -> dict[str, Any]:
    from core_engine.engine import Engine

    name, _, variant = label.partition("+")
    if variant and variant not in VARIANTS and variant not in BLAS_VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; known: {sorted({*VARIANTS, *BLAS_VARIANTS})}")
    env, options = VARIANTS.get(variant, ({}, {}))
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    path = build_random_model(ARCHS[name], models_dir / name, seed=0, dtype=torch.bfloat16, device="cuda")
    try:
        engine = Engine(path, name=name, device="cuda", max_step_tokens=max(per_step) * 512, **options)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    fpt = flops_per_token(engine.spec.config, engine.spec.family, 512, engine.spec.causal)
    text = [list(range(1000, 1512))]
    query = [list(range(1000, 1128))]
    probe = torch.from_numpy(engine.embed([list(range(2000 + 7 * i, 2000 + 7 * i + 60 + 50 * i)) for i in range(8)]))
    if not variant:
        reference[name] = probe
    rates = {}
    for n in per_step:
        rate = _pipelined_rate(engine, text * n)
        tflops = rate * 512 * fpt / 1e12
        rates[str(n)] = {"embeddings_per_s": rate, "tflops": tflops, "mfu": tflops / peak}
    entry = {
        "compile_seconds": engine.compile_seconds,
        "attention": dict(engine.attention.choices),
        "flops_per_token_512": fpt,
        "throughput_512": rates,
        "latency_1x128_replay_ms": _replay_ms(engine, query),
        "latency_32x512_replay_ms": _replay_ms(engine, text * 32, reps=20),
        "profile_1x128": _profile_eager(engine, query),
        "profile_32x512": _profile_eager(engine, text * 32),
        "pipelined_32x512": _profile_pipelined(engine, text * 32),
        "counters": engine.counters.as_dict(),
    }
    entry["kernel_bound_32x512_embeddings_per_s"] = kernel_bound(entry["profile_32x512"], 32)
    if variant and name in reference:
        entry["cosine_vs_base_min"] = float(F.cosine_similarity(probe, reference[name], dim=1).min())
    print(json.dumps({label: {k: v for k, v in entry.items() if not k.startswith("profile")}}, indent=1),
          flush=True)
    return entry


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile_gpu", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--models-dir", default="/tmp/fern-models")
    p.add_argument("--models", nargs="+", default=["bge-m3", "pplx-0.6b"])
    p.add_argument("--per-step", type=int, nargs="+", default=[16, 32, 64, 128])
    p.add_argument("--tag", default="h200")
    p.add_argument("--small-tokens", type=int, nargs="+", default=[16, 128])
    p.add_argument("--gemm-tokens", type=int, nargs="+", default=[128, 8192, 16384, 32768])
    p.add_argument("--skip", nargs="*", default=[],
                   choices=["gemm", "attention_32x512", "attention_uniform", "small", "models"])
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_gpu needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = True
    peak = matmul_tflops("cuda")
    result: dict[str, Any] = {
        "command": "python -m benchmarks.profile_gpu " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine(),
        "device_name": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "matmul_tflops_8192": peak,
        "matmul_tflops_8192_sustained": sustained_matmul_tflops("cuda"),
    }
    archs = list(dict.fromkeys(m.partition("+")[0] for m in args.models))
    parts = {"gemm": lambda: part_gemm(archs, args.gemm_tokens),
             "attention_32x512": lambda: part_attention(archs, 32, 512),
             "attention_uniform": lambda: part_attention_uniform(archs, 32, 512),
             "small": lambda: part_small(archs, Path(args.models_dir), args.small_tokens),
             "models": lambda: part_models(args.models, Path(args.models_dir), args.per_step, peak)}
    for part, run in parts.items():
        if part in args.skip:
            continue
        try:
            result[part] = run()
        except Exception as exc:  # noqa: BLE001 - keep the other parts' figures
            traceback.print_exc()
            result[part] = {"error": f"{type(exc).__name__}: {exc}"}
        if part not in ("small", "models"):
            print(json.dumps({part: result[part]}, indent=1), flush=True)
    out = Path(args.out) / f"profile-{args.tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
