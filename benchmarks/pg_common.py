"""Shared pieces of the adapter benchmarks: machine description and result file (also for Qdrant), sidecar, worker."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from benchmarks.server import ServedSidecar


def machine() -> dict[str, Any]:
    """CPU model, cores, load average at the start (the machine is shared), platform."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass  # not Linux: platform.processor() is what we have
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        gpu = None
    return {"cpu": cpu, "cores": os.cpu_count(), "gpu": gpu, "platform": platform.platform(),
            "python": platform.python_version(), "load_average": list(os.getloadavg())}


def start_sidecar(device: str) -> ServedSidecar:
    """`fern serve` in a subprocess (benchmarks/server.py); returns the ServedSidecar."""
    from benchmarks.server import start_sidecar as start

    return start(None, device=device, log_dir=Path(tempfile.mkdtemp(prefix="fern-pg-bench-")),
                 name="pg")


def start_worker(dsn: str, target: str, batch_size: int) -> subprocess.Popen:
    """`fern pg worker` in its own process, as it runs in production."""
    return subprocess.Popen([sys.executable, "-m", "sidecar.cli", "pg", "worker", "--dsn", dsn,
                             "--target", target, "--batch-size", str(batch_size),
                             "--progress", "off"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def write_result(name: str, argv: list[str] | None, result: dict[str, Any], out: Path) -> None:
    """Write `result` with the exact command, machine and date; print it."""
    args = argv if argv is not None else sys.argv[1:]
    full = {"benchmark": name,
            "command": f"python -m benchmarks.{name} " + " ".join(shlex.quote(a) for a in args),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(), **result}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(full, indent=2) + "\n")
    print(json.dumps(full, indent=2))
