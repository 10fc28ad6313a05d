"""The HTTP door's server: uvicorn (httptools) serving the HttpApp on the sidecar's own event loop.

`HttpServer` is a start()/stop() extra of the gRPC `Sidecar`: it shares the sidecar's
Gateway and loop (through `InLoopServer`). `stop()` drains: new requests get 503, requests in flight are
answered, idle keep-alive connections close, then the listener closes.
"""

from __future__ import annotations

import logging
import ssl

import uvicorn

from sidecar.gateway import Gateway
from sidecar.http.app import Authorizer, HttpApp
from sidecar.http.body import DEFAULT_MAX_BODY_BYTES
from sidecar.inloop import InLoopServer
from sidecar.metrics import HttpMetrics
from sidecar.security import AuthLimiter
from sidecar.unixsocket import UnixSocket, bind, remove

log = logging.getLogger(__name__)

DEFAULT_PORT = 8080
DEFAULT_GRACE_S = 30.0
# Idle keep-alive connections are kept this long: clients that call every few seconds reuse theirs.
KEEP_ALIVE_S = 30


class HttpServer:
    """`await HttpServer(gateway, host, port).start()`; `.url` once started (port 0 binds a free one).

    TLS: `ssl_certfile` + `ssl_keyfile` serve HTTPS; `ssl_ca_certs` with
    `require_client_cert` asks every client for a certificate signed by that CA (mutual TLS).
    Or `ssl_context`, a server-side context built elsewhere (`fern serve` shares one among its
    doors, so a certificate reloaded on SIGHUP reaches them all).
    `metrics` counts every answered request (give it to the MetricsServer to export it).
    `uds` also serves on a socket file (plaintext: its mode and group decide who connects;
    tokens still apply); `port=None` with `uds` serves on no TCP port.
    """

    def __init__(self, gateway: Gateway, host: str = "127.0.0.1", port: int | None = DEFAULT_PORT, *,
                 authorized: Authorizer | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 grace: float = DEFAULT_GRACE_S, ssl_certfile: str | None = None, ssl_keyfile: str | None = None,
                 ssl_ca_certs: str | None = None, require_client_cert: bool = False,
                 metrics: HttpMetrics | None = None, limiter: AuthLimiter | None = None,
                 uds: UnixSocket | None = None, ssl_context: ssl.SSLContext | None = None) -> None:
        if port is None and uds is None:
            raise ValueError("the HTTP door needs a port or a Unix socket to listen on")
        if require_client_cert and not ssl_ca_certs:
            raise ValueError("require_client_cert needs ssl_ca_certs (the CA that signs client certificates)")
        if bool(ssl_certfile) != bool(ssl_keyfile):
            raise ValueError("TLS needs both a certificate and its key")
        self.metrics = metrics if metrics is not None else HttpMetrics()
        self.app = HttpApp(gateway, authorized=authorized, max_body_bytes=max_body_bytes,
                           observe=self.metrics.observe, limiter=limiter)
        self.host = host
        self.bound_port = port
        self.grace = grace
        self.uds = uds
        self._socket_inode: int | None = None
        # Both listeners have these settings; the socket file's has no TLS.
        self._listener_settings = dict(
            http="httptools", ws="none", lifespan="off", access_log=False, log_config=None, proxy_headers=False,
            server_header=False, timeout_keep_alive=KEEP_ALIVE_S, timeout_graceful_shutdown=grace)
        self._config = uvicorn.Config(
            self.app, host=host, port=port or 0, **self._listener_settings, ssl_certfile=ssl_certfile,
            ssl_keyfile=ssl_keyfile, ssl_ca_certs=ssl_ca_certs,
            ssl_cert_reqs=ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_NONE)
        self._ssl_context = ssl_context
        self._server = InLoopServer(self._config, "HTTP", ssl_context=ssl_context) if port is not None else None
        self._unix_server: InLoopServer | None = None
        self._unix_socket = None

    @property
    def scheme(self) -> str:
        return "https" if self._config.ssl_certfile or self._ssl_context is not None else "http"

    @property
    def url(self) -> str:
        """The TCP listener's URL; "" when there is none."""
        if self._server is None:
            return ""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.bound_port}"

    async def start(self) -> None:
        """Bind and serve; OSError when the address cannot be bound."""
        if self._server is not None:
            await self._server.start()
            self.bound_port = self._server.port
            log.info("HTTP on %s", self.url)
        if self.uds is not None:
            try:
                await self._start_unix(self.uds)
            except BaseException:
                if self._server is not None:
                    await self._server.stop()
                raise
            log.info("HTTP on unix:%s", self.uds.path)

    async def _start_unix(self, spec: UnixSocket) -> None:
        """uvicorn on a socket this door bound (its own `uds=` would make the file 0666), in plaintext."""
        sock, self._socket_inode = bind(spec)
        # uvicorn takes a listening socket by its descriptor (and duplicates it); this one is closed on stop.
        self._unix_socket = sock
        try:
            self._unix_server = InLoopServer(uvicorn.Config(
                self.app, fd=sock.fileno(), **self._listener_settings), "HTTP")
            await self._unix_server.start()
        except BaseException:
            self._unix_server = None
            sock.close()
            remove(spec.path, self._socket_inode)
            raise

    async def stop(self) -> None:
        """Drain: refuse new requests (503), answer those in flight, close connections and the listener."""
        self.app.begin_drain()
        if not await self.app.wait_idle(self.grace):
            log.warning("HTTP requests still running after %.1fs of drain; cancelling them", self.grace)
        if self._server is not None:
            await self._server.stop()
        if self._unix_server is not None:
            await self._unix_server.stop()
            self._unix_server = None
            self._unix_socket.close()
            remove(self.uds.path, self._socket_inode)
