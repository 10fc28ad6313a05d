"""Lane isolation through the real server: ONLINE query latency while BATCH clients saturate one `fern serve`.

Each round runs three phases against the same sidecar, over gRPC: online alone (one client
sending `--online-rate` queries/s of `--online-tokens` tokens, open loop, a new text each
call), batch alone (`--batch-clients` processes, each sending requests of `--batch-texts`
passages of `--batch-low`..`--batch-high` tokens on the BATCH lane back to back, no text ever
repeated), and both at once. It reports online p50/p99/p99.9 per phase and batch tokens/s,
and the mixed figures beside the solo ones: the lane guarantee is online p99 held while the
batch lane keeps its throughput. The online client sends one query at a time; where one is
still out when the next is due, that one goes late, and each phase's `from_schedule`
percentiles count that wait too (`_online`). Each batch window also gives the server process's
CPU (its threads, not its tokenizer worker processes): cores busy, and milliseconds per million
batch tokens, the cost that caps a small model's throughput through the server.

    python -m benchmarks.lanes_e2e --device cpu --online-rate 5 --batch-clients 1 --batch-texts 16 \\
        --seconds 5 --rounds 1 --out benchmarks/results/cpu/lanes_e2e.json
    python -m benchmarks.lanes_e2e --device cuda --model DIR --out lanes.json

`--stand-in US,NS` runs the same server with a stand-in forward pass (tools/profiling/stand_in.py:
a step is ready US microseconds plus NS nanoseconds a token after it is launched) and the GPU's
step budgets, so the process around the engine is measured on a machine without a GPU.

`--trace` runs the server under tools/profiling/traced.py, which timestamps each online query's
path through it (handler, tokenized, queued, its step launched and delivered, back on the loop,
response): per phase, each stage's percentiles, and the stages of the slowest 1 % of queries,
which say where the tail goes.

`--st-baseline` then runs sentence-transformers `encode` (fp16 on CUDA) on the same GPU, after
the server has stopped, over passages of the batch clients' lengths, a new set each pass, at
each batch size given (128, 256, 512 by default): its best rate is the figure a user would
otherwise get, set beside the server's batch-alone tokens/s in the summary.

`--py-spy DIR` (py-spy on PATH) records the server through the last round's batch-alone and
mixed windows: which threads run and which hold the GIL, as collapsed stacks that
`python -m tools.profiling.collapsed FILE` sums up (FERN_PY_SPY_NATIVE=1 adds C frames, at
the price of pausing the server at each sample).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import subprocess
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

from benchmarks.provenance import result_header
from benchmarks.server import start_sidecar
from benchmarks.stats import percentiles
from benchmarks.texts import make_texts
from sidecar.scheduler.config import SchedulerConfig
from sidecar.serve import SCHEDULER_KNOBS


def _tokenizer_path(model: str | None) -> Path:
    if model is None:
        from core_engine.loader import default_model_dir

        return default_model_dir() / "tokenizer.json"
    return Path(model) / "tokenizer.json"


READY = "ready"


def _batch_client(target: str, tokenizer: str, seed: int, texts: int, low: int, high: int,
                  go: "mp.synchronize.Event", stop: "mp.synchronize.Event", windows: "mp.Queue",
                  results: "mp.Queue") -> None:
    """One BATCH client process: requests back to back while `go` is set, tokens counted per window.

    `windows` brings (start, end) wall-clock windows; for each, the tokens of requests that
    completed inside it are reported. A unique counter in front of each pooled text keeps
    every text new to the server (its tokenizer memo and any cache). It says READY on `results`
    once its texts are made and its channel is up, so no window starts before it can send."""
    from sidecar.client import FernClient

    rng = random.Random(seed)
    pool = make_texts(tokenizer, [rng.randint(low, high - 4) for _ in range(4 * texts)], seed=seed)
    counter = seed * 10_000_000
    with FernClient(target, timeout=600) as client:
        client.wait_ready()
        results.put(READY)
        while not stop.is_set():
            if not go.wait(timeout=0.1):
                continue
            start, end = windows.get()
            done: list[tuple[float, int, int]] = []
            while go.is_set() and time.time() < end:
                batch = []
                for _ in range(texts):
                    counter += 1
                    batch.append(f"{counter} {pool[counter % len(pool)]}")
                result = client.embed(batch, lane="batch")
                done.append((time.time(), int(result.token_counts.sum()), len(batch)))
            inside = [(t, n, k) for t, n, k in done if start <= t <= end]
            results.put({"tokens": sum(n for _, n, _ in inside), "texts": sum(k for _, _, k in inside),
                         "requests": len(inside)})


def _online(client, texts: list[str], rate: float, seconds: float, marks: list | None = None) -> dict:
    """Queries at `rate`/s for `seconds`, one at a time: latency from each send to its answer.

    A query still out when the next one is due holds that one back, so `latency` alone would
    leave out the wait of every query sent late (coordinated omission). `from_schedule` also
    counts it: each query's latency from when it was due, or from its send where it went on
    time. The two agree while the server keeps up; where they part, the server fell behind
    the rate and `from_schedule` is what a caller sending at that rate would have seen.
    `marks`, if given, gets each query's (CRC-32 of its text, send ns, answer ns) for `--trace`.
    """
    samples, scheduled, late = [], [], 0
    start = time.perf_counter()
    for i, text in enumerate(texts):
        due = start + i / rate
        if due - start >= seconds:
            break
        now = time.perf_counter()
        if now < due:
            time.sleep(due - now)
        elif now - due > 1.0 / rate:
            late += 1
        sent_ns = time.perf_counter_ns()
        client.embed([text], lane="online")
        answered_ns = time.perf_counter_ns()
        sent, answered = sent_ns / 1e9, answered_ns / 1e9
        if marks is not None:
            marks.append((zlib.crc32(text.encode()), sent_ns, answered_ns))
        samples.append((answered - sent) * 1e3)
        scheduled.append((answered - (sent if now < due else due)) * 1e3)
    return {"latency": percentiles(samples, digits=4), "p999_ms": _p999(samples), "late_sends": late,
            "from_schedule": {**(percentiles(scheduled, digits=4) or {}), "p999_ms": _p999(scheduled)}}


def _py_spy(pid: int, out_dir: Path | None, name: str | None, delay: float, seconds: float) -> list:
    """Start py-spy on the server for a phase's timed window: which threads run, and which hold the GIL."""
    if out_dir is None or name is None:
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    # --native (C frames too) pauses the server at each sample, so only on request.
    how = ["--native"] if os.environ.get("FERN_PY_SPY_NATIVE") else ["--nonblocking"]
    base = ["py-spy", "record", "--pid", str(pid), *how, "--threads", "--rate", "500",
            "--format", "raw", "--duration", str(max(1, int(seconds)))]
    spies = []
    for suffix, extra in (("cpu", []), ("gil", ["--gil"])):
        spies.append(subprocess.Popen(
            ["bash", "-c", f"sleep {delay}; exec \"$@\"", "py-spy", *base, *extra,
             "-o", str(out_dir / f"py-spy-{name}-{suffix}.txt")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return spies


# A traced query's stages, each from the first checkpoint to the second (tools/profiling/traced.py;
# "sent" and "answered" are the client's).
STAGES = (("grpc_in", "sent", "handler"), ("prepare", "handler", "prepared"), ("admit", "prepared", "admitted"),
          ("queued", "admitted", "launched"), ("step", "launched", "delivered"), ("hand_back", "delivered", "resumed"),
          ("finalize", "resumed", "executed"), ("respond", "executed", "handler_end"),
          ("grpc_out", "handler_end", "answered"))


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stage_breakdown(trace: dict, client_marks: dict[str, list[tuple[int, int, int]]]) -> dict:
    """Per phase: each stage's percentiles over the phase's queries, and each stage's mean over the
    slowest 1 % of them (where their time went), with how many steps were launched while they were
    queued. Queries are matched to the server's records by their text's CRC-32."""
    calls = {call["crc"]: call for call in trace["calls"]}
    launches = np.array([t for t, _, _ in trace["steps"]], dtype=np.int64)
    out = {}
    for phase, marks in client_marks.items():
        rows = []
        for crc, sent, answered in marks:
            call = calls.get(crc)
            if call is None or any(name not in call for _, name, _ in STAGES[1:]):
                continue
            points = {**call, "sent": sent, "answered": answered}
            stages = {name: (points[end] - points[start]) / 1e6 for name, start, end in STAGES}
            steps_while_queued = int(np.searchsorted(launches, call["launched"])
                                     - np.searchsorted(launches, call["admitted"]))
            rows.append((sum(stages.values()), stages, steps_while_queued, call.get("by_loop", False)))
        if not rows:
            continue
        rows.sort(key=lambda row: row[0])
        slowest = rows[-max(1, len(rows) // 100):]
        out[phase] = {
            "queries": len(rows), "matched_of": len(marks),
            "stages_ms": {name: percentiles([row[1][name] for row in rows], digits=4) for name, _, _ in STAGES},
            "slowest_1pct_mean_ms": {name: round(float(np.mean([row[1][name] for row in slowest])), 4)
                                     for name, _, _ in STAGES},
            "slowest_1pct_total_ms": round(float(np.mean([row[0] for row in slowest])), 4),
            "slowest_1pct_steps_launched_while_queued": round(float(np.mean([row[2] for row in slowest])), 2),
            "launched_by_loop": round(sum(row[3] for row in rows) / len(rows), 4),
            # Queries with a checkpoint before the one it follows: 0 unless the clocks or the wiring are wrong.
            "out_of_order": sum(any(value < 0 for value in row[1].values()) for row in rows),
        }
    return out


def sentence_transformers_baseline(model: str | None, device: str, tokenizer: str, low: int, high: int,
                                   texts: int, batch_sizes: list[int], passes: int = 3) -> dict:
    """Tokens/s of sentence-transformers `encode` on passages of `low`..`high` tokens (specials included).

    Each pass, warm-up included, gets texts no other pass saw; per batch size, one untimed pass
    and then the median of `passes` timed ones, each closed by a device synchronize."""
    import statistics

    from benchmarks.suite import _sync, sentence_transformer
    from core_engine.loader import default_model_dir

    st = sentence_transformer(Path(model) if model else default_model_dir(), device, high)
    rng = random.Random(7)
    seeds = iter(range(1000, 2000))

    def one_pass(batch_size: int) -> float:
        lengths = [rng.randint(low, high) for _ in range(texts)]
        passages = make_texts(tokenizer, lengths, seed=next(seeds))
        _sync(device)
        started = time.perf_counter()
        st.encode(passages, batch_size=batch_size, convert_to_numpy=True, show_progress_bar=False)
        _sync(device)
        return sum(lengths) / (time.perf_counter() - started)

    rates = {}
    for batch_size in batch_sizes:
        one_pass(batch_size)
        rates[str(batch_size)] = round(statistics.median(one_pass(batch_size) for _ in range(passes)), 1)
    best = max(rates, key=rates.get)
    return {"dtype": "float16" if device.startswith("cuda") else "float32", "texts_per_pass": texts, "passes": passes,
            "tokens_per_s_by_batch_size": rates, "best_batch_size": int(best), "tokens_per_s": rates[best]}


def _p999(samples: list[float]) -> float | None:
    if len(samples) < 1000:
        return None
    ordered = sorted(samples)
    return round(ordered[min(len(ordered) - 1, int(0.999 * len(ordered)))], 4)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lanes_e2e", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default=None, help="fern serve --model DIR (default: the bundled MiniLM)")
    p.add_argument("--online-rate", type=float, default=200.0, help="queries per second")
    p.add_argument("--online-tokens", type=int, default=20)
    p.add_argument("--batch-clients", type=int, default=4, help="BATCH client processes")
    p.add_argument("--batch-texts", type=int, default=256, help="passages per BATCH request")
    p.add_argument("--batch-low", type=int, default=64)
    p.add_argument("--batch-high", type=int, default=256)
    p.add_argument("--seconds", type=float, default=10.0, help="timed length of each phase")
    p.add_argument("--warmup-seconds", type=float, default=3.0, help="untimed lead-in of each phase")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--serve-arg", action="append", default=[], help="more `fern serve` flags (repeatable)")
    p.add_argument("--stand-in", default=None, metavar="US,NS",
                   help="a stand-in forward pass ready US us + NS ns per token after launch (e.g. 100,100 for "
                        "MiniLM on an H200), with the GPU's step budgets")
    p.add_argument("--py-spy", type=Path, default=None, metavar="DIR",
                   help="record the server with py-spy (on PATH) in the last round's batch-alone and mixed "
                        "phases: collapsed stacks per thread, on-CPU and GIL holder, written under DIR")
    p.add_argument("--trace", action="store_true",
                   help="time each online query's stages in the server (tools/profiling/traced.py): per phase, "
                        "each stage's percentiles and where the slowest 1 %% of queries spent their time")
    p.add_argument("--st-baseline", type=int, nargs="*", default=None, metavar="BATCH_SIZE",
                   help="after the rounds, sentence-transformers encode() on the same device and passage lengths "
                        "at these batch sizes (none given: 128 256 512)")
    p.add_argument("--st-texts", type=int, default=4096, help="passages in each sentence-transformers pass")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.st_baseline is not None and not args.st_baseline:
        args.st_baseline = [128, 256, 512]
    if args.st_baseline and args.stand_in:
        p.error("--st-baseline: a stand-in forward pass has no sentence-transformers counterpart")

    from sidecar.client import FernClient

    tokenizer = str(_tokenizer_path(args.model))
    per_phase = int(args.online_rate * args.seconds) + 1
    queries = make_texts(tokenizer, [args.online_tokens] * (per_phase * 2 * args.rounds + 200), seed=26)
    extra = [a for arg in args.serve_arg for a in arg.split()]
    launcher: tuple[str, ...] = ("-m", "sidecar.cli")
    stand_in: tuple[str, ...] = ()  # the stand-in's flags, for tools.profiling.stand_in or .traced
    if args.stand_in:
        engine_us, ns_per_token = (float(x) for x in args.stand_in.split(","))
        stand_in = ("--engine-us", str(engine_us), "--engine-ns-per-token", str(ns_per_token))
        launcher = ("-m", "tools.profiling.stand_in", *stand_in)
        gpu = SchedulerConfig()  # the budgets a GPU engine gets (the CPU's are for a CPU forward pass)
        budgets = [str(a) for flag, field in SCHEDULER_KNOBS.items() for a in (f"--{flag}", getattr(gpu, field))]
        extra = [*budgets, *extra]
    log_dir = Path(tempfile.mkdtemp(prefix="fern-lanes-"))
    trace_file, client_marks = log_dir / "trace.json", {}
    if args.trace:
        launcher = ("-m", "tools.profiling.traced", "--out", str(trace_file), *stand_in)
    served = start_sidecar(Path(args.model) if args.model else None, device=args.device, extra=extra,
                           log_dir=log_dir, name="lanes", launcher=launcher)
    ctx = mp.get_context("spawn")
    go, stop = ctx.Event(), ctx.Event()
    windows, results = ctx.Queue(), ctx.Queue()
    workers = [ctx.Process(target=_batch_client, daemon=True,
                           args=(served.target, tokenizer, 1 + k, args.batch_texts, args.batch_low,
                                 args.batch_high, go, stop, windows, results))
               for k in range(args.batch_clients)]
    for w in workers:
        w.start()
    for _ in workers:
        if results.get(timeout=600) != READY:
            raise RuntimeError("lanes_e2e: a batch client reported before it was ready")

    def batch_window(online=None, profile: str | None = None) -> tuple[dict, dict | None]:
        start = time.time() + args.warmup_seconds
        end = start + args.seconds
        for _ in workers:
            windows.put((start, end))
        go.set()
        spies = _py_spy(served.process.pid, args.py_spy, profile, args.warmup_seconds, args.seconds)
        time.sleep(max(0.0, start - time.time()))
        cpu_start = process_cpu_seconds(served.process.pid)
        online_result = online() if online is not None else None
        time.sleep(max(0.0, end - time.time()))
        cpu = process_cpu_seconds(served.process.pid) - cpu_start
        go.clear()
        for spy in spies:
            spy.wait(timeout=60)
        parts = [results.get(timeout=600) for _ in workers]
        tokens = sum(r["tokens"] for r in parts)
        return {"tokens_per_s": round(tokens / args.seconds, 1), "texts_per_s": round(
            sum(r["texts"] for r in parts) / args.seconds, 1), "requests": sum(r["requests"] for r in parts),
            # The server's own process (its loop, engine thread, tokenizer threads; not its
            # tokenizer worker processes): cores busy over the window, and CPU per batch token.
            "server_cpu_cores": round(cpu / args.seconds, 3),
            "server_cpu_ms_per_m_tokens": round(cpu * 1e9 / max(tokens, 1), 1)}, online_result

    header = result_header("benchmarks.lanes_e2e", argv)
    rounds, cursor = [], 0

    def write(complete: bool) -> dict:
        """The result of the rounds so far, written to --out after each round: a run cut short
        (a device's time limit) keeps what it measured."""
        result = {
            **header,
            "server_command": " ".join(served.command), "seconds_to_serving": round(served.seconds_to_serving, 2),
            "server_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("FERN_")},
            "device": args.device if not args.stand_in else f"{args.device}, stand-in forward pass {args.stand_in}",
            "workload": {"online_rate_per_s": args.online_rate, "online_tokens": args.online_tokens,
                         "batch_clients": args.batch_clients, "batch_texts_per_request": args.batch_texts,
                         "batch_tokens": [args.batch_low, args.batch_high], "seconds": args.seconds,
                         "warmup_seconds": args.warmup_seconds, "rounds": args.rounds},
            "complete": complete,
            "rounds": rounds,
            "summary": {
                "online_alone_p99_ms": [x["online_alone"]["latency"]["p99_ms"] for x in rounds],
                "online_mixed_p99_ms": [x["mixed"]["online"]["latency"]["p99_ms"] for x in rounds],
                "online_mixed_p999_ms": [x["mixed"]["online"]["p999_ms"] for x in rounds],
                "online_mixed_p99_from_schedule_ms": [x["mixed"]["online"]["from_schedule"]["p99_ms"]
                                                      for x in rounds],
                "batch_alone_tokens_per_s": [x["batch_alone"]["tokens_per_s"] for x in rounds],
                "batch_mixed_over_alone": [x["batch_mixed_over_alone"] for x in rounds],
                "batch_alone_server_cpu_ms_per_m_tokens": [x["batch_alone"]["server_cpu_ms_per_m_tokens"]
                                                           for x in rounds],
            },
        }
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n")
        return result

    try:
        with FernClient(served.target, timeout=60) as client:
            for text in queries[-200:]:  # warm the online path (and, on CUDA, its graphs)
                client.embed([text], lane="online")

            def online(phase: str):
                nonlocal cursor
                chunk = queries[cursor:cursor + per_phase]
                cursor += per_phase
                marks = client_marks.setdefault(phase, []) if args.trace else None
                return _online(client, chunk, args.online_rate, args.seconds, marks)

            for r in range(args.rounds):
                alone = online(f"round {r} online alone")
                last = r == args.rounds - 1
                batch_alone, _ = batch_window(profile="batch-alone" if last else None)
                batch_mixed, mixed = batch_window(lambda: online(f"round {r} mixed"),
                                                  profile="mixed" if last else None)
                rounds.append({"online_alone": alone, "batch_alone": batch_alone,
                               "mixed": {"online": mixed, "batch": batch_mixed},
                               "batch_mixed_over_alone": round(batch_mixed["tokens_per_s"]
                                                               / max(batch_alone["tokens_per_s"], 1e-9), 4)})
                print(json.dumps({"round": r, **rounds[-1]}), flush=True)
                write(complete=False)
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=30)
            if w.is_alive():
                w.kill()
        served.stop()
    result = write(complete=True)
    if args.st_baseline:
        st = sentence_transformers_baseline(args.model, args.device, tokenizer, args.batch_low, args.batch_high,
                                            args.st_texts, args.st_baseline)
        result["sentence_transformers"] = st
        result["summary"]["batch_alone_over_sentence_transformers"] = [
            round(rate / st["tokens_per_s"], 2) for rate in result["summary"]["batch_alone_tokens_per_s"]]
        if args.out:
            args.out.write_text(json.dumps(result, indent=2) + "\n")
    if args.trace:
        result["trace"] = (stage_breakdown(json.loads(trace_file.read_text()), client_marks) if trace_file.exists()
                           else {"missing": f"the server wrote no {trace_file} (it did not exit by itself)"})
        if args.out:
            args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps({phase: t["slowest_1pct_mean_ms"] for phase, t in result["trace"].items()}))
    print(json.dumps(result["summary"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
