"""The Postgres endpoint's listener: accepting, TLS, the startup handshake, authentication, limits and shutdown."""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import ipaddress
import logging
import secrets
import socket
import ssl
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sidecar.gateway import Gateway
from sidecar.pgwire.auth import (AuthenticationFailed, AuthLimits, FailedAuthLimiter,
                                 ScramExchange, ScramVerifier)
from sidecar.pgwire.framing import (ADMIN_SHUTDOWN, CANCEL_REQUEST, DEFAULT_MAX_MESSAGE_BYTES,
                                    GSSENC_REQUEST, INVALID_AUTHORIZATION, INVALID_PASSWORD,
                                    MAX_STARTUP_BYTES, PROTOCOL_VIOLATION, SSL_REQUEST,
                                    TOO_MANY_CONNECTIONS, ProtocolError, authentication,
                                    backend_key_data, cstring, error_response,
                                    negotiate_protocol_version, parameter_status, parse_startup,
                                    read_message, read_startup, ready_for_query)
from sidecar.pgwire.session import Session, check_client_encoding
from sidecar.unixsocket import UnixSocket, bind, remove

log = logging.getLogger("sidecar.pgwire")

SERVER_VERSION = "18.0 (Fern)"


@dataclass(frozen=True)
class PgWireLimits:
    """How much the endpoint gives a client, and for how long.

    `max_connections` counts authenticated sessions (53300 beyond); `max_unauthenticated`
    counts connections still in the startup handshake, refused at once beyond it.
    `startup_timeout_s` is PostgreSQL's authentication_timeout: from accept to the end of
    authentication, TLS handshake included. `idle_session_timeout_s` (0 = off, as in
    PostgreSQL) closes a session that sends nothing for that long; fern.embed reopens its
    dblink connection by itself. `max_message_bytes` caps one frontend message after
    authentication (startup-phase packets are capped at 10,000 bytes, as in PostgreSQL).
    """

    max_connections: int = 256
    max_unauthenticated: int = 64
    startup_timeout_s: float = 30.0
    idle_session_timeout_s: float = 0.0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    auth: AuthLimits = field(default_factory=AuthLimits)


class PgWireServer:
    """`await PgWireServer(gateway, "127.0.0.1", 5433, token).start()`; `.port` is the bound port.

    Off by default in the sidecar; `fern serve --pg-port N` starts it beside gRPC.
    `password` is the token, or several (each admits a client; `set_passwords` rotates). With
    `ssl_context`, an SSLRequest is answered 'S' and the connection upgraded to TLS (mutual
    TLS when the context requires client certificates); `require_tls=True` refuses
    plaintext startups with 28000. `auth_limiter.failures_total` / `.refusals_total` /
    `.refused_peers` are the failed-authentication counters.

    `socket_dir` (a `UnixSocket` whose path is a directory, giving the mode and group) also
    listens at DIR/.s.PGSQL.<port>, PostgreSQL's own name, so libpq's `host=DIR port=N` reaches
    it. libpq never asks for TLS on a Unix socket, so `require_tls` holds for TCP only there.
    """

    def __init__(self, gateway: Gateway, host: str = "127.0.0.1", port: int = 0,
                 password: str | Sequence[str] = "", *, max_connections: int | None = None,
                 max_message_bytes: int | None = None, limits: PgWireLimits | None = None,
                 ssl_context: ssl.SSLContext | None = None, require_tls: bool = False,
                 socket_dir: UnixSocket | None = None, certificate: Callable[[], str] | None = None) -> None:
        if require_tls and ssl_context is None:
            raise ValueError("the Postgres endpoint cannot require TLS without a certificate "
                             "(ssl_context)")
        limits = limits or PgWireLimits()
        if max_connections is not None:
            limits = dataclasses.replace(limits, max_connections=max_connections)
        if max_message_bytes is not None:
            limits = dataclasses.replace(limits, max_message_bytes=max_message_bytes)
        self.gateway = gateway
        self.host = host
        self.port = port
        self.limits = limits
        self.ssl_context = ssl_context
        self.certificate = certificate  # the served certificate's PEM now: TLS sessions offer SCRAM-SHA-256-PLUS
        self.require_tls = require_tls
        self.auth_limiter = FailedAuthLimiter(limits.auth)
        self._verifiers = ScramVerifier.for_passwords(
            [password] if isinstance(password, str) else list(password))
        self.socket_dir = socket_dir
        self.unix_socket: UnixSocket | None = None  # the socket file, once started
        self._server: asyncio.Server | None = None
        self._unix_server: asyncio.Server | None = None
        self._socket_inode: int | None = None
        self._sessions: dict[int, Session] = {}
        self._handlers: set[asyncio.Task] = set()
        self._unauthenticated = 0
        self._next_pid = 1
        self._draining = False

    def set_passwords(self, passwords: Sequence[str]) -> None:
        """Replace the accepted tokens (rotation): new logins need one of `passwords`;
        sessions already open go on."""
        self._verifiers = ScramVerifier.for_passwords(list(passwords))

    @property
    def max_connections(self) -> int:
        return self.limits.max_connections

    @property
    def max_message_bytes(self) -> int:
        return self.limits.max_message_bytes

    @property
    def unauthenticated(self) -> int:
        """Connections in the startup handshake now (a gauge)."""
        return self._unauthenticated

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port,
                                                  limit=1 << 16)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("Postgres endpoint listening on %s:%d (TLS %s)", self.host, self.port,
                 "required" if self.require_tls else "offered" if self.ssl_context else "off")
        if self.socket_dir is not None:
            spec = self.socket_dir.with_path(self.socket_dir.path / f".s.PGSQL.{self.port}")
            try:
                sock, self._socket_inode = bind(spec)
                self._unix_server = await asyncio.start_unix_server(self._handle, sock=sock, limit=1 << 16)
            except BaseException:
                self._server.close()
                remove(spec.path, self._socket_inode)
                raise
            self.unix_socket = spec
            log.info("Postgres endpoint listening on %s", spec.path)

    async def stop(self, grace: float = 5.0) -> None:
        """Stop listening, let queries in flight finish for `grace` seconds, then close all."""
        if self._server is None:
            return
        self._draining = True
        self._server.close()
        if self._unix_server is not None:
            self._unix_server.close()
            remove(self.unix_socket.path, self._socket_inode)
        busy = [s.task for s in self._sessions.values() if s.task is not None]
        log.info("Postgres endpoint draining: %d queries in flight get %.0f s", len(busy), grace)
        if busy:
            await asyncio.wait(busy, timeout=grace)
        for session in list(self._sessions.values()):
            if session.task is not None and not session.task.done():
                session.task.cancel()
            self._send(session.writer, error_response(
                ADMIN_SHUTDOWN, "terminating connection: the Fern sidecar is shutting down",
                severity="FATAL"))
            session.writer.close()
        for handler in list(self._handlers):
            handler.cancel()
        if self._handlers:
            await asyncio.wait(list(self._handlers), timeout=grace)
        await self._server.wait_closed()
        self._server = None
        if self._unix_server is not None:
            await self._unix_server.wait_closed()
            self._unix_server = None

    # ---- connection lifecycle ----

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handler = asyncio.current_task()
        self._handlers.add(handler)
        session: Session | None = None
        try:
            if self._unauthenticated >= self.limits.max_unauthenticated:
                raise ProtocolError(TOO_MANY_CONNECTIONS, "sorry, too many clients already "
                                    "(connections still authenticating)")
            self._unauthenticated += 1
            try:
                async with asyncio.timeout(self.limits.startup_timeout_s):
                    session, reader, writer = await self._startup(reader, writer)
            except TimeoutError:
                raise ProtocolError(PROTOCOL_VIOLATION, "canceling authentication due to "
                                    f"timeout ({self.limits.startup_timeout_s:g} s)") from None
            finally:
                self._unauthenticated -= 1
            if session is not None:
                await session.serve(reader)
        except ProtocolError as exc:
            self._send(writer, error_response(exc.sqlstate, exc.message, severity="FATAL"))
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            pass  # the client went away (or its TLS handshake failed); nothing to answer
        except asyncio.CancelledError:
            pass  # stop() ends the connection
        finally:
            if session is not None:
                self._sessions.pop(session.pid, None)
            self._handlers.discard(handler)
            writer.close()

    @staticmethod
    def _send(writer: asyncio.StreamWriter, data: bytes) -> None:
        if not writer.is_closing():
            writer.write(data)

    async def _startup(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                       ) -> tuple[Session | None, asyncio.StreamReader, asyncio.StreamWriter]:
        peer = _peer_of(writer)
        payload = await read_startup(reader)
        code, = struct.unpack("!I", payload[:4])
        encrypted = False
        refused: set[int] = set()
        while code in (SSL_REQUEST, GSSENC_REQUEST) and code not in refused:
            refused.add(code)
            if code == SSL_REQUEST and self.ssl_context is not None:
                writer.write(b"S")
                await writer.drain()
                # Bytes that came with the SSLRequest were sent in the clear; PostgreSQL
                # refuses them (CVE-2021-23214) rather than read them as if encrypted.
                if reader._buffer:  # noqa: SLF001 - asyncio has no public peek
                    raise ProtocolError(PROTOCOL_VIOLATION,
                                        "received unencrypted data after SSL request")
                await writer.start_tls(self.ssl_context)
                encrypted = True
                refused.add(GSSENC_REQUEST)  # one encryption at a time
            else:
                writer.write(b"N")
            payload = await read_startup(reader)
            code, = struct.unpack("!I", payload[:4])
        if code == CANCEL_REQUEST:
            self._cancel(payload)
            return None, reader, writer
        if code in (SSL_REQUEST, GSSENC_REQUEST):
            raise ProtocolError(PROTOCOL_VIOLATION, "duplicate encryption request")
        startup = parse_startup(payload)
        if startup.major != 3:
            raise ProtocolError(
                "0A000", f"unsupported frontend protocol {startup.major}.{startup.minor}: "
                         "server supports 3.0")
        if self.require_tls and not encrypted and not _is_local(writer):
            raise ProtocolError(INVALID_AUTHORIZATION, "Fern's SQL endpoint requires TLS: "
                                "connect with sslmode=require (or verify-full)")
        params = startup.parameters
        unknown = sorted(k for k in params if k.startswith("_pq_."))
        if startup.minor > 0 or unknown:
            writer.write(negotiate_protocol_version(0, unknown))
        if params.get("replication", "false").lower() not in ("false", "off", "no", "0"):
            raise ProtocolError("0A000", "Fern's SQL endpoint does not do replication")
        user = params.get("user", "")
        if not user:
            raise ProtocolError(INVALID_AUTHORIZATION, "no PostgreSQL user name specified in "
                                "startup packet")
        check_client_encoding(params.get("client_encoding", "UTF8"), ProtocolError)
        if len(self._sessions) >= self.max_connections:
            raise ProtocolError(TOO_MANY_CONNECTIONS, "sorry, too many clients already")
        refused_for = self.auth_limiter.refused_for(peer)
        if refused_for > 0:
            # Logged once, when the refusal starts (below): a flood must not flood the log.
            raise ProtocolError(INVALID_AUTHORIZATION,
                                f"too many failed authentication attempts from {peer}; "
                                f"refused for {refused_for:.0f} more seconds")

        await self._authenticate(user, peer, reader, writer)

        pid = self._next_pid
        self._next_pid += 1
        settings = {
            "server_version": SERVER_VERSION,
            "server_encoding": "UTF8",
            "client_encoding": "UTF8",
            "standard_conforming_strings": "on",
            "integer_datetimes": "on",
            "DateStyle": "ISO, MDY",
            "IntervalStyle": "postgres",
            "TimeZone": "UTC",
            "is_superuser": "off",
            "session_authorization": user,
            "application_name": params.get("application_name", ""),
            "default_transaction_read_only": "on",
            "in_hot_standby": "off",
        }
        session = Session(user, pid, secrets.randbits(32), settings, writer, self.gateway,
                          lambda: self._draining, self.max_message_bytes,
                          self.limits.idle_session_timeout_s)
        self._sessions[pid] = session
        out = [authentication(0)]
        out += [parameter_status(k, v) for k, v in settings.items()]
        out += [backend_key_data(pid, session.key), ready_for_query()]
        writer.write(b"".join(out))
        await writer.drain()
        return session, reader, writer

    async def _authenticate(self, user: str, peer: str, reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter) -> None:
        certificate = None
        if self.certificate is not None and writer.get_extra_info("ssl_object") is not None:
            certificate = self.certificate()
        mechanisms = (["SCRAM-SHA-256-PLUS"] if certificate else []) + ["SCRAM-SHA-256"]
        writer.write(authentication(10, b"".join(cstring(m) for m in mechanisms) + b"\0"))
        await writer.drain()
        tag, body = await read_message(reader, MAX_STARTUP_BYTES)
        if tag != b"p":
            raise ProtocolError(PROTOCOL_VIOLATION,
                                f"expected SASL response, got message type {tag!r}")
        mechanism, _, rest = body.partition(b"\0")
        chosen = mechanism.decode("utf-8", "replace")
        if chosen not in mechanisms or len(rest) < 4:
            raise ProtocolError(PROTOCOL_VIOLATION, "client selected an invalid SASL "
                                "authentication mechanism")
        # "y": the client could bind but believes this server cannot; with PLUS offered, that is
        # a downgrade by someone in the middle (RFC 5802 section 6), refused as PostgreSQL does.
        if certificate and chosen == "SCRAM-SHA-256" and rest[4:6] == b"y,":
            raise ProtocolError(PROTOCOL_VIOLATION, "SCRAM channel binding negotiation error")
        exchange = ScramExchange(self._verifiers, certificate=certificate if chosen.endswith("-PLUS") else None)
        size, = struct.unpack("!i", rest[:4])
        try:
            writer.write(authentication(11, exchange.server_first(rest[4:4 + max(size, 0)])))
            await writer.drain()
            tag, body = await read_message(reader, MAX_STARTUP_BYTES)
            if tag != b"p":
                raise ProtocolError(PROTOCOL_VIOLATION,
                                    f"expected SASL response, got message type {tag!r}")
            writer.write(authentication(12, exchange.server_final(body)))
        except AuthenticationFailed as exc:
            delay = self.auth_limiter.failed(peer)
            log.info("Postgres endpoint: authentication failed for user %r from %s: %s",
                     user, peer, exc)
            if self.auth_limiter.failures_of(peer) == self.limits.auth.refuse_after:
                log.warning("Postgres endpoint: refusing %s for %.0f s after %d failed "
                            "authentications", peer, self.limits.auth.refuse_s,
                            self.limits.auth.refuse_after)
            if delay:
                self.auth_limiter.held += 1
                try:
                    await asyncio.sleep(delay)  # the back-off: a guesser waits before each answer
                finally:
                    self.auth_limiter.held -= 1
            raise ProtocolError(INVALID_PASSWORD,
                                f'password authentication failed for user "{user}"') from None
        self.auth_limiter.succeeded(peer)

    def _cancel(self, payload: bytes) -> None:
        """CancelRequest: interrupt the matching session's query (silently ignore a bad key)."""
        if len(payload) < 12:
            return
        pid, key = struct.unpack("!II", payload[4:12])
        session = self._sessions.get(pid)
        if session is not None and hmac.compare_digest(struct.pack("!I", session.key),
                                                       struct.pack("!I", key)):
            if session.task is not None and not session.task.done():
                session.cancelled = True
                session.task.cancel()


def _is_local(writer: asyncio.StreamWriter) -> bool:
    """Whether the connection came through the Unix socket (its file's permissions admitted it)."""
    sock = writer.get_extra_info("socket")
    return sock is not None and sock.family == socket.AF_UNIX


def _peer_of(writer: asyncio.StreamWriter) -> str:
    """The client's IP address, the unit the failed-authentication limit counts (IPv4-mapped
    IPv6 addresses read as IPv4)."""
    name = writer.get_extra_info("peername")
    if not name or isinstance(name, str):  # a Unix socket's peer: a path, or none
        return "local"
    address = ipaddress.ip_address(name[0].split("%", 1)[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return str(address)
