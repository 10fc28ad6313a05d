"""uvicorn serving an ASGI app on the sidecar's own event loop, for the HTTP and metrics doors.

uvicorn's `Server.startup()` / `main_loop()` / `shutdown()` run in the loop that runs
grpc.aio; its `serve()` is not used because it would take over SIGTERM/SIGINT, which `fern
serve` handles itself.
"""

from __future__ import annotations

import asyncio
import logging
import ssl

import uvicorn


class InLoopServer:
    """`await InLoopServer(config, "HTTP").start()` binds and serves; `.port` is the bound port."""

    def __init__(self, config: uvicorn.Config, door: str, *, ssl_context: ssl.SSLContext | None = None) -> None:
        self.config, self.door, self.ssl_context = config, door, ssl_context
        self.port = config.port
        self._server: uvicorn.Server | None = None
        self._ticks: asyncio.Task | None = None

    async def start(self) -> None:
        """Bind and serve; OSError when the address cannot be bound."""
        # uvicorn logs its own start line at INFO; `fern serve` prints the URL itself.
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
        config = self.config
        if not config.loaded:
            config.load()
        if self.ssl_context is not None:
            config.ssl = self.ssl_context  # a context built by the sidecar (its client CA too), not files
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)  # startup() expects what serve() would set
        try:
            await server.startup()
        except SystemExit:  # uvicorn's answer to a failed bind (it has logged the OSError)
            raise OSError(f"could not bind {self.door} on {config.host}:{config.port} (port in use, or not "
                          "an address of this host?)") from None
        self._server = server
        self.port = server.servers[0].sockets[0].getsockname()[1]
        # uvicorn's tick: the Date header, once a second, and noticing should_exit.
        self._ticks = asyncio.ensure_future(server.main_loop())

    async def stop(self) -> None:
        """Close the listener and the connections (those mid-request get `timeout_graceful_shutdown`)."""
        server, self._server = self._server, None
        if server is None:
            return
        server.should_exit = True
        if self._ticks is not None:
            await self._ticks
        await server.shutdown()
