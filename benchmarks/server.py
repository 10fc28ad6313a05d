"""Starts `fern serve` in a subprocess for end-to-end gRPC benchmarks and times it to health SERVING."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServedSidecar:
    """A running `fern serve` subprocess."""

    target: str
    process: subprocess.Popen
    seconds_to_serving: float
    command: list[str]
    log_path: Path

    def stop(self) -> None:
        """Terminate the sidecar and wait for it (kill after 20 s)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def sidecar_available() -> str | None:
    """None when `fern serve` can be started here, else why not."""
    try:
        import sidecar.cli  # noqa: F401
        import sidecar.server  # noqa: F401
    except ImportError as exc:
        return f"the sidecar is not importable ({exc})"
    return None


def start_sidecar(model_dir: Path | None, *, device: str, extra: list[str] = (), log_dir: Path,
                  timeout: float = 240.0, name: str = "bench",
                  launcher: Sequence[str] = ("-m", "sidecar.cli")) -> ServedSidecar:
    """Run `python -m sidecar.cli serve` on a free port and wait until health says SERVING.

    `launcher`: what python runs before `serve` and its flags (tools.profiling.stand_in: the same
    server with a stand-in forward pass)."""
    from sidecar.client import FernClient

    port = free_port()
    command = [sys.executable, *launcher, "serve", "--host", "127.0.0.1", "--port", str(port),
               "--device", device, *extra]
    if model_dir is not None:
        command += ["--model", str(model_dir)]
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"sidecar-{name}.log"
    started = time.perf_counter()
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   env=dict(os.environ, PYTHONUNBUFFERED="1"))
    target = f"127.0.0.1:{port}"
    with FernClient(target) as client:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"fern serve exited with {process.returncode}; see {log_path}")
            if client.health(timeout=1.0):
                break
            if time.perf_counter() - started > timeout:
                process.kill()
                raise TimeoutError(f"fern serve was not SERVING after {timeout:.0f} s; see {log_path}")
            time.sleep(0.05)
    return ServedSidecar(target, process, time.perf_counter() - started, command, log_path)
