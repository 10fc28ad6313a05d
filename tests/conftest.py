"""Shared fixtures: a real sidecar started by the real CLI (`fern serve`) in a subprocess, and its client."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from sidecar.client import FernClient

# "fern: serving all-MiniLM-L6-v2 on 127.0.0.1:40123 (cpu)" is what `fern serve` prints when up.
_SERVING = re.compile(r"^fern: serving .* on (\S+) \(")
_PG_ENDPOINT = re.compile(r"^fern: Postgres endpoint on (\S+):(\d+)")
_HTTP = re.compile(r"^fern: HTTP on (https?://\S+)")  # the TCP listener, not a socket file
START_TIMEOUT_S = 120.0


def fern_command() -> list[str]:
    """How to run the `fern` console script of this environment."""
    script = Path(sys.executable).with_name("fern")
    if script.exists():
        return [str(script)]
    found = shutil.which("fern")
    return [found] if found else [sys.executable, "-m", "sidecar.cli"]


class SidecarProcess:
    """`fern serve` in a subprocess on a free loopback port; `.target` once it is SERVING.

    Use as a context manager; leaving it sends SIGTERM (a graceful drain) and waits.
    `extra_args` are more `fern serve` flags (e.g. "--token", "s3cret", "--pg-port", "0").
    `client_kwargs` are FernClient arguments for the readiness check (e.g. tls_ca=...
    for a TLS sidecar); the token is taken from --token / --token-file when not given.
    """

    def __init__(self, extra_args: Sequence[str] = (), env: dict[str, str] | None = None,
                 client_kwargs: dict | None = None) -> None:
        self.client_kwargs = dict(client_kwargs or {})
        self.args = [*fern_command(), "serve", "--host", "127.0.0.1", "--port", "0",
                     "--device", "cpu", *extra_args]
        self.env = {**os.environ, "OMP_NUM_THREADS": "2", **(env or {})}
        self.log_path = Path(tempfile.mkstemp(prefix="fern-serve-", suffix=".log")[1])
        self.process: subprocess.Popen | None = None
        self.target = ""
        self.pg_port: int | None = None
        self.http_url = ""  # "http://127.0.0.1:PORT" when started with --http-port

    def start(self, timeout: float = START_TIMEOUT_S) -> "SidecarProcess":
        log = self.log_path.open("w")
        self.process = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT,
                                        env=self.env, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while not self.target:
            if self.process.poll() is not None:
                raise RuntimeError(f"`fern serve` exited with {self.process.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"`fern serve` did not come up in {timeout:g}s:\n{self.log()}")
            for line in self.log().splitlines():
                if m := _SERVING.match(line):
                    self.target = m.group(1)
                if m := _PG_ENDPOINT.match(line):
                    self.pg_port = int(m.group(2))
                if m := _HTTP.match(line):
                    self.http_url = m.group(1)
            time.sleep(0.05)
        with FernClient(self.target, **{"token": self._token(), **self.client_kwargs}) as client:
            client.wait_ready(timeout=30)
        return self

    def _token(self) -> str | None:
        if "--token" in self.args:
            return self.args[self.args.index("--token") + 1]
        if "--token-file" in self.args:
            from sidecar.security import read_token_file

            tokens = read_token_file(Path(self.args[self.args.index("--token-file") + 1]))
            return tokens[0] if tokens else None
        return None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM (graceful drain) and wait for the exit status."""
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else 0
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"`fern serve` did not exit {timeout:g}s after SIGTERM:\n{self.log()}")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> "SidecarProcess":
        return self.start()

    def stop(self) -> None:
        """Drain (SIGTERM), wait, and clean up; safe to call twice."""
        try:
            self.terminate()
        finally:
            self.kill()
            self.log_path.unlink(missing_ok=True)

    def __exit__(self, *exc) -> None:
        self.stop()


@pytest.fixture(scope="session")
def sidecar_process_class() -> type[SidecarProcess]:
    """The SidecarProcess class itself, for tests that start and stop their own `fern serve`."""
    return SidecarProcess


@pytest.fixture(scope="session")
def sidecar_process() -> Iterator[SidecarProcess]:
    """The session's shared sidecar: `fern serve` with the bundled model on CPU."""
    with SidecarProcess() as process:
        yield process


@pytest.fixture(scope="session")
def sidecar_target(sidecar_process: SidecarProcess) -> str:
    """"127.0.0.1:PORT" of the session's shared sidecar (health SERVING)."""
    return sidecar_process.target


@pytest.fixture
def client(sidecar_target: str) -> Iterator[FernClient]:
    """A FernClient connected to the shared sidecar."""
    with FernClient(sidecar_target, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def sidecar_factory() -> Iterator:
    """Start extra sidecars with their own flags: `sidecar_factory("--token", "t")` → SidecarProcess.

    Each is drained (SIGTERM) at the end of the session at the latest; call
    `process.stop()` to drain it earlier (module-scoped fixtures should).
    """
    started: list[SidecarProcess] = []

    def start(*extra_args: str, env: dict[str, str] | None = None,
              client_kwargs: dict | None = None) -> SidecarProcess:
        process = SidecarProcess(extra_args, env, client_kwargs)
        started.append(process)
        return process.start()

    yield start
    for process in started:
        process.stop()
