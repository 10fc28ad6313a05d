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

log = logging.getLogger(__name__)

DEFAULT_PORT = 8080
DEFAULT_GRACE_S = 30.0
# Idle keep-alive connections are kept this long: clients that call every few seconds reuse theirs.
KEEP_ALIVE_S = 30


class HttpServer:
    """`await HttpServer(gateway, host, port).start()`; `.url` once started (port 0 binds a free one).

    TLS: `ssl_certfile` + `ssl_keyfile` serve HTTPS; `ssl_ca_certs` with
    `require_client_cert` asks every client for a certificate signed by that CA (mutual TLS).
    `metrics` counts every answered request (give it to the MetricsServer to export it).
    """

    def __init__(self, gateway: Gateway, host: str = "127.0.0.1", port: int = DEFAULT_PORT, *,
                 authorized: Authorizer | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 grace: float = DEFAULT_GRACE_S, ssl_certfile: str | None = None, ssl_keyfile: str | None = None,
                 ssl_ca_certs: str | None = None, require_client_cert: bool = False,
                 metrics: HttpMetrics | None = None, limiter: AuthLimiter | None = None) -> None:
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
        self._config = uvicorn.Config(
            self.app, host=host, port=port, http="httptools", ws="none", lifespan="off", access_log=False,
            log_config=None, proxy_headers=False, server_header=False, timeout_keep_alive=KEEP_ALIVE_S,
            timeout_graceful_shutdown=grace, ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile,
            ssl_ca_certs=ssl_ca_certs, ssl_cert_reqs=ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_NONE)
        self._server = InLoopServer(self._config, "HTTP")

    @property
    def scheme(self) -> str:
        return "https" if self._config.ssl_certfile else "http"

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.bound_port}"

    async def start(self) -> None:
        """Bind and serve; OSError when the address cannot be bound."""
        await self._server.start()
        self.bound_port = self._server.port
        log.info("HTTP on %s", self.url)

    async def stop(self) -> None:
        """Drain: refuse new requests (503), answer those in flight, close connections and the listener."""
        self.app.begin_drain()
        if not await self.app.wait_idle(self.grace):
            log.warning("HTTP requests still running after %.1fs of drain; cancelling them", self.grace)
        await self._server.stop()
