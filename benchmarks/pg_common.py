"""Shared pieces of the adapter benchmarks (also Qdrant's): corpus, engine and stream runs, sidecar, worker, result file."""

from __future__ import annotations

import contextlib
import datetime
import json
import random
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from benchmarks.provenance import code_identity, machine

if TYPE_CHECKING:
    from benchmarks.server import ServedSidecar


def passages(n: int, seed: int, words: Sequence[str]) -> list[str]:
    """`n` deterministic passages of 20-60 of `words`."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(20, 60))).capitalize() + "."
            for _ in range(n)]


class EngineRun:
    """The in-process engine on the corpus, tokenized once and packed into the sidecar's steps.

    The ceiling for anything that goes through the sidecar: its own tokenizer (not timed),
    then `Engine.embed` on steps of the sidecar's CPU/GPU step budget
    (SchedulerConfig.for_device(...).max_step_tokens). Torch's thread count is the caller's.
    """

    def __init__(self, texts: list[str], device: str) -> None:
        from core_engine.engine import Engine
        from sidecar.scheduler import SchedulerConfig
        from sidecar.tokenize import TextTokenizer

        self.engine = Engine(device=device)
        self.budget = SchedulerConfig.for_device(self.engine.device.type).max_step_tokens
        tokenizer = TextTokenizer.for_spec(self.engine.spec)
        seqs = tokenizer.encode(texts)
        tokenizer.close()
        self.rows = len(texts)
        self.tokens = sum(len(s) for s in seqs)
        self.steps: list[list[list[int]]] = []
        step: list[list[int]] = []
        used = 0
        for ids in seqs:
            if step and used + len(ids) > self.budget:
                self.steps.append(step)
                step, used = [], 0
            step.append(ids)
            used += len(ids)
        self.steps.append(step)
        self.engine.embed(self.steps[0])  # first-step costs (allocations, lazy init) untimed

    def measure(self) -> dict[str, Any]:
        start = time.perf_counter()
        for step in self.steps:
            self.engine.embed(step)
        seconds = time.perf_counter() - start
        return {"rows_per_s": self.rows / seconds, "tokens_per_s": self.tokens / seconds,
                "seconds": seconds, "tokens": self.tokens, "step_tokens": self.budget,
                "steps": len(self.steps), "device": str(self.engine.device)}


def measure_stream(target: str, texts: list[str], batch_size: int,
                   **options: Any) -> dict[str, Any]:
    """`texts` through the sidecar with FernClient.embed_stream in requests of `batch_size`,
    vectors received and dropped: what the sidecar and gRPC leave of the engine's rate.
    `options` are the requests' EmbedOptions (prompt=..., sparse=...)."""
    from sidecar.client import FernClient

    with FernClient(target) as fern:
        chunks = [(str(i), texts[i:i + batch_size]) for i in range(0, len(texts), batch_size)]
        start = time.perf_counter()
        rows = sum(len(r.embeddings) for r in fern.embed_stream(chunks, **options))
        seconds = time.perf_counter() - start
    return {"rows_per_s": rows / seconds, "seconds": seconds}


def warm_sidecar(target: str, texts: list[str]) -> None:
    """Wait until the sidecar serves, then run its first-call paths, untimed."""
    from sidecar.client import FernClient

    with FernClient(target) as fern:
        fern.wait_ready(60)
        fern.embed(texts[:8], lane="batch")


def best_of_rounds(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each measurement's fastest round: on a shared machine, other load only ever slows a
    run down."""
    return {name: max(values, key=lambda r: r["rows_per_s"]) for name, values in runs.items()}


def start_sidecar(device: str) -> ServedSidecar:
    """`fern serve` in a subprocess (benchmarks/server.py); returns the ServedSidecar."""
    from benchmarks.server import start_sidecar as start

    return start(None, device=device, log_dir=Path(tempfile.mkdtemp(prefix="fern-pg-bench-")),
                 name="pg")


@contextlib.contextmanager
def running_worker(dsn: str, target: str, batch_size: int) -> Iterator[subprocess.Popen]:
    """`fern pg worker` in its own process, as it runs in production, given 2 s to connect and
    LISTEN before the body runs; terminated after it."""
    worker = subprocess.Popen([sys.executable, "-m", "sidecar.cli", "pg", "worker", "--dsn", dsn,
                               "--target", target, "--batch-size", str(batch_size),
                               "--progress", "off"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        time.sleep(2.0)
        yield worker
    finally:
        worker.terminate()
        worker.wait(30)


def write_result(name: str, argv: list[str] | None, result: dict[str, Any], out: Path) -> None:
    """Write `result` with the exact command, machine and date; print it."""
    args = argv if argv is not None else sys.argv[1:]
    # The module `python -m` ran (tools.profiling.* as well as benchmarks.*).
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    module = spec.name if spec is not None and spec.name.endswith(f".{name}") else f"benchmarks.{name}"
    full = {"benchmark": name,
            "command": f"python -m {module} " + " ".join(shlex.quote(a) for a in args),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(), **code_identity(), **result}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(full, indent=2) + "\n")
    print(json.dumps(full, indent=2))
