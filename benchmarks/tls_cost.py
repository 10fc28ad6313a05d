"""TLS's cost beside plaintext: connection set-up, a bare round trip, batch-1 latency and batch throughput, measured in the same run.

`python -m benchmarks.tls_cost [--device cpu] [--rounds 3] [--out FILE]` makes a throwaway
CA (trustme), starts two `fern serve` subprocesses with the same token, one plaintext and
one with `--tls-cert/--tls-key`, and alternates between them round by round, so both meet
the same machine load. Per round and server:
- connect: a new channel, its handshake and the first ListModels answer (what a client
  that reconnects pays);
- round trip: sequential ListModels calls (no model: gRPC, HTTP/2 and TLS alone);
- batch 1: sequential one-query Embeds (a search's path);
- throughput: `--threads` clients sending Embeds of `--batch` texts for `--seconds`.
The JSON gives per-server percentiles (the median of the rounds' p50s) and the TLS/plain ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from sidecar.cli import GRPC_EXPERIMENTS

os.environ.setdefault("GRPC_EXPERIMENTS", GRPC_EXPERIMENTS)  # as every `fern` process runs gRPC

from benchmarks.pg_common import write_result  # noqa: E402 - after the gRPC setting
from benchmarks.server import free_port  # noqa: E402
from benchmarks.stats import percentiles  # noqa: E402
from sidecar.client import FernClient  # noqa: E402

TOKEN = "bench-token-0123456789abcdef0123456789"
QUERY = "how do I rotate the sidecar's token without downtime?"
PASSAGE = ("Fern is a GPU embedding sidecar for vector databases; one process holds the gateway, "
           "the scheduler and the engine, and adapters call it inline with writes and searches.")


def _make_pki(folder: Path) -> dict[str, Path]:
    import trustme

    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    paths = {"ca": folder / "ca.pem", "cert": folder / "server.pem", "key": folder / "server.key"}
    ca.cert_pem.write_to_path(paths["ca"])
    server.private_key_pem.write_to_path(paths["key"])
    for i, blob in enumerate(server.cert_chain_pems):
        blob.write_to_path(paths["cert"], append=i > 0)
    return paths


class Served:
    """One `fern serve` subprocess and the FernClient arguments that reach it."""

    def __init__(self, name: str, device: str, extra: list[str], client: dict[str, Any], log_dir: Path) -> None:
        self.name = name
        self.target = f"127.0.0.1:{free_port()}"
        self.client = {"token": TOKEN, **client}
        self.command = [sys.executable, "-m", "sidecar.cli", "serve", "--host", "127.0.0.1",
                        "--port", self.target.rsplit(":", 1)[1], "--device", device, "--token", TOKEN, *extra]
        self.log_path = log_dir / f"sidecar-{name}.log"
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        with FernClient(self.target, **self.client) as client:
            while not client.health(timeout=1.0):
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name} sidecar did not come up; see {self.log_path}")
                time.sleep(0.1)
            client.embed([QUERY])  # the first step of each shape is not what is measured

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def negotiated(served: Served, key_file: Path) -> dict[str, Any]:
    """The TLS version and cipher the server picks for a Python client offering h2, as gRPC clients do."""
    import socket
    import ssl

    context = ssl.create_default_context(cafile=served.client["tls_ca"])
    context.set_alpn_protocols(["h2"])
    host, port = served.target.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as raw, \
            context.wrap_socket(raw, server_hostname=host) as tls:
        name, _, bits = tls.cipher()
        return {"version": tls.version(), "cipher": name, "bits": bits,
                "server_key": "EC P-256" if b"EC PRIVATE KEY" in key_file.read_bytes() else "other"}


def _timed(call, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        call()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def measure(served: Served, args: argparse.Namespace) -> dict[str, Any]:
    """One round against one sidecar."""
    connect = []
    for _ in range(args.connects):
        t = time.perf_counter()
        with FernClient(served.target, **served.client, timeout=30) as client:
            client.list_models()
        connect.append((time.perf_counter() - t) * 1e3)
    with FernClient(served.target, **served.client, timeout=60) as client:
        client.list_models()
        round_trip = _timed(client.list_models, args.round_trips)
        batch1 = _timed(lambda: client.embed([QUERY]), args.queries)
    texts = [PASSAGE] * args.batch
    counts = [0] * args.threads
    stop_at = time.perf_counter() + args.seconds

    def load(i: int) -> None:
        with FernClient(served.target, **served.client, timeout=120) as client:
            while time.perf_counter() < stop_at:
                client.embed(texts, lane="batch")
                counts[i] += len(texts)

    started = time.perf_counter()
    threads = [threading.Thread(target=load, args=(i,)) for i in range(args.threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"connect": percentiles(connect, digits=3), "round_trip": percentiles(round_trip, digits=3),
            "batch1": percentiles(batch1, digits=3),
            "texts_per_s": round(sum(counts) / (time.perf_counter() - started), 1)}


def _summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("connect", "round_trip", "batch1"):
        out[f"{key}_p50_ms"] = round(statistics.median(r[key]["p50_ms"] for r in rounds), 3)
        out[f"{key}_p99_ms"] = round(statistics.median(r[key]["p99_ms"] for r in rounds), 3)
    out["texts_per_s"] = round(statistics.median(r["texts_per_s"] for r in rounds), 1)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tls_cost", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--connects", type=int, default=20)
    parser.add_argument("--round-trips", type=int, default=300)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu/tls.json"))
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="fern-tls-bench-") as tmp:
        folder = Path(tmp)
        pki = _make_pki(folder)
        servers = [Served("plaintext", args.device, [], {}, folder),
                   Served("tls", args.device, ["--tls-cert", str(pki["cert"]), "--tls-key", str(pki["key"])],
                          {"tls_ca": str(pki["ca"])}, folder)]
        try:
            for served in servers:
                served.wait_ready()
            handshake = negotiated(servers[1], pki["key"])
            rounds: dict[str, list[dict[str, Any]]] = {s.name: [] for s in servers}
            for n in range(args.rounds):
                for served in servers if n % 2 == 0 else reversed(servers):  # alternate who goes first
                    rounds[served.name].append(measure(served, args))
        finally:
            for served in servers:
                served.stop()
    summary = {name: _summary(r) for name, r in rounds.items()}
    plain, tls = summary["plaintext"], summary["tls"]
    ratio = {k: round(tls[k] / plain[k], 3) for k in plain if plain[k]}
    extra = {k.replace("_p50_ms", "_p50_extra_ms"): round(tls[k] - plain[k], 3) for k in plain if k.endswith("_p50_ms")}
    write_result("tls_cost", argv, {
        "what": "the same `fern serve` (bundled MiniLM, --token) plaintext and with TLS (a trustme "
                "CA's certificate, through gRPC's own credentials), rounds interleaved",
        "tls_handshake": handshake,
        "settings": vars(args) | {"out": str(args.out)},
        "summary": summary, "tls_over_plaintext": ratio, "tls_extra": extra, "rounds": rounds,
    }, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
