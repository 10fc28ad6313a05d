"""Fixtures for the security suite: a throwaway CA (trustme) with server and client certificates, and a TCP relay that connects from another loopback address."""

from __future__ import annotations

import re
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

trustme = pytest.importorskip("trustme")

METRICS_URL = re.compile(r"^fern: metrics on (\S+)", re.M)


@dataclass(frozen=True)
class Pki:
    """PEM files: `ca` signed `server_cert`/`server_key` and `client_cert`/`client_key`; `other_ca` signed nothing here."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path


@pytest.fixture(scope="package")
def pki(tmp_path_factory) -> Pki:
    folder = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("fern-client@example.test")
    paths = {name: folder / f"{name}.pem" for name in Pki.__dataclass_fields__}
    ca.cert_pem.write_to_path(paths["ca"])
    other.cert_pem.write_to_path(paths["other_ca"])
    server.private_key_pem.write_to_path(paths["server_key"])
    server.cert_chain_pems[0].write_to_path(paths["server_cert"])
    for blob in server.cert_chain_pems[1:]:
        blob.write_to_path(paths["server_cert"], append=True)
    client.private_key_pem.write_to_path(paths["client_key"])
    client.cert_chain_pems[0].write_to_path(paths["client_cert"])
    return Pki(**paths)


def _metrics_url(process, timeout: float = 30.0) -> str:
    """The /metrics URL a started `fern serve` printed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if m := METRICS_URL.search(process.log()):
            return m.group(1)
        time.sleep(0.05)
    raise AssertionError(f"no metrics URL in the log:\n{process.log()}")


class SourceRelay:
    """Listens on 127.0.0.1 and relays each connection to `target` from `source_ip` (another loopback address)."""

    def __init__(self, target: str, source_ip: str = "127.0.0.2") -> None:
        host, port = target.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.source_ip = source_ip
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.target = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return  # closed
            up = socket.create_connection(self.upstream, source_address=(self.source_ip, 0))
            self._sockets += [down, up]
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass  # the other side closed: the relay ends with it
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # already shut

    def close(self) -> None:
        self.listener.close()
        for s in self._sockets:
            s.close()


@pytest.fixture(scope="package")
def metrics_url():
    """`metrics_url(process)`: the /metrics URL that `fern serve` printed."""
    return _metrics_url


@pytest.fixture
def relay():
    """`relay(target)`: a SourceRelay to `target` from 127.0.0.2, closed after the test."""
    made: list[SourceRelay] = []

    def make(target: str, source_ip: str = "127.0.0.2") -> SourceRelay:
        made.append(SourceRelay(target, source_ip))
        return made[-1]

    yield make
    for r in made:
        r.close()


@pytest.fixture(scope="package")
def fern_cli() -> list[str]:
    """The command that runs `fern` with this checkout's code."""
    return [sys.executable, "-m", "sidecar.cli"]


FLAG_TOKEN = "flag-token-0123456789abcdef"
FILE_TOKEN = "file-token-0123456789abcdef"
METRICS_TOKEN = "metrics-token-0123456789abcdef"


@dataclass
class TokenSidecar:
    """A `fern serve` with one --token, a --token-file (mode 600) and token-guarded metrics."""

    process: object
    token_file: Path
    flag_token: str = FLAG_TOKEN
    file_token: str = FILE_TOKEN
    metrics_token: str = METRICS_TOKEN

    @property
    def target(self) -> str:
        return self.process.target


@pytest.fixture(scope="package")
def token_sidecar(sidecar_process_class, tmp_path_factory):
    token_file = tmp_path_factory.mktemp("tokens") / "tokens"
    token_file.write_text(f"# the sidecar's tokens, one a line\n{FILE_TOKEN}\n")
    token_file.chmod(0o600)
    args = ["--token", FLAG_TOKEN, "--token-file", str(token_file), "--metrics-port", "0",
            "--metrics-token", METRICS_TOKEN]
    with sidecar_process_class(args) as process:
        yield TokenSidecar(process, token_file)
