"""The sidecar's PostgreSQL-protocol endpoint: `SELECT embed('text')` over the wire, for dblink and libpq clients.

Why a Postgres endpoint: `dblink`, shipped with PostgreSQL and offered by managed
services, can call any server that speaks the Postgres protocol, so a plain SQL
function (`fern.embed`, adapters/postgres/embed_function.py) can reach the GPU with no
untrusted language. The endpoint answers the protocol's startup handshake, SCRAM-SHA-256
password authentication (the secret is the sidecar's token), CancelRequest, and the
simple and extended query protocols (parameters $1.. bound as text) for the grammar of
`sidecar.sqlliteral`; every embedding goes through
`Gateway.embed`, so SQL callers get the gRPC callers' validation, messages and
scheduler lanes. Vectors come back as pgvector text (`[0.1,-0.2,...]`) in a text
column, so `::vector` or dblink's `AS r(v vector)` reads them.

Not a library: the well-kept Python options (buenavista: a threaded socketserver proxy;
riffq: a Rust server with its own loop) do not run inside the sidecar's asyncio loop, and
what is needed here is a few messages. The framing helpers are pure functions; the server
holds the per-connection state machine.
"""
from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import logging
import secrets
import struct
import time
from dataclasses import dataclass, field

import grpc
import numpy as np

from sidecar import sqlliteral
from sidecar.errors import EmbedError
from sidecar.gateway import EmbedParams, Gateway
from sidecar.scheduler import Lane
from sidecar.sqlliteral import EmbedCall, EmptyQuery, SetCommand, ShowCommand, SqlError

log = logging.getLogger(__name__)

PROTOCOL_3_0 = 3 << 16
SSL_REQUEST = 80877103
GSSENC_REQUEST = 80877104
CANCEL_REQUEST = 80877102
MAX_STARTUP_BYTES = 10_000            # as PostgreSQL's MAX_STARTUP_PACKET_LENGTH
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20  # one query message; embed_many of many long texts fits
TEXT_OID = 25
INT4_OID = 23
SCRAM_ITERATIONS = 4096               # PostgreSQL's default scram_iterations
SERVER_VERSION = "18.0 (Fern)"

# SQLSTATEs (PostgreSQL's errcodes.txt) the endpoint sends besides the parser's.
INVALID_PASSWORD = "28P01"
INVALID_AUTHORIZATION = "28000"
PROTOCOL_VIOLATION = "08P01"
TOO_MANY_CONNECTIONS = "53300"
PROGRAM_LIMIT_EXCEEDED = "54000"
QUERY_CANCELED = "57014"
ADMIN_SHUTDOWN = "57P01"
CANNOT_CONNECT_NOW = "57P03"
INTERNAL_ERROR = "XX000"

# How a gateway error reads to a SQL caller. UNAVAILABLE means draining (57P03,
# cannot_connect_now); RESOURCE_EXHAUSTED a full queue (53400, configuration_limit_exceeded).
SQLSTATE_OF_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: "22023",
    grpc.StatusCode.NOT_FOUND: "42704",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "53400",
    grpc.StatusCode.UNAVAILABLE: CANNOT_CONNECT_NOW,
    grpc.StatusCode.DEADLINE_EXCEEDED: QUERY_CANCELED,
    grpc.StatusCode.CANCELLED: QUERY_CANCELED,
}


class ProtocolError(Exception):
    """The client broke the protocol; the connection ends with a FATAL error."""

    def __init__(self, sqlstate: str, message: str) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate
        self.message = message


# ---- framing: pure functions from values to backend messages ----------------------------


def cstring(text: str) -> bytes:
    return text.encode() + b"\0"


def message(tag: bytes, payload: bytes = b"") -> bytes:
    """One backend message: a type byte, an int32 length that counts itself, the payload."""
    return tag + struct.pack("!I", len(payload) + 4) + payload


def authentication(code: int, data: bytes = b"") -> bytes:
    return message(b"R", struct.pack("!I", code) + data)


def parameter_status(name: str, value: str) -> bytes:
    return message(b"S", cstring(name) + cstring(value))


def backend_key_data(pid: int, key: int) -> bytes:
    return message(b"K", struct.pack("!II", pid, key))


def ready_for_query(status: bytes = b"I") -> bytes:
    return message(b"Z", status)


def command_complete(tag: str) -> bytes:
    return message(b"C", cstring(tag))


def empty_query_response() -> bytes:
    return message(b"I")


def row_description(columns: list[tuple[str, int]], binary: tuple[bool, ...] = ()) -> bytes:
    """Columns as (name, type oid), each in text format unless `binary` says otherwise."""
    body = struct.pack("!H", len(columns))
    for i, (name, oid) in enumerate(columns):
        size = 4 if oid == INT4_OID else -1
        fmt = 1 if i < len(binary) and binary[i] else 0
        body += cstring(name) + struct.pack("!IhIhih", 0, 0, oid, size, -1, fmt)
    return message(b"T", body)


def data_row(values: list[str | bytes | None]) -> bytes:
    parts = [struct.pack("!H", len(values))]
    for value in values:
        if value is None:
            parts.append(struct.pack("!i", -1))
        else:
            raw = value.encode() if isinstance(value, str) else value
            parts.append(struct.pack("!i", len(raw)) + raw)
    return message(b"D", b"".join(parts))


def error_response(sqlstate: str, text: str, *, severity: str = "ERROR",
                   position: int | None = None, hint: str | None = None,
                   detail: str | None = None) -> bytes:
    fields = [(b"S", severity), (b"V", severity), (b"C", sqlstate), (b"M", text)]
    if detail:
        fields.append((b"D", detail))
    if hint:
        fields.append((b"H", hint))
    if position is not None:
        fields.append((b"P", str(position)))
    body = b"".join(tag + cstring(value) for tag, value in fields) + b"\0"
    return message(b"E", body)


def negotiate_protocol_version(minor: int, unknown_options: list[str]) -> bytes:
    body = struct.pack("!II", minor, len(unknown_options))
    return message(b"v", body + b"".join(cstring(o) for o in unknown_options))


def vector_text(row: np.ndarray) -> str:
    """pgvector's text form; 9 significant digits give back every float32 exactly."""
    return "[" + ",".join(map("{:.9g}".format, row.tolist())) + "]"


@dataclass(frozen=True)
class StartupPacket:
    """The startup message (after the length): protocol version and the key/value parameters."""

    major: int
    minor: int
    parameters: dict[str, str]


def parse_startup(payload: bytes) -> StartupPacket:
    """Decode a protocol-3 startup packet body; raises ProtocolError when malformed."""
    if len(payload) < 4:
        raise ProtocolError(PROTOCOL_VIOLATION, "invalid startup packet layout")
    version, = struct.unpack("!I", payload[:4])
    rest = payload[4:]
    # Each name and value ends with NUL; one more NUL ends the list.
    if not rest.endswith(b"\0") or (len(rest) > 1 and not rest.endswith(b"\0\0")):
        raise ProtocolError(PROTOCOL_VIOLATION,
                            "invalid startup packet layout: expected terminator as last byte")
    items = rest[:-1].split(b"\0")[:-1]
    if len(items) % 2:
        raise ProtocolError(PROTOCOL_VIOLATION, "invalid startup packet layout")
    try:
        decoded = [item.decode() for item in items]
    except UnicodeDecodeError:
        raise ProtocolError(PROTOCOL_VIOLATION, "startup packet is not UTF-8") from None
    return StartupPacket(version >> 16, version & 0xFFFF, dict(zip(decoded[::2], decoded[1::2])))


# ---- SCRAM-SHA-256 (RFC 5802 / RFC 7677), the server side --------------------------------


@dataclass(frozen=True)
class ScramVerifier:
    """What a server keeps of a password: salt, iteration count, StoredKey and ServerKey."""

    salt: bytes
    iterations: int
    stored_key: bytes
    server_key: bytes

    @classmethod
    def from_password(cls, password: str, *, salt: bytes | None = None,
                      iterations: int = SCRAM_ITERATIONS) -> ScramVerifier:
        salt = salt if salt is not None else secrets.token_bytes(16)
        salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
        client_key = hmac.digest(salted, b"Client Key", "sha256")
        return cls(salt, iterations, hashlib.sha256(client_key).digest(),
                   hmac.digest(salted, b"Server Key", "sha256"))


class AuthenticationFailed(Exception):
    """The client's proof does not match the secret (or the exchange is malformed)."""


def _scram_attributes(text: str) -> dict[str, str]:
    attrs = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or len(key) != 1:
            raise AuthenticationFailed(f"malformed SCRAM attribute {part!r}")
        attrs[key] = value
    return attrs


class ScramExchange:
    """One server-side exchange: client-first -> server-first, client-final -> server-final."""

    mechanism = "SCRAM-SHA-256"

    def __init__(self, verifier: ScramVerifier, nonce: str | None = None) -> None:
        self.verifier = verifier
        self.server_nonce = nonce or base64.b64encode(secrets.token_bytes(18)).decode()
        self._client_first_bare = ""
        self._server_first = ""
        self._gs2_header = ""
        self._nonce = ""

    def server_first(self, client_first: bytes) -> bytes:
        text = client_first.decode("utf-8", "replace")
        cbind, _, rest = text.partition(",")
        authzid, _, bare = rest.partition(",")
        if cbind not in ("n", "y"):
            raise AuthenticationFailed("channel binding is not offered by this server")
        if authzid:
            raise AuthenticationFailed("SCRAM authorization identities are not supported")
        attrs = _scram_attributes(bare)
        if "r" not in attrs or not attrs["r"]:
            raise AuthenticationFailed("SCRAM client-first message has no nonce")
        self._gs2_header = f"{cbind},,"
        self._client_first_bare = bare
        self._nonce = attrs["r"] + self.server_nonce
        salt = base64.b64encode(self.verifier.salt).decode()
        self._server_first = f"r={self._nonce},s={salt},i={self.verifier.iterations}"
        return self._server_first.encode()

    def server_final(self, client_final: bytes) -> bytes:
        text = client_final.decode("utf-8", "replace")
        without_proof, sep, proof_part = text.rpartition(",p=")
        if not sep:
            raise AuthenticationFailed("SCRAM client-final message has no proof")
        attrs = _scram_attributes(without_proof)
        if attrs.get("c") != base64.b64encode(self._gs2_header.encode()).decode():
            raise AuthenticationFailed("SCRAM channel-binding data does not match")
        if attrs.get("r") != self._nonce:
            raise AuthenticationFailed("SCRAM nonce does not match")
        try:
            proof = base64.b64decode(proof_part, validate=True)
        except ValueError:
            raise AuthenticationFailed("SCRAM proof is not base64") from None
        auth_message = ",".join((self._client_first_bare, self._server_first, without_proof)).encode()
        signature = hmac.digest(self.verifier.stored_key, auth_message, "sha256")
        if len(proof) != len(signature):
            raise AuthenticationFailed("SCRAM proof has the wrong length")
        client_key = bytes(a ^ b for a, b in zip(proof, signature))
        if not hmac.compare_digest(hashlib.sha256(client_key).digest(), self.verifier.stored_key):
            raise AuthenticationFailed("wrong password")
        server_signature = hmac.digest(self.verifier.server_key, auth_message, "sha256")
        return b"v=" + base64.b64encode(server_signature)


# ---- the server ---------------------------------------------------------------------------


def _check_client_encoding(encoding: str, error: type[ProtocolError] | type[SqlError]) -> None:
    """Refuse a client_encoding other than UTF8 (any spelling), with `error`: FATAL at
    startup (ProtocolError), a plain ERROR for SET (SqlError)."""
    if encoding.replace("-", "").replace("_", "").upper() not in ("UTF8", "UNICODE", "SQLASCII"):
        raise error("22023", f'invalid value for parameter "client_encoding": "{encoding}" '
                    "(Fern speaks UTF8)")


@dataclass
class _Session:
    """Per-connection state."""

    user: str
    pid: int
    key: int
    settings: dict[str, str]
    writer: asyncio.StreamWriter
    task: asyncio.Task | None = None     # the query being answered, for CancelRequest
    cancelled: bool = False
    timeout_ms: int = 0                  # SET statement_timeout: a deadline for each query
    statements: dict[str, "_Prepared"] = field(default_factory=dict)   # extended protocol
    portals: dict[str, "_Portal"] = field(default_factory=dict)

    @property
    def standard_conforming_strings(self) -> bool:
        """How the session's SQL reads backslashes in '...' (SET standard_conforming_strings)."""
        return self.settings["standard_conforming_strings"] == "on"


class PgWireServer:
    """`await PgWireServer(gateway, "127.0.0.1", 5433, token).start()`; `.port` is the bound port.

    Off by default in the sidecar; `fern serve --pg-port N` starts it beside gRPC.
    """

    def __init__(self, gateway: Gateway, host: str = "127.0.0.1", port: int = 0,
                 password: str = "", *, max_connections: int = 256,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        if not password:
            raise ValueError("the Postgres endpoint needs a password (the sidecar's token); "
                             "it never accepts unauthenticated connections")
        self.gateway = gateway
        self.host = host
        self.port = port
        self.max_connections = max_connections
        self.max_message_bytes = max_message_bytes
        self._verifier = ScramVerifier.from_password(password)
        self._server: asyncio.Server | None = None
        self._sessions: dict[int, _Session] = {}
        self._handlers: set[asyncio.Task] = set()
        self._next_pid = 1
        self._draining = False

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port,
                                                  limit=1 << 16)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("Postgres endpoint listening on %s:%d", self.host, self.port)

    async def stop(self, grace: float = 5.0) -> None:
        """Stop listening, let queries in flight finish for `grace` seconds, then close all."""
        if self._server is None:
            return
        self._draining = True
        self._server.close()
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

    # ---- connection lifecycle ----

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handler = asyncio.current_task()
        self._handlers.add(handler)
        session: _Session | None = None
        try:
            session = await self._startup(reader, writer)
            if session is not None:
                await self._serve(session, reader)
        except ProtocolError as exc:
            self._send(writer, error_response(exc.sqlstate, exc.message, severity="FATAL"))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away; nothing to answer
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

    async def _read_startup(self, reader: asyncio.StreamReader) -> bytes:
        length, = struct.unpack("!I", await reader.readexactly(4))
        if length < 8 or length > MAX_STARTUP_BYTES:
            raise ProtocolError(PROTOCOL_VIOLATION, "invalid length of startup packet")
        return await reader.readexactly(length - 4)

    async def _startup(self, reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter) -> _Session | None:
        payload = await self._read_startup(reader)
        code, = struct.unpack("!I", payload[:4])
        # The sidecar's listeners are plaintext (loopback by default): encryption requests
        # get 'N', and libpq's default sslmode=prefer goes on in the clear.
        refused: set[int] = set()
        while code in (SSL_REQUEST, GSSENC_REQUEST) and code not in refused:
            refused.add(code)
            writer.write(b"N")
            payload = await self._read_startup(reader)
            code, = struct.unpack("!I", payload[:4])
        if code == CANCEL_REQUEST:
            self._cancel(payload)
            return None
        if code in (SSL_REQUEST, GSSENC_REQUEST):
            raise ProtocolError(PROTOCOL_VIOLATION, "duplicate encryption request")
        startup = parse_startup(payload)
        if startup.major != 3:
            raise ProtocolError(
                "0A000", f"unsupported frontend protocol {startup.major}.{startup.minor}: "
                         "server supports 3.0")
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
        _check_client_encoding(params.get("client_encoding", "UTF8"), ProtocolError)
        if len(self._sessions) >= self.max_connections:
            raise ProtocolError(TOO_MANY_CONNECTIONS, "sorry, too many clients already")

        await self._authenticate(user, reader, writer)

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
        session = _Session(user, pid, secrets.randbits(32), settings, writer)
        self._sessions[pid] = session
        out = [authentication(0)]
        out += [parameter_status(k, v) for k, v in settings.items()]
        out += [backend_key_data(pid, session.key), ready_for_query()]
        writer.write(b"".join(out))
        await writer.drain()
        return session

    async def _authenticate(self, user: str, reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter) -> None:
        failed = ProtocolError(INVALID_PASSWORD, f'password authentication failed for user "{user}"')
        exchange = ScramExchange(self._verifier)
        writer.write(authentication(10, cstring(exchange.mechanism) + b"\0"))
        await writer.drain()
        tag, body = await self._read_message(reader, MAX_STARTUP_BYTES)
        if tag != b"p":
            raise ProtocolError(PROTOCOL_VIOLATION,
                                f"expected SASL response, got message type {tag!r}")
        mechanism, _, rest = body.partition(b"\0")
        if mechanism.decode("utf-8", "replace") != exchange.mechanism or len(rest) < 4:
            raise ProtocolError(PROTOCOL_VIOLATION, "client selected an invalid SASL "
                                "authentication mechanism")
        size, = struct.unpack("!i", rest[:4])
        try:
            writer.write(authentication(11, exchange.server_first(rest[4:4 + max(size, 0)])))
            await writer.drain()
            tag, body = await self._read_message(reader, MAX_STARTUP_BYTES)
            if tag != b"p":
                raise ProtocolError(PROTOCOL_VIOLATION,
                                    f"expected SASL response, got message type {tag!r}")
            writer.write(authentication(12, exchange.server_final(body)))
        except AuthenticationFailed as exc:
            log.info("Postgres endpoint: authentication failed for user %r: %s", user, exc)
            raise failed from None

    async def _read_message(self, reader: asyncio.StreamReader, limit: int) -> tuple[bytes, bytes]:
        header = await reader.readexactly(5)
        tag, length = header[:1], struct.unpack("!I", header[1:])[0]
        if length < 4:
            raise ProtocolError(PROTOCOL_VIOLATION, f"invalid message length {length}")
        if length - 4 > limit:
            raise ProtocolError(PROGRAM_LIMIT_EXCEEDED,
                                f"message of {length - 4} bytes exceeds Fern's limit of {limit}")
        return tag, await reader.readexactly(length - 4)

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

    # ---- queries ----

    async def _serve(self, session: _Session, reader: asyncio.StreamReader) -> None:
        writer = session.writer
        skipping_to_sync = False
        while True:
            tag, body = await self._read_message(reader, self.max_message_bytes)
            if tag == b"X":
                return
            if tag == b"Q":
                writer.write(await self._answer(session, self._simple_query, body)
                             + ready_for_query())
            elif tag == b"S":
                skipping_to_sync = False
                session.portals.pop("", None)
                writer.write(ready_for_query())
            elif tag in _EXTENDED:
                # After an error, the rest of an extended-query batch is skipped up to Sync.
                if not skipping_to_sync:
                    out = await self._answer(session, getattr(self, _EXTENDED[tag]), body)
                    skipping_to_sync = out[:1] == b"E"
                    writer.write(out)
            elif tag == b"F":
                writer.write(error_response(sqlliteral.FEATURE_NOT_SUPPORTED,
                                            "function calls are not supported") + ready_for_query())
            elif tag in (b"d", b"c", b"f"):
                pass  # COPY messages outside COPY are ignored, per the protocol
            else:
                raise ProtocolError(PROTOCOL_VIOLATION, f"invalid frontend message type {tag!r}")
            await writer.drain()

    async def _answer(self, session: _Session, handler, body: bytes) -> bytes:
        """Run one message's handler; a refusal becomes an ErrorResponse and the session goes on."""
        try:
            return await handler(session, body)
        except SqlError as exc:
            return error_response(exc.sqlstate, exc.message, position=exc.position, hint=exc.hint)
        except EmbedError as exc:
            return error_response(SQLSTATE_OF_CODE.get(exc.code, INTERNAL_ERROR), exc.message)
        except ProtocolError:
            raise
        except Exception as exc:  # a bug here must not end the session; the client and the log see it
            log.exception("Postgres endpoint: query failed")
            return error_response(INTERNAL_ERROR, f"internal error in Fern's SQL endpoint: "
                                  f"{type(exc).__name__}: {exc}")

    def _parse_sql(self, session: _Session, sql: str,
                   params: list[str | None] | None = None) -> sqlliteral.Statement:
        return sqlliteral.parse(sql, standard_conforming_strings=session.standard_conforming_strings,
                                params=params)

    async def _simple_query(self, session: _Session, body: bytes) -> bytes:
        sql = _message_string(body)
        return await self._run(session, self._parse_sql(session, sql), describe=True)

    async def _parse(self, session: _Session, body: bytes) -> bytes:
        """Parse: name, query, parameter types -> ParseComplete."""
        cursor = _Cursor(body)
        name, sql = cursor.string(), cursor.string()
        types = [cursor.int32() for _ in range(cursor.int16())]
        if name and name in session.statements:
            raise SqlError("42P05", f'prepared statement "{name}" already exists')
        count = sqlliteral.count_params(
            sql, standard_conforming_strings=session.standard_conforming_strings)
        session.statements[name] = _Prepared(sql, max(count, len(types)))
        return message(b"1")

    async def _bind(self, session: _Session, body: bytes) -> bytes:
        """Bind: portal, statement, parameter values (text or binary text) -> BindComplete."""
        cursor = _Cursor(body)
        portal, name = cursor.string(), cursor.string()
        formats = [cursor.int16() for _ in range(cursor.int16())]
        values = [cursor.bytes(cursor.int32()) for _ in range(cursor.int16())]
        result_formats = [cursor.int16() for _ in range(cursor.int16())]
        prepared = session.statements.get(name)
        if prepared is None:
            raise SqlError("26000", f'prepared statement "{name}" does not exist')
        if len(values) != prepared.params:
            raise SqlError(PROTOCOL_VIOLATION, f"bind message supplies {len(values)} parameters, "
                           f"but prepared statement \"{name}\" requires {prepared.params}")
        if len(formats) not in (0, 1, len(values)) or any(f not in (0, 1) for f in formats):
            raise SqlError(PROTOCOL_VIOLATION, "bind message has invalid parameter format codes")
        # A text parameter's binary form is its UTF-8 bytes too, so both formats read alike.
        params = [None if v is None else _utf8(v, f" (parameter ${i + 1})")
                  for i, v in enumerate(values)]
        stmt = self._parse_sql(session, prepared.sql, params)
        columns = _columns(stmt)
        binary = _result_binary(result_formats, len(columns))
        session.portals[portal] = _Portal(stmt, binary)
        return message(b"2")

    async def _describe(self, session: _Session, body: bytes) -> bytes:
        cursor = _Cursor(body)
        kind, name = cursor.bytes(1), cursor.string()
        if kind == b"S":
            prepared = session.statements.get(name)
            if prepared is None:
                raise SqlError("26000", f'prepared statement "{name}" does not exist')
            stmt = self._parse_sql(session, prepared.sql, [""] * prepared.params)
            params = message(b"t", struct.pack("!H", prepared.params)
                             + struct.pack("!I", TEXT_OID) * prepared.params)
            columns = _columns(stmt)
            return params + (row_description(columns) if columns else message(b"n"))
        portal = session.portals.get(name)
        if portal is None:
            raise SqlError("34000", f'portal "{name}" does not exist')
        columns = _columns(portal.stmt)
        return row_description(columns, portal.binary) if columns else message(b"n")

    async def _execute(self, session: _Session, body: bytes) -> bytes:
        cursor = _Cursor(body)
        name = cursor.string()
        portal = session.portals.get(name)
        if portal is None:
            raise SqlError("34000", f'portal "{name}" does not exist')
        return await self._run(session, portal.stmt, describe=False, binary=portal.binary)

    async def _close(self, session: _Session, body: bytes) -> bytes:
        cursor = _Cursor(body)
        kind, name = cursor.bytes(1), cursor.string()
        (session.statements if kind == b"S" else session.portals).pop(name, None)
        return message(b"3")

    async def _flush(self, session: _Session, body: bytes) -> bytes:
        return b""

    async def _run(self, session: _Session, stmt: sqlliteral.Statement, *, describe: bool,
                   binary: tuple[bool, ...] = ()) -> bytes:
        """A statement's answer: [RowDescription] DataRow* CommandComplete (or its equivalent)."""
        if isinstance(stmt, EmptyQuery):
            return empty_query_response()
        if isinstance(stmt, SetCommand):
            return self._set(session, stmt)
        if isinstance(stmt, ShowCommand):
            rows, tag = [[self._show(session, stmt)]], "SHOW"
        else:
            rows = await self._embed_in_task(session, stmt)
            tag = f"SELECT {len(rows)}"
        columns = _columns(stmt)
        out = [row_description(columns, binary)] if describe else []
        out += [data_row(_encode_row(row, columns, binary)) for row in rows]
        out.append(command_complete(tag))
        return b"".join(out)

    def _set(self, session: _Session, stmt: SetCommand) -> bytes:
        name = stmt.name.lower()
        tag = command_complete("RESET" if stmt.reset else "SET")
        if name == "client_encoding":
            _check_client_encoding(stmt.value or "UTF8", SqlError)
            return tag
        if name == "standard_conforming_strings":
            value = (stmt.value or "on").lower()
            if value in ("on", "true", "yes", "1"):
                value = "on"
            elif value in ("off", "false", "no", "0"):
                value = "off"
            else:
                raise SqlError("22023", 'parameter "standard_conforming_strings" requires a '
                               f'Boolean value, not "{stmt.value}"')
            session.settings["standard_conforming_strings"] = value
            return tag + parameter_status("standard_conforming_strings", value)
        if name == "application_name":
            session.settings["application_name"] = stmt.value or ""
            return tag + parameter_status("application_name", stmt.value or "")
        if name == "statement_timeout":
            session.timeout_ms = _milliseconds(stmt.value or "0")
            return tag
        if name in _ACCEPTED_SETTINGS:
            return tag  # what drivers set on connect; nothing here depends on them
        raise SqlError(sqlliteral.UNDEFINED_OBJECT, f'unrecognized configuration parameter "{stmt.name}"')

    def _show(self, session: _Session, stmt: ShowCommand) -> str:
        by_lower = {k.lower(): v for k, v in session.settings.items()}
        if stmt.name.lower() not in by_lower:
            raise SqlError(sqlliteral.UNDEFINED_OBJECT,
                           f'unrecognized configuration parameter "{stmt.name}"')
        return by_lower[stmt.name.lower()]

    async def _embed_in_task(self, session: _Session, call: EmbedCall) -> list[list[str | None]]:
        """Run the embedding as a task a CancelRequest (or stop()) can interrupt."""
        if self._draining:
            raise SqlError(CANNOT_CONNECT_NOW, "the Fern sidecar is draining for shutdown; "
                           "retry on another replica")
        session.cancelled = False
        timeouts = [t for t in (call.options.timeout_ms, session.timeout_ms) if t > 0]
        deadline = time.monotonic() + min(timeouts) / 1000 if timeouts else None
        session.task = asyncio.ensure_future(self._embed(call, deadline))
        try:
            await asyncio.wait([session.task])
        except asyncio.CancelledError:
            session.task.cancel()
            raise
        task, session.task = session.task, None
        if task.cancelled():
            reason = ("canceling statement due to user request" if session.cancelled
                      else "canceling statement: the Fern sidecar is shutting down")
            raise SqlError(QUERY_CANCELED, reason)
        return task.result()

    async def _embed(self, call: EmbedCall, deadline: float | None) -> list[list[str | None]]:
        """Rows of pgvector text: [vector] for embed(), [ord, vector] per text for embed_many()."""
        present = [i for i, t in enumerate(call.texts) if t is not None]
        vectors: list[str | None] = [None] * len(call.texts)
        if present:
            opts = call.options
            params = EmbedParams(
                texts=[call.texts[i] for i in present], model=call.model,
                lane=Lane.BATCH if opts.lane == "batch" else Lane.ONLINE,
                prompt_name=opts.prompt or "", normalize=opts.normalize,
                truncate=opts.truncate, dimensions=opts.dimensions, encoding="float32",
                deadline=deadline)
            try:
                result = await self.gateway.embed(params)
            except EmbedError as exc:
                if exc.index is not None and call.many:
                    # name the caller's position in ARRAY[...], counting NULLs too
                    original = present[exc.index]
                    text = exc.message.replace(f"texts[{exc.index}]", f"texts[{original}]", 1)
                    raise EmbedError(exc.code, text, original) from None
                raise
            for i, vector in zip(present, result.vectors):
                vectors[i] = vector_text(vector)
        if not call.many:
            return [[vectors[0]]]
        return [[str(i + 1), v] for i, v in enumerate(vectors)]


@dataclass(frozen=True)
class _Prepared:
    sql: str
    params: int


@dataclass(frozen=True)
class _Portal:
    stmt: sqlliteral.Statement
    binary: tuple[bool, ...]


class _Cursor:
    """Reads the fields of one frontend message body; running short is a protocol violation."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.i = 0

    def bytes(self, n: int) -> bytes | None:
        if n == -1:
            return None
        if n < 0 or self.i + n > len(self.body):
            raise ProtocolError(PROTOCOL_VIOLATION, "insufficient data left in message")
        out, self.i = self.body[self.i:self.i + n], self.i + n
        return out

    def int16(self) -> int:
        return struct.unpack("!h", self.bytes(2))[0]

    def int32(self) -> int:
        return struct.unpack("!i", self.bytes(4))[0]

    def string(self) -> str:
        end = self.body.find(b"\0", self.i)
        if end < 0:
            raise ProtocolError(PROTOCOL_VIOLATION, "invalid string in message")
        raw, self.i = self.body[self.i:end], end + 1
        return _utf8(raw)


# Extended-query messages and the methods that answer them.
_EXTENDED = {b"P": "_parse", b"B": "_bind", b"D": "_describe", b"E": "_execute", b"C": "_close",
             b"H": "_flush"}
# Settings drivers send on connect that change nothing here; SET accepts and ignores them.
_ACCEPTED_SETTINGS = ("extra_float_digits", "datestyle", "timezone", "intervalstyle",
                      "search_path")
_UNIT_MS = {"ms": 1, "s": 1000, "min": 60_000, "h": 3_600_000, "d": 86_400_000}


def _milliseconds(value: str) -> int:
    """statement_timeout's value: '500', '500ms', '5s', '1min', '1h', '1d' -> milliseconds."""
    text = value.strip().lower()
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz").strip()
    unit = text[len(number):].strip() or "ms"
    if not number.isdigit() or unit not in _UNIT_MS:
        raise SqlError("22023", f'invalid value for parameter "statement_timeout": "{value}"',
                       hint='Valid units are "ms", "s", "min", "h", and "d".')
    return int(number) * _UNIT_MS[unit]


def _message_string(body: bytes) -> str:
    """A Query message's one string: NUL-terminated, no NUL inside, UTF-8."""
    if not body.endswith(b"\0") or b"\0" in body[:-1]:
        raise SqlError(PROTOCOL_VIOLATION, "invalid string in message: the query holds a NUL byte")
    return _utf8(body[:-1])


def _utf8(raw: bytes, where: str = "") -> str:
    """Text from the client, which PostgreSQL requires to be UTF-8 without NUL; the error
    names the first bad byte, and `where` which input held it."""
    if b"\0" in raw:
        bad = 0
    else:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            bad = raw[exc.start]
    raise SqlError(sqlliteral.CHARACTER_NOT_IN_REPERTOIRE,
                   f'invalid byte sequence for encoding "UTF8": 0x{bad:02x}{where}')


def _columns(stmt: sqlliteral.Statement) -> list[tuple[str, int]]:
    if isinstance(stmt, EmbedCall):
        return [("ord", INT4_OID), ("embedding", TEXT_OID)] if stmt.many else [("embed", TEXT_OID)]
    if isinstance(stmt, ShowCommand):
        return [(stmt.name.lower(), TEXT_OID)]
    return []


def _result_binary(formats: list[int], columns: int) -> tuple[bool, ...]:
    if any(f not in (0, 1) for f in formats) or len(formats) not in (0, 1, columns):
        raise SqlError(PROTOCOL_VIOLATION, "bind message has invalid result format codes")
    if len(formats) == 1:
        formats = formats * columns
    return tuple(f == 1 for f in formats) if formats else (False,) * columns


def _encode_row(row: list[str | None], columns: list[tuple[str, int]],
                binary: tuple[bool, ...]) -> list[str | bytes | None]:
    """Text values as they are; binary int4 as 4 big-endian bytes (binary text is its UTF-8)."""
    out: list[str | bytes | None] = []
    for value, (_, oid), is_binary in zip(row, columns, binary or (False,) * len(row)):
        if value is not None and is_binary and oid == INT4_OID:
            out.append(struct.pack("!i", int(value)))
        else:
            out.append(value)
    return out
