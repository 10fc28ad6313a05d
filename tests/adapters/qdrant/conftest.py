"""Fixtures for the Qdrant adapter tests: a Fern client on the shared sidecar, Qdrant local mode or a server."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import uuid
from collections.abc import Iterator

import pytest

from adapters.qdrant.client import FernQdrantClient
from sidecar.client import FernClient

@pytest.fixture
def fern(sidecar_target: str) -> Iterator[FernClient]:
    with FernClient(sidecar_target) as client:
        client.wait_ready()
        yield client


@pytest.fixture(params=["local", "server"])
def qdrant(request: pytest.FixtureRequest, fern: FernClient) -> Iterator[FernQdrantClient]:
    """A FernQdrantClient in local mode (:memory:), and against $QDRANT_URL when it is set."""
    if request.param == "local":
        client = FernQdrantClient(":memory:", fern=fern)
    else:
        url = os.environ.get("QDRANT_URL")
        if not url:
            pytest.skip("QDRANT_URL is not set: no Qdrant server to run against "
                        "(local mode runs the same adapter code)")
        client = FernQdrantClient(url=url, api_key=os.environ.get("QDRANT_API_KEY"), fern=fern)
    created_before = {c.name for c in client.get_collections().collections}
    yield client
    if request.param == "server":
        for c in client.get_collections().collections:
            if c.name not in created_before:
                client.delete_collection(c.name)
    client.close()


@pytest.fixture
def collection_name() -> str:
    """A unique name, so tests against a shared server cannot collide."""
    return f"fern-test-{uuid.uuid4().hex[:10]}"


class TcpRelay:
    """A loopback TCP relay in front of the sidecar; close() cuts every connection at once.

    It stands for a sidecar that goes away mid-ingest (crash, restart, network loss)
    without starting a second sidecar process.
    """

    def __init__(self, upstream: str):
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.target = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.sockets: list[socket.socket] = []
        self.lock = threading.Lock()
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            with self.lock:
                if self.closed:
                    client.close()
                    server.close()
                    return
                self.sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            return
        finally:
            for s in (src, dst):
                # The other direction's pump may have shut it already.
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with self.lock:
            self.closed = True
            sockets, self.sockets = self.sockets, []
        self.listener.close()
        for s in sockets:
            with contextlib.suppress(OSError):  # the peer may have closed it first
                s.shutdown(socket.SHUT_RDWR)
            s.close()


@pytest.fixture
def relay(sidecar_target: str) -> Iterator[TcpRelay]:
    r = TcpRelay(sidecar_target)
    yield r
    r.close()
