"""Tokenizer throughput in tokens/s: raw `tokenizers` against Fern's TextTokenizer, CPU only.

Three ways to turn a workload's texts into token ids (special tokens included, truncated
at the model's limit), each timed with the id lists built, over interleaved rounds
(medians reported, since the machine may be shared):

- raw: the shipped tokenizer.json, one `encode_batch_fast` call over all texts (Rust fans
  it out over its own threads), `[e.ids for e in ...]`: what a plain client does;
- encode: `TextTokenizer.encode` on all texts in one call (the ASCII twin where it applies);
- sliced: `TextTokenizer.encode_async`, the gateway's path: slices on the worker threads;
- processes: the same with worker processes (--processes, default as the sidecar's), for
  the requests of PROCESS_CHARS and more that go to them.

Each method's CPU time in this process (all its threads, not the worker processes') is given
per million tokens (`cpu_ms_per_m_tokens`): for "processes", what the sidecar itself spends
to send the slices and take their ids back, time its event loop and engine thread cannot use.

Workloads: the GPU suite's queries, passages and long documents (benchmarks/texts.py), and
"prose": paragraphs of Python's own documentation (real English with punctuation, code,
line breaks and some non-ASCII), so the word mix is not only the synthetic vocabulary.
Every method's ids are checked equal to raw's before anything is timed.

Then the online path, one text a call (`single_text` in the result, microseconds per call):
raw again, `encode([text])` through the Rust twin (`rust`, TextTokenizer with memo_chunks=0,
the path before the chunk memo), through the chunk memo once its chunks are known (`memo`),
with the memo emptied before each pass over the texts (`memo_stream`: it learns as it goes)
and before every call (`memo_cold`: every chunk new, its worst case), on texts of 16 and 128
tokens (benchmarks/texts.py's Zipf-drawn words) and on prose paragraphs up to the inline size.

Usage: python -m tools.profiling.tokenize_bench [--threads N] [--workers N] [--processes N] [--slice N]
       [--rounds 5] [--scale 1.0] [--tokenizer DIR] [--max-tokens N] [--single-only] [--out FILE]
--threads sets RAYON_NUM_THREADS (Rust's pool) unless it is already set; no GPU, no network.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

WORKLOADS = (("queries", 8, 24, 20000), ("passages", 64, 256, 6000), ("long", 384, 512, 2000))
# One-text rows: (name, tokens a text, special tokens included); 200 texts each at --scale 1.
SINGLE = (("query16", 16), ("query128", 128), ("passage512", 512))
SINGLE_TEXTS = 200


def _prose(count: int) -> list[str]:
    """Paragraphs of Python's bundled documentation, repeated to `count`."""
    import pydoc_data.topics

    paragraphs = [p.strip() for topic in pydoc_data.topics.topics.values()
                  for p in topic.split("\n\n") if len(p.strip()) >= 80]
    return [paragraphs[i % len(paragraphs)] for i in range(count)]


def _model_dir(given: Path | None) -> Path:
    if given is not None:
        return given
    from core_engine.loader import default_model_dir

    return default_model_dir()


def _max_tokens(model_dir: Path, given: int | None) -> int:
    if given is not None:
        return given
    from core_engine.config import load_spec

    return load_spec(model_dir).max_tokens


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure every method on every workload; returns the result dictionary."""
    from tokenizers import Tokenizer

    from benchmarks.texts import Workload, workload_texts
    from sidecar.tokenize import TextTokenizer, default_processes, default_workers

    model_dir = _model_dir(args.tokenizer)
    path = model_dir / "tokenizer.json"
    max_tokens = _max_tokens(model_dir, args.max_tokens)
    raw = Tokenizer.from_file(str(path))
    raw.no_padding()
    raw.enable_truncation(max_tokens)
    workers = args.workers or default_workers()
    # The twin sizes its joined inputs to Rust's pool, which RAYON_NUM_THREADS sizes when set.
    rust_threads = int(os.environ.get("RAYON_NUM_THREADS") or 0) or None
    fern = TextTokenizer(path, max_tokens, workers=workers, slice_texts=args.slice, processes=0,
                         rust_threads=rust_threads)
    processes = default_processes() if args.processes is None else args.processes
    procs = TextTokenizer(path, max_tokens, workers=workers, slice_texts=args.slice,
                          processes=processes, rust_threads=rust_threads) if processes else None
    loop = asyncio.new_event_loop()
    methods: dict[str, Callable[[list[str]], list[list[int]]]] = {
        "raw": lambda texts: [e.ids for e in raw.encode_batch_fast(texts)],
        "encode": fern.encode,
        "sliced": lambda texts: loop.run_until_complete(fern.encode_async(texts)),
    }
    if procs is not None:
        methods["processes"] = lambda texts: loop.run_until_complete(procs.encode_async(texts))
    workloads: dict[str, list[str]] = {}
    if not args.single_only:
        workloads = {name: workload_texts(raw, Workload(name, low, high, max(1, int(count * args.scale))), seed=11)
                     for name, low, high, count in WORKLOADS}
        workloads["prose"] = _prose(max(1, int(4000 * args.scale)))
    rows: dict[str, Any] = {}
    try:
        for name, texts in workloads.items():
            expected = methods["raw"](texts)
            for method, fn in methods.items():  # the worker processes' ids are int32 arrays
                if [list(map(int, ids)) for ids in fn(texts)] != expected:
                    raise AssertionError(f"{method} gave other ids than raw on {name}")
            tokens = sum(map(len, expected))
            seconds: dict[str, list[float]] = {m: [] for m in methods}
            cpu: dict[str, list[float]] = {m: [] for m in methods}
            for _ in range(args.rounds):
                for method, fn in methods.items():  # interleaved, so drifting load hits all alike
                    start, cpu_start = time.perf_counter(), time.process_time()
                    fn(texts)
                    seconds[method].append(time.perf_counter() - start)
                    cpu[method].append(time.process_time() - cpu_start)
            rates = {m: tokens / statistics.median(s) for m, s in seconds.items()}
            rows[name] = {"texts": len(texts), "tokens": tokens,
                          "ascii_twin_share": sum(map(fern.core.full_twin.fits, texts)) / len(texts)
                          if fern.core.full_twin is not None else 0.0,
                          "tokens_per_s": {m: round(r) for m, r in rates.items()},
                          "spread_tokens_per_s": {m: [round(tokens / max(s)), round(tokens / min(s))]
                                                  for m, s in seconds.items()},
                          "sliced_over_raw": round(rates["sliced"] / rates["raw"], 3),
                          # This process's CPU (all its threads, not the worker processes'):
                          # for "processes", what the sidecar itself spends on the workers' path.
                          "cpu_ms_per_m_tokens": {m: round(statistics.median(c) * 1e9 / tokens, 1)
                                                  for m, c in cpu.items()}}
            print(f"{name:9s} " + "  ".join(f"{m} {r / 1e6:6.2f} M" for m, r in rates.items()), flush=True)
    finally:
        fern.close()
        if procs is not None:
            procs.close()
        loop.close()
    return {"tokenizer": str(path), "max_tokens": max_tokens, "rounds": args.rounds, "scale": args.scale,
            "rayon_threads": os.environ.get("RAYON_NUM_THREADS"),
            "tokenizers_parallelism": os.environ.get("TOKENIZERS_PARALLELISM"),
            "workers": workers, "processes": processes, "slice_texts": args.slice, "workloads": rows,
            "single_text": _single_text(args, raw, path, max_tokens)}


def _single_text(args: argparse.Namespace, raw: Any, path: Path, max_tokens: int) -> dict[str, Any]:
    """Microseconds per one-text call, each method over the same texts, interleaved rounds."""
    from benchmarks.texts import make_texts
    from sidecar.tokenize import INLINE_CHARS, TextTokenizer

    count = max(1, int(SINGLE_TEXTS * args.scale))
    rows_texts = {name: make_texts(raw, [tokens] * count, seed=13) for name, tokens in SINGLE}
    rows_texts["prose"] = [p for p in _prose(4 * count) if len(p) <= INLINE_CHARS][:count]
    rust = TextTokenizer(path, max_tokens, workers=1, memo_chunks=0)
    memo = TextTokenizer(path, max_tokens, workers=1)
    # Its own tokenizer, so that emptying its memo leaves `memo` warm.
    emptied = TextTokenizer(path, max_tokens, workers=1)

    def stream(texts: list[str]) -> list[list[int]]:
        emptied.core.memo.clear()
        return [ids for text in texts for ids in emptied.encode([text])]

    def cold(texts: list[str]) -> list[list[int]]:
        seqs = []
        for text in texts:
            emptied.core.memo.clear()
            seqs.extend(emptied.encode([text]))
        return seqs

    methods: dict[str, Callable[[list[str]], list[list[int]]]] = {
        "raw": lambda texts: [e.ids for text in texts for e in raw.encode_batch_fast([text])],
        "rust": lambda texts: [ids for text in texts for ids in rust.encode([text])],
        "memo": lambda texts: [ids for text in texts for ids in memo.encode([text])],
        "memo_stream": stream,
        "memo_cold": cold,
    }
    rows: dict[str, Any] = {}
    try:
        if memo.core.memo is None or emptied.core.memo is None:
            raise AssertionError(f"{path} gets no chunk memo: nothing to compare")
        for name, texts in rows_texts.items():
            expected = methods["raw"](texts)
            for method, fn in methods.items():  # fills `memo`: it is timed warm
                if fn(texts) != expected:
                    raise AssertionError(f"{method} gave other ids than raw on single {name}")
            seconds: dict[str, list[float]] = {m: [] for m in methods}
            for _ in range(args.rounds):
                for method, fn in methods.items():
                    start = time.perf_counter()
                    fn(texts)
                    seconds[method].append(time.perf_counter() - start)
            micros = {m: [s * 1e6 / len(texts) for s in runs] for m, runs in seconds.items()}
            median = {m: statistics.median(us) for m, us in micros.items()}
            rows[name] = {"texts": len(texts), "mean_tokens": round(sum(map(len, expected)) / len(texts), 1),
                          "us_per_call": {m: round(us, 1) for m, us in median.items()},
                          "spread_us_per_call": {m: [round(min(us), 1), round(max(us), 1)]
                                                 for m, us in micros.items()},
                          "rust_minus_memo_us": round(median["rust"] - median["memo"], 1)}
            print(f"single {name:9s} " + "  ".join(f"{m} {us:6.1f} us" for m, us in median.items()), flush=True)
    finally:
        for tokenizer in (rust, memo, emptied):
            tokenizer.close()
    return {"texts_per_row": count, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    """Entry point for `python -m tools.profiling.tokenize_bench`."""
    from sidecar.tokenize import SLICE_TEXTS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None,
                        help="Rust threads (RAYON_NUM_THREADS, unless already set; default: all cores)")
    parser.add_argument("--workers", type=int, default=None,
                        help="TextTokenizer worker threads (default: sidecar.tokenize.default_workers())")
    parser.add_argument("--processes", type=int, default=None,
                        help="worker processes of the `processes` method, 0 for none (default: "
                             "sidecar.tokenize.default_processes())")
    parser.add_argument("--slice", type=int, default=SLICE_TEXTS, help="texts per worker slice")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; medians reported")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every workload's text count")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="model directory with tokenizer.json (default: the bundled all-MiniLM-L6-v2)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="truncation limit (default: the model's, from its config; needed without one)")
    parser.add_argument("--single-only", action="store_true",
                        help="only the one-text rows (single_text), not the tokens/s workloads")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu/tokenize.json"))
    parser.add_argument("--no-write", action="store_true", help="print only, write no result file")
    args = parser.parse_args(argv)
    if args.threads is not None:
        # Before the first encode: Rust's thread pool is sized once, when first used.
        os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))
    result = run(args)
    if args.no_write:
        return 0
    from benchmarks.pg_common import write_result

    write_result("tokenize_bench", argv, result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
