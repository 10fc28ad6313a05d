"""An in-process Postgres endpoint around the real gateway (bundled model, CPU), and a raw-socket libpq stand-in for the tests that need to pick the client's address."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import socket
import struct
import threading
from collections.abc import Callable, Iterator

import pytest

from sidecar.gateway import Gateway
from sidecar.pgwire import PgWireServer
from sidecar.registry import ModelSource, Registry
from sidecar.scheduler import SchedulerConfig

TOKEN = "pgwire-security-secret"


class LoopThread:
    """An asyncio loop in a thread of its own, so blocking clients (psycopg, dblink via a
    real PostgreSQL, raw sockets) can talk to servers running on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


@pytest.fixture(scope="module")
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture(scope="module")
def gateway(loop_thread: LoopThread) -> Iterator[Gateway]:
    registry = Registry.load([ModelSource(None)], device="cpu",
                             scheduler_config=SchedulerConfig.for_device("cpu"),
                             tokenizer_workers=1)
    loop_thread.run(registry.start())
    yield Gateway(registry)
    loop_thread.run(registry.drain())
    registry.close()


@pytest.fixture
def endpoint(loop_thread: LoopThread, gateway: Gateway) -> Iterator[Callable[..., PgWireServer]]:
    """`endpoint(**kwargs)`: a started PgWireServer on 127.0.0.1 with TOKEN, stopped after the test."""
    started: list[PgWireServer] = []

    def start(**kwargs) -> PgWireServer:
        server = PgWireServer(gateway, "127.0.0.1", 0, TOKEN, **kwargs)
        loop_thread.run(server.start())
        started.append(server)
        return server

    yield start
    for server in started:
        loop_thread.run(server.stop(grace=1.0))


# ---- a raw client: enough of libpq to log in from a chosen source address ------------------


def startup_packet(params: dict[str, str], version: int = 3 << 16) -> bytes:
    body = struct.pack("!I", version) + b"".join(
        k.encode() + b"\0" + v.encode() + b"\0" for k, v in params.items()) + b"\0"
    return struct.pack("!I", len(body) + 4) + body


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed by the server")
        data += chunk
    return data


def read_message(sock: socket.socket) -> tuple[bytes, bytes]:
    header = recv_exactly(sock, 5)
    (length,) = struct.unpack("!I", header[1:])
    return header[:1], recv_exactly(sock, length - 4)


def fields(body: bytes) -> dict[str, str]:
    return {part[:1].decode(): part[1:].decode() for part in body.split(b"\0") if part}


def connect(port: int, source: str = "127.0.0.1", timeout: float = 30.0) -> socket.socket:
    """A TCP connection to the endpoint from `source` (any 127/8 address is loopback on Linux)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def login(sock: socket.socket, password: str) -> dict[str, str] | None:
    """SCRAM-SHA-256 (RFC 5802) as libpq does it, up to ReadyForQuery; returns None on
    success, else the ErrorResponse's fields (the server closes the connection after it)."""
    sock.sendall(startup_packet({"user": "fern", "database": "fern"}))
    tag, body = read_message(sock)
    if tag == b"E":
        return fields(body)
    assert tag == b"R" and struct.unpack("!I", body[:4])[0] == 10, (tag, body)
    client_nonce = base64.b64encode(b"0123456789abcdef0123").decode()
    first_bare = f"n=,r={client_nonce}"
    initial = (b"SCRAM-SHA-256\0" + struct.pack("!i", len(first_bare) + 3) + b"n,,"
               + first_bare.encode())
    sock.sendall(b"p" + struct.pack("!I", len(initial) + 4) + initial)
    tag, body = read_message(sock)
    if tag == b"E":
        return fields(body)
    server_first = body[4:].decode()
    attrs = dict(part.split("=", 1) for part in server_first.split(","))
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), base64.b64decode(attrs["s"]),
                                 int(attrs["i"]))
    client_key = hmac.digest(salted, b"Client Key", "sha256")
    without_proof = f"c=biws,r={attrs['r']}"
    auth = f"{first_bare},{server_first},{without_proof}".encode()
    signature = hmac.digest(hashlib.sha256(client_key).digest(), auth, "sha256")
    proof = base64.b64encode(bytes(a ^ b for a, b in zip(client_key, signature))).decode()
    final = f"{without_proof},p={proof}".encode()
    sock.sendall(b"p" + struct.pack("!I", len(final) + 4) + final)
    tag, body = read_message(sock)
    if tag == b"E":
        return fields(body)
    assert tag == b"R" and struct.unpack("!I", body[:4])[0] == 12
    while read_message(sock)[0] != b"Z":
        pass
    return None


def query(sock: socket.socket, sql: str) -> list[tuple[bytes, bytes]]:
    """One simple Query; the messages up to ReadyForQuery."""
    body = sql.encode() + b"\0"
    sock.sendall(b"Q" + struct.pack("!I", len(body) + 4) + body)
    out = []
    while True:
        tag, payload = read_message(sock)
        out.append((tag, payload))
        if tag == b"Z":
            return out


def closed_by_server(sock: socket.socket) -> bytes:
    """Read until the server closes; what it sent on the way (a FATAL ErrorResponse or nothing)."""
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk
