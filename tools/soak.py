"""Soaks Fern under mixed online and batch load with faults injected in turn, and audits every row and each sidecar's memory at the end.

    python -m tools.soak --minutes 30 --out benchmarks/results/cpu/soak.json
    python -m tools.soak --minutes 30 --faults worker_sigkill,postgres_restart \
        --out benchmarks/results/cpu/soak-long-lived-sidecars.json
    python -m tools.soak --minutes 2 --fault-every 0.5 --out /tmp/soak-trial.json

Two `fern serve` sidecars (bundled model, CPU, one thread each) on fixed ports behind one
comma-list target; an embedded PostgreSQL 18 with a table under two vectorizers (one vector
per row, and split chunks); two in-process workers and one `fern pg worker` subprocess; an
online thread embedding one query every ~20 ms; a writer inserting rows and updating texts
and keys. Every `--fault-every` minutes one fault, in turn: SIGKILL a sidecar (back on its
port after 5 s), SIGTERM the other (drain, then back), SIGKILL the worker subprocess (a new
one starts), crash-restart PostgreSQL (`--faults` picks some of them: without the sidecar
faults, each sidecar lives the whole run and its RSS shows whether it levels off). At the end the writer stops, the queue drains and
every row is audited: lost, stale, duplicated (goal 0 each; exit status 1 otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import psycopg

from adapters.postgres.chunking import split_text
from adapters.postgres.embedded import EmbeddedPostgres
from adapters.postgres.installer import install
from adapters.postgres.vectorizer import create_vectorizer
from adapters.postgres.worker import Worker, WorkerConfig
from benchmarks.provenance import result_header
from benchmarks.server import free_port
from sidecar.client import FernClient, FernError

WORDS = ("amber basalt cedar delta ember fjord garnet harbor indigo juniper kelp lagoon meadow "
         "nickel orchid prairie quartz river saffron tundra umber violet willow xenon yarrow "
         "zephyr alpine brook canyon dune").split()
QUERIES = ("cedar harbor at dusk", "quartz in the meadow", "a lagoon of kelp", "violet tundra")
CHUNK_TOKENS, CHUNK_OVERLAP = 32, 4
FLAT_GROWTH_PCT = 5.0  # a life of 10 minutes or more is flat when its second half grew at most this much
FAULTS = ("sidecar_sigkill", "sidecar_sigterm", "worker_sigkill", "postgres_restart")
AUDIT_CHUNK = 4096
SIDECAR_DOWN_S = 5.0
RSS_EVERY_S = 10.0
DRAIN_TIMEOUT_S = 600.0
DB_ERRORS = (psycopg.OperationalError, psycopg.InterfaceError)


def text_for(rng: random.Random, key: int, version: int) -> str:
    """A passage of 8–40 words that names its key and version, so no two texts are alike."""
    return f"row {key} v{version}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40)))


def rss_kib(pid: int) -> int | None:
    """VmRSS of `pid` in KiB, None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def cpu_seconds(pid: int, children: bool = False) -> float | None:
    """User plus system CPU seconds of `pid` (with its waited-for children's when asked)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    ticks = int(fields[11]) + int(fields[12])
    if children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / os.sysconf("SC_CLK_TCK")


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def _vec(v) -> np.ndarray:
    return np.asarray(v.to_numpy() if hasattr(v, "to_numpy") else v, dtype=np.float32)


class Clock:
    """Seconds since the soak began."""

    def __init__(self) -> None:
        self.start = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.start


class Sidecar:
    """One `fern serve` on a fixed port, so a restarted one comes back at the same address."""

    def __init__(self, name: str, port: int, log_dir: Path) -> None:
        self.name, self.port = name, port
        self.log_path = log_dir / f"sidecar-{name}.log"
        self.process: subprocess.Popen | None = None
        self.starts = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> None:
        command = [sys.executable, "-m", "sidecar.cli", "serve", "--host", "127.0.0.1",
                   "--port", str(self.port), "--device", "cpu"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        with self.log_path.open("a") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        self.starts += 1
        deadline = time.monotonic() + timeout
        with FernClient(self.target) as client:
            while not client.health(timeout=1.0):
                if self.process.poll() is not None:
                    raise RuntimeError(f"sidecar {self.name} exited with {self.process.returncode}; "
                                       f"see {self.log_path}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"sidecar {self.name} not SERVING after {timeout:g}s; "
                                       f"see {self.log_path}")
                time.sleep(0.1)

    def signal(self, sig: int, wait: float = 60.0) -> int | None:
        """Send `sig` and wait for the exit status (SIGKILL after `wait`)."""
        assert self.process is not None
        self.process.send_signal(sig)
        try:
            return self.process.wait(wait)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(30)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None and self.process.poll() is None else None


class CliWorker:
    """`fern pg worker` in its own process group, so SIGKILL takes it down mid-claim."""

    def __init__(self, dsn: str, target: str, log_dir: Path) -> None:
        self.dsn, self.target = dsn, target
        self.log_path = log_dir / "cli-worker.log"
        self.process: subprocess.Popen | None = None
        self.cpu_of_dead = 0.0

    def start(self) -> None:
        with self.log_path.open("a") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "sidecar.cli", "pg", "worker", "--dsn", self.dsn,
                 "--target", self.target, "--batch-size", "16", "--progress", "off"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"})

    def cpu(self) -> float:
        live = cpu_seconds(self.process.pid) if self.process is not None else None
        return self.cpu_of_dead + (live or 0.0)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.cpu_of_dead += cpu_seconds(self.process.pid) or 0.0
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)


def keep_postgres(pipe) -> None:
    """Runs the embedded PostgreSQL in a process without gRPC threads: restarting it forks with
    a Python preexec hook, which is not safe in a process whose other threads are inside gRPC."""
    # Commits durable when acknowledged, as in production: a crash keeps what was committed.
    with EmbeddedPostgres(settings={"synchronous_commit": "on"}) as pg:
        pipe.send((pg.dsn, pg.pid))
        while True:
            try:
                command = pipe.recv()
            except EOFError:
                return
            if command != "restart":
                return
            try:
                pg.restart_after_crash()
                pipe.send(("ok", pg.pid))
            except Exception as err:  # sent back and raised in the soak's process
                pipe.send(("error", f"{type(err).__name__}: {err}"))
                return


class Postgres:
    """The embedded PostgreSQL, kept by a spawned process (see keep_postgres)."""

    def __init__(self) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._pipe, theirs = ctx.Pipe()
        self._process = ctx.Process(target=keep_postgres, args=(theirs,), daemon=True)
        self._process.start()
        if not self._pipe.poll(180):
            raise TimeoutError("the embedded PostgreSQL did not start in 180 s")
        self.dsn, self.pid = self._pipe.recv()

    def restart_after_crash(self) -> None:
        self._pipe.send("restart")
        if not self._pipe.poll(180):
            raise TimeoutError("the embedded PostgreSQL did not come back in 180 s")
        state, value = self._pipe.recv()
        if state != "ok":
            raise RuntimeError(f"restarting the embedded PostgreSQL failed: {value}")
        self.pid = value

    def __enter__(self) -> "Postgres":
        return self

    def __exit__(self, *exc) -> None:
        self._pipe.send("stop")
        self._process.join(120)


@dataclass
class OnlineStats:
    """What the online thread saw: latencies (ms) and errors by gRPC code, with times."""

    latencies_ms: list[float] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)
    error_times: list[float] = field(default_factory=list)


def online_load(target: str, interval: float, stats: OnlineStats, clock: Clock,
                stop: threading.Event) -> None:
    """One short query every `interval` seconds, as a search box would send."""
    with FernClient(target, timeout=10.0) as client:
        i = 0
        while not stop.is_set():
            began = time.perf_counter()
            try:
                client.embed([QUERIES[i % len(QUERIES)]], prompt="query")
                stats.latencies_ms.append((time.perf_counter() - began) * 1e3)
            except FernError as err:
                stats.errors[err.code.name] += 1
                stats.error_times.append(clock.now())
            i += 1
            stop.wait(max(0.0, interval - (time.perf_counter() - began)))


@dataclass
class WriterStats:
    inserts: int = 0
    text_updates: int = 0
    key_updates: int = 0
    db_errors: int = 0
    reconnects: int = 0


def batch_writer(dsn: str, rate: float, stats: WriterStats, stop: threading.Event,
                 seed: int = 7) -> None:
    """Inserts `rate` rows a second; each second updates a few texts and one key, so the
    workers always have a queue and races between updates and claims keep happening."""
    rng = random.Random(seed)
    next_key, version = 1_000_000, 1
    conn: psycopg.Connection | None = None
    last_updates = time.monotonic()
    while not stop.is_set():
        try:
            if conn is None or conn.closed or conn.broken:
                conn = psycopg.connect(dsn, autocommit=True, connect_timeout=5)
                stats.reconnects += 1
            conn.execute("INSERT INTO items VALUES (%s, %s)",
                         (next_key, text_for(rng, next_key, 0)))
            next_key += 1
            stats.inserts += 1
            if time.monotonic() - last_updates >= 1.0:
                last_updates = time.monotonic()
                ids = [r[0] for r in conn.execute(
                    "SELECT id FROM items ORDER BY random() LIMIT 4").fetchall()]
                for key in ids[:3]:
                    version += 1
                    conn.execute("UPDATE items SET body = %s WHERE id = %s",
                                 (text_for(rng, key, version), key))
                    stats.text_updates += 1
                if len(ids) > 3:
                    conn.execute("UPDATE items SET id = %s WHERE id = %s", (next_key, ids[3]))
                    next_key += 1
                    stats.key_updates += 1
        except psycopg.errors.UniqueViolation:
            # An insert whose commit the restart hid went through after all: take the next key.
            next_key += 1
        except DB_ERRORS:
            stats.db_errors += 1
            if conn is not None:
                conn.close()
            conn = None
            stop.wait(1.0)
            continue
        stop.wait(1.0 / rate)
    if conn is not None:
        conn.close()


@dataclass
class ThreadWorker:
    """A Worker run in a thread, reconnecting when the database goes away (as `fern pg worker`)."""

    worker: Worker
    reconnects: int = 0
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.worker.run()
                return
            except DB_ERRORS:
                self.reconnects += 1
            except Exception as err:  # recorded in the result; the soak goes on with a new pass
                self.failures.append(f"{type(err).__name__}: {err}")
            self.stop.wait(2.0)

    def halt(self) -> None:
        self.stop.set()
        self.worker.stop()


class DepthProbe:
    """Samples the queue's depth every half second on its own connection."""

    def __init__(self, dsn: str, clock: Clock) -> None:
        self.dsn, self.clock = dsn, clock
        self.samples: deque[tuple[float, int]] = deque(maxlen=240)
        self.stop = threading.Event()
        self.errors = 0

    def run(self) -> None:
        conn: psycopg.Connection | None = None
        while not self.stop.is_set():
            try:
                if conn is None or conn.closed or conn.broken:
                    conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=5)
                depth = conn.execute("SELECT count(*) FROM fern.queue").fetchone()[0]
                self.samples.append((self.clock.now(), depth))
            except DB_ERRORS:
                self.errors += 1
                if conn is not None:
                    conn.close()
                conn = None
            self.stop.wait(0.5)
        if conn is not None:
            conn.close()

    def latest(self) -> int | None:
        return self.samples[-1][1] if self.samples else None

    def max_since(self, t: float) -> int:
        return max((d for at, d in self.samples if at >= t), default=0)


class RssProbe:
    """VmRSS of every sidecar every 10 s, with the pid (a restart starts a new life)."""

    def __init__(self, sidecars: list[Sidecar], clock: Clock) -> None:
        self.sidecars, self.clock = sidecars, clock
        self.samples: dict[str, list[tuple[float, int, int]]] = {s.name: [] for s in sidecars}
        self.cpu: dict[int, float] = {}  # last CPU seconds seen per sidecar pid
        self.stop = threading.Event()

    def sample(self) -> None:
        for s in self.sidecars:
            pid = s.pid
            if pid is None:
                continue
            kib = rss_kib(pid)
            cpu = cpu_seconds(pid)
            if kib is not None:
                self.samples[s.name].append((round(self.clock.now(), 1), pid, kib))
            if cpu is not None:
                self.cpu[pid] = cpu

    def run(self) -> None:
        while not self.stop.is_set():
            self.sample()
            self.stop.wait(RSS_EVERY_S)


def _second_half(life: list[tuple[float, int]]) -> dict:
    """For a life of 10 minutes or more: RSS growth over its second half, the mean of its last
    3 minutes against the mean of the 3 minutes around its middle. A leak keeps growing there;
    a heap settling into its working set does not."""
    start, end = life[0][0], life[-1][0]
    if end - start < 600:
        return {}
    middle = (start + end) / 2
    around_middle = [k for t, k in life if abs(t - middle) <= 90]
    last = [k for t, k in life if t >= end - 180]
    growth = statistics.mean(last) / statistics.mean(around_middle) - 1
    return {"middle_3min_mean_mib": round(statistics.mean(around_middle) / 1024, 1),
            "last_3min_mean_mib": round(statistics.mean(last) / 1024, 1),
            "second_half_growth_pct": round(100 * growth, 1)}


def rss_report(samples: list[tuple[float, int, int]]) -> dict:
    """First, max and last RSS (MiB), a per-minute series, and per process life whether it is
    flat: for a life of 10 minutes or more, its second half grew by at most FLAT_GROWTH_PCT;
    for a shorter one, its last sample is within +25% of its first minute."""
    if not samples:
        return {}
    mib = lambda k: round(k / 1024, 1)  # noqa: E731
    per_minute: dict[int, list[int]] = {}
    for t, _, kib in samples:
        per_minute.setdefault(int(t // 60), []).append(kib)
    lives = []
    for pid in dict.fromkeys(p for _, p, _ in samples):
        life = [(t, k) for t, p, k in samples if p == pid]
        first_minute = [k for t, k in life if t < life[0][0] + 60]
        base = statistics.mean(first_minute)
        lives.append({"pid": pid, "from_s": life[0][0], "to_s": life[-1][0], "samples": len(life),
                      "first_minute_mean_mib": mib(base), "max_mib": mib(max(k for _, k in life)),
                      "last_mib": mib(life[-1][1]),
                      "last_within_25pct_of_first_minute": life[-1][1] <= 1.25 * base,
                      **_second_half(life)})
    # A life of a few samples says nothing about growth: judge the lives of two minutes or more.
    judged = [life for life in lives if life["to_s"] - life["from_s"] >= 120] or lives
    for life in lives:
        # A long life is judged by its second half, past the first minutes' warm-up (the heap
        # growing into its working set): flat when that half grew by at most 5%. A short one
        # by its last sample against its first minute.
        growth = life.get("second_half_growth_pct")
        life["flat"] = growth <= FLAT_GROWTH_PCT if growth is not None else life["last_within_25pct_of_first_minute"]
    first_minute = statistics.mean(per_minute[min(per_minute)])
    return {"first_mib": mib(samples[0][2]), "max_mib": mib(max(k for *_, k in samples)),
            "last_mib": mib(samples[-1][2]), "first_minute_mean_mib": mib(first_minute),
            "last_within_25pct_of_first_minute": samples[-1][2] <= 1.25 * first_minute,
            "per_minute_mean_mib": {m: mib(statistics.mean(v)) for m, v in sorted(per_minute.items())},
            "lives": lives,
            "flat": all(life["flat"] for life in judged)}


def audit(conn: psycopg.Connection, client: FernClient) -> dict[str, int]:
    """Rows lost, stale and duplicated, against the sidecars' vectors for the current texts."""
    from pgvector.psycopg import register_vector

    register_vector(conn)
    rows = dict(conn.execute("SELECT id, body FROM items").fetchall())
    vectors = dict(conn.execute("SELECT id, embedding FROM items").fetchall())
    chunks: dict[int, list[tuple[int, str, object]]] = {}
    for key, index, text, vec in conn.execute(
            "SELECT id, chunk_index, chunk_text, chunked FROM items_chunked_chunks ORDER BY 1, 2"):
        chunks.setdefault(key, []).append((index, text, vec))

    def embed(texts: list[str]) -> np.ndarray:
        return np.concatenate([client.embed(texts[i:i + AUDIT_CHUNK], prompt="passage",
                                            timeout=600).vectors
                               for i in range(0, len(texts), AUDIT_CHUNK)])

    ids = sorted(rows)
    lost = stale = duplicated = 0
    have = [i for i in ids if vectors[i] is not None]
    lost += len(ids) - len(have)
    if have:
        ref = embed([rows[i] for i in have])
        stale += int((cosines(np.stack([_vec(vectors[i]) for i in have]), ref) < 0.99999).sum())
    duplicated += sum(len(c) for k, c in chunks.items() if k not in rows)
    texts, vecs, owners = [], [], []
    chunk_lost = chunk_stale = 0
    for i in ids:
        want = split_text(rows[i], CHUNK_TOKENS, CHUNK_OVERLAP)
        got = chunks.get(i, [])
        if not got:
            chunk_lost += 1
            continue
        duplicated += max(0, len(got) - len(want))
        if [t for _, t, _ in got] != want or [n for n, _, _ in got] != list(range(len(got))):
            chunk_stale += 1
            continue
        texts += want
        vecs += [_vec(v) for _, _, v in got]
        owners += [i] * len(want)
    if texts:
        bad = cosines(np.stack(vecs), embed(texts)) < 0.99999
        chunk_stale += len({owners[j] for j in np.flatnonzero(bad)})
    return {"rows": len(rows), "chunks": sum(len(c) for c in chunks.values()),
            "lost": lost + chunk_lost, "stale": stale + chunk_stale, "duplicated": duplicated,
            "rows_lost_vector": lost, "rows_lost_chunks": chunk_lost,
            "rows_stale_vector": stale, "rows_stale_chunks": chunk_stale}


@dataclass
class FaultRecord:
    at_s: float
    what: str
    detail: str
    queue_depth_before: int
    action_s: float = 0.0  # how long the fault itself took (down time, restart to SERVING)
    online_errors_during: int = 0
    recovery_s: float | None = None


class Soak:
    """The running system and the faults done to it, driven from the main thread."""

    def __init__(self, args: argparse.Namespace, log_dir: Path) -> None:
        self.args, self.log_dir = args, log_dir
        self.clock = Clock()
        self.sidecars = [Sidecar("a", free_port(), log_dir), Sidecar("b", free_port(), log_dir)]
        self.target = ",".join(s.target for s in self.sidecars)
        self.faults: list[FaultRecord] = []
        self.online = OnlineStats()
        self.writer = WriterStats()
        self.stop_load = threading.Event()

    def fault(self, what: str) -> FaultRecord:
        depth = self.depth.max_since(self.clock.now() - 10)
        record = FaultRecord(round(self.clock.now(), 1), what, "", depth)
        errors_before = len(self.online.error_times)
        if what == "sidecar_sigkill":
            s = self.sidecars[0]
            s.signal(signal.SIGKILL)
            time.sleep(SIDECAR_DOWN_S)
            s.start()
            record.detail = f"sidecar {s.name} SIGKILLed, restarted on port {s.port} after {SIDECAR_DOWN_S:g} s"
        elif what == "sidecar_sigterm":
            s = self.sidecars[1]
            status = s.signal(signal.SIGTERM)
            s.start()
            record.detail = f"sidecar {s.name} SIGTERMed (exit {status}), restarted on port {s.port}"
        elif what == "worker_sigkill":
            self.cli_worker.kill()
            time.sleep(2.0)
            self.cli_worker.start()
            record.detail = "fern pg worker subprocess SIGKILLed, a new one started after 2 s"
        elif what == "postgres_restart":
            self.cpu_seconds()  # the old postmaster's CPU, before it goes
            self.pg.restart_after_crash()
            record.detail = "PostgreSQL crash-restarted (SIGQUIT, recovery, same port)"
        # Recovered: the queue back at or below its depth before the fault, and no online
        # error for 2 s; measured from the fault's start, until the next fault at the latest.
        record.action_s = round(self.clock.now() - record.at_s, 1)
        done_at = self.clock.now()
        limit = self.args.fault_every * 60 * 0.9
        while self.clock.now() - record.at_s < limit:
            at, depth = self.depth.samples[-1] if self.depth.samples else (0.0, None)
            quiet = not self.online.error_times or self.clock.now() - self.online.error_times[-1] > 2
            if at >= done_at and depth <= max(record.queue_depth_before, 1) and quiet:
                last_error = max([t for t in self.online.error_times if t >= record.at_s], default=0.0)
                record.recovery_s = round(max(at, last_error) - record.at_s, 1)
                break
            time.sleep(0.25)
        record.online_errors_during = len(self.online.error_times) - errors_before
        self.faults.append(record)
        print(f"[{self.clock.now():7.1f}s] fault {what}: {record.detail}; "
              f"recovered in {record.recovery_s} s", flush=True)
        return record

    def status_line(self) -> str:
        lat = self.online.latencies_ms[-3000:]
        p50 = f"{np.percentile(lat, 50):.1f}" if lat else "-"
        rss = " ".join(f"{n}={v[-1][2] / 1024:.0f}MiB" for n, v in self.rss.samples.items() if v)
        return (f"[{self.clock.now():7.1f}s] online {len(self.online.latencies_ms)} ok "
                f"{sum(self.online.errors.values())} err p50 {p50} ms | writer {self.writer.inserts} "
                f"ins {self.writer.text_updates} upd {self.writer.key_updates} key | queue "
                f"{self.depth.latest()} | rss {rss} | cpu {self.cpu_cores():.2f} cores | "
                f"faults {len(self.faults)}")

    def cpu_seconds(self) -> float:
        own = os.times()
        pg = cpu_seconds(self.pg.pid, children=True) if self.pg.pid else None
        if pg is not None:
            self.pg_cpu[self.pg.pid] = pg
        return (own.user + own.system + sum(self.rss.cpu.values()) + self.cli_worker.cpu()
                + sum(self.pg_cpu.values()))

    def cpu_cores(self) -> float:
        self.rss.sample()
        return (self.cpu_seconds() - self.cpu_at_start) / max(self.clock.now() - self.load_began, 1e-9)

    def run(self) -> dict:
        args = self.args
        with Postgres() as pg:
            self.pg, self.pg_cpu = pg, {}  # CPU seconds per postmaster pid (a restart is a new one)
            for s in self.sidecars:
                s.start()
            with psycopg.connect(pg.dsn, autocommit=True) as conn, FernClient(self.target) as fern:
                install(conn)
                conn.execute("CREATE TABLE items (id int PRIMARY KEY, body text)")
                create_vectorizer(conn, "items", ["body"], client=fern)
                create_vectorizer(conn, "items", ["body"], client=fern, target_column="chunked",
                                  chunking="split", chunk_tokens=CHUNK_TOKENS,
                                  chunk_overlap=CHUNK_OVERLAP)
            self.depth = DepthProbe(pg.dsn, self.clock)
            self.rss = RssProbe(self.sidecars, self.clock)
            self.cli_worker = CliWorker(pg.dsn, self.target, self.log_dir)
            workers = [ThreadWorker(Worker(WorkerConfig(
                dsn=pg.dsn, target=self.target, batch_size=args.batch_size, poll_interval=0.2,
                max_backoff=1.0))) for _ in range(2)]
            threads = [threading.Thread(target=f, daemon=True, name=n) for f, n in (
                (self.depth.run, "depth"), (self.rss.run, "rss"),
                *((w.run, f"worker-{i}") for i, w in enumerate(workers)),
                (lambda: online_load(self.target, args.online_interval, self.online, self.clock,
                                     self.stop_load), "online"),
                (lambda: batch_writer(pg.dsn, args.rows_per_second, self.writer, self.stop_load),
                 "writer"))]
            self.cli_worker.start()
            self.clock = Clock()
            self.depth.clock = self.rss.clock = self.clock
            self.load_began = 0.0
            self.cpu_at_start = 0.0
            self.rss.sample()
            self.cpu_at_start = self.cpu_seconds()
            for t in threads:
                t.start()
            duration = args.minutes * 60
            period = args.fault_every * 60
            next_fault, next_status, k = period / 3, 60.0, 0
            while self.clock.now() < duration:
                if self.clock.now() >= next_fault:
                    self.fault(self.args.faults[k % len(self.args.faults)])
                    k += 1
                    next_fault = period * (k + 1 / 3)
                if self.clock.now() >= next_status:
                    print(self.status_line(), flush=True)
                    next_status += 60
                time.sleep(0.2)
            load_s = self.clock.now()
            cores = self.cpu_cores()
            self.stop_load.set()
            threads[-1].join(30)
            threads[-2].join(30)
            drain_began = self.clock.now()
            with psycopg.connect(pg.dsn, autocommit=True) as conn:
                while conn.execute("SELECT EXISTS (SELECT 1 FROM fern.queue)").fetchone()[0]:
                    if self.clock.now() - drain_began > DRAIN_TIMEOUT_S:
                        break
                    time.sleep(0.5)
                left = conn.execute("SELECT count(*) FROM fern.queue").fetchone()[0]
                drain_s = self.clock.now() - drain_began
                print(f"[{self.clock.now():7.1f}s] drained in {drain_s:.1f} s ({left} left); auditing",
                      flush=True)
                for w in workers:
                    w.halt()
                self.cli_worker.kill()
                for t in threads[2:4]:
                    t.join(30)
                self.depth.stop.set()
                self.rss.stop.set()
                audit_began = time.monotonic()
                with FernClient(self.target) as fern:
                    figures = audit(conn, fern)
                audit_s = time.monotonic() - audit_began
            for w in workers:
                w.worker.close()
            for s in self.sidecars:
                if s.pid:
                    s.signal(signal.SIGTERM)
        lat = np.asarray(self.online.latencies_ms)
        return {
            "parameters": {"minutes": args.minutes, "fault_every_minutes": args.fault_every,
                           "faults": args.faults,
                           "rows_per_second": args.rows_per_second,
                           "online_interval_s": args.online_interval,
                           "worker_batch_size": args.batch_size, "sidecars": 2,
                           "workers": "2 in-process threads + 1 `fern pg worker` subprocess",
                           "vectorizers": f"embedding (one per row), chunked (split, "
                                          f"{CHUNK_TOKENS} tokens, overlap {CHUNK_OVERLAP})",
                           "text_words": "8-40", "device": "cpu, bundled model, OMP_NUM_THREADS=1"},
            "load_seconds": round(load_s, 1),
            "cpu_cores_mean_during_load": round(cores, 2),
            "drain": {"seconds": round(drain_s, 1), "left_in_queue": left},
            "audit": {**figures, "seconds": round(audit_s, 1)},
            "writer": asdict(self.writer),
            "workers": {"thread_reconnects": [w.reconnects for w in workers],
                        "thread_failures": [f for w in workers for f in w.failures],
                        "thread_rows_written": [w.worker.stats.rows_written for w in workers],
                        "thread_transient_errors": [w.worker.stats.transient_errors for w in workers]},
            "online": {"calls": int(lat.size + sum(self.online.errors.values())),
                       "ok": int(lat.size), "errors_by_code": dict(self.online.errors),
                       "p50_ms": round(float(np.percentile(lat, 50)), 2) if lat.size else None,
                       "p99_ms": round(float(np.percentile(lat, 99)), 2) if lat.size else None,
                       "max_ms": round(float(lat.max()), 2) if lat.size else None},
            "faults": [asdict(f) for f in self.faults],
            "rss": {s.name: rss_report(self.rss.samples[s.name]) for s in self.sidecars},
            "rss_samples": {n: v for n, v in self.rss.samples.items()},
        }


def _fault_list(value: str) -> list[str]:
    faults = [f.strip() for f in value.split(",") if f.strip()]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown or not faults:
        raise argparse.ArgumentTypeError(f"unknown fault {', '.join(unknown) or value!r}; "
                                         f"choose from {', '.join(FAULTS)}")
    return faults


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.soak", description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="how long the load runs")
    parser.add_argument("--fault-every", type=float, default=3.0, help="minutes between faults")
    parser.add_argument("--rows-per-second", type=float, default=20.0, help="the writer's insert rate")
    parser.add_argument("--online-interval", type=float, default=0.02,
                        help="seconds between online queries")
    parser.add_argument("--batch-size", type=int, default=32, help="the in-process workers' batch")
    parser.add_argument("--faults", type=_fault_list, default=list(FAULTS),
                        help=f"comma list of the faults to inject in turn (default all: {','.join(FAULTS)})")
    parser.add_argument("--out", type=Path, required=True, help="where the JSON goes")
    args = parser.parse_args(argv)
    header = result_header("tools.soak", argv if argv is not None else sys.argv[1:])
    log_dir = Path(tempfile.mkdtemp(prefix="fern-soak-"))
    print(f"soak: {args.minutes:g} min, a fault every {args.fault_every:g} min; logs in {log_dir}",
          flush=True)
    result = Soak(args, log_dir).run()
    a = result["audit"]
    missing = [f for f in args.faults if f not in {r["what"] for r in result["faults"]}]
    unrecovered = [r["what"] for r in result["faults"] if r["recovery_s"] is None]
    ok = (a["lost"], a["stale"], a["duplicated"]) == (0, 0, 0) and result["drain"]["left_in_queue"] == 0
    out = {**header, "what": "mixed online and batch load on two CPU sidecars and an embedded "
                             "PostgreSQL 18 with faults in turn; rows audited after the drain "
                             "(lost, stale, duplicated: goal 0), sidecar RSS over time (goal flat)",
           **result, "faults_not_injected": missing, "faults_not_recovered": unrecovered,
           "passed": ok}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"soak: rows {a['rows']} lost {a['lost']} stale {a['stale']} duplicated {a['duplicated']}; "
          f"online p50 {result['online']['p50_ms']} ms p99 {result['online']['p99_ms']} ms errors "
          f"{result['online']['errors_by_code']}; rss flat "
          f"{ {n: r.get('flat') for n, r in result['rss'].items()} }; wrote {args.out}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
