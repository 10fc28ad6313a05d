"""The Postgres wire protocol's framing: message builders, the startup packet, bounded reads of frontend messages."""
from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass

import numpy as np

from sidecar.pgwire.lexer import CHARACTER_NOT_IN_REPERTOIRE, SqlError

PROTOCOL_3_0 = 3 << 16
SSL_REQUEST = 80877103
GSSENC_REQUEST = 80877104
CANCEL_REQUEST = 80877102
MAX_STARTUP_BYTES = 10_000            # as PostgreSQL's MAX_STARTUP_PACKET_LENGTH
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20  # one query message; embed_many of many long texts fits
TEXT_OID = 25
INT4_OID = 23

# SQLSTATEs (PostgreSQL's errcodes.txt) the endpoint sends besides the parser's.
INVALID_PASSWORD = "28P01"
INVALID_AUTHORIZATION = "28000"
PROTOCOL_VIOLATION = "08P01"
TOO_MANY_CONNECTIONS = "53300"
CONFIGURATION_LIMIT_EXCEEDED = "53400"
PROGRAM_LIMIT_EXCEEDED = "54000"
QUERY_CANCELED = "57014"
ADMIN_SHUTDOWN = "57P01"
CANNOT_CONNECT_NOW = "57P03"
IDLE_SESSION_TIMEOUT = "57P05"
INTERNAL_ERROR = "XX000"


class ProtocolError(Exception):
    """The client broke the protocol (or a limit); the connection ends with a FATAL error."""

    def __init__(self, sqlstate: str, message: str) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate
        self.message = message


# ---- backend messages: pure functions from values to bytes -------------------------------


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


# ---- frontend messages ---------------------------------------------------------------------


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


async def read_startup(reader: asyncio.StreamReader) -> bytes:
    """One length-prefixed startup-phase packet (startup, SSLRequest, CancelRequest), at most
    MAX_STARTUP_BYTES: a larger length is refused before anything more is read."""
    length, = struct.unpack("!I", await reader.readexactly(4))
    if length < 8 or length > MAX_STARTUP_BYTES:
        raise ProtocolError(PROTOCOL_VIOLATION, "invalid length of startup packet")
    return await reader.readexactly(length - 4)


async def read_message(reader: asyncio.StreamReader, limit: int,
                       idle_timeout_s: float | None = None) -> tuple[bytes, bytes]:
    """One typed frontend message; a body over `limit` bytes is refused before it is read.

    `idle_timeout_s` bounds the wait for the message's 5-byte header only (TimeoutError),
    so a long body that is arriving is never cut short."""
    async with asyncio.timeout(idle_timeout_s):
        header = await reader.readexactly(5)
    tag, length = header[:1], struct.unpack("!I", header[1:])[0]
    if length < 4:
        raise ProtocolError(PROTOCOL_VIOLATION, f"invalid message length {length}")
    if length - 4 > limit:
        raise ProtocolError(PROGRAM_LIMIT_EXCEEDED,
                            f"message of {length - 4} bytes exceeds Fern's limit of {limit}")
    return tag, await reader.readexactly(length - 4)


class Cursor:
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
        return utf8(raw)


def message_string(body: bytes) -> str:
    """A Query message's one string: NUL-terminated, no NUL inside, UTF-8."""
    if not body.endswith(b"\0") or b"\0" in body[:-1]:
        raise SqlError(PROTOCOL_VIOLATION, "invalid string in message: the query holds a NUL byte")
    return utf8(body[:-1])


def utf8(raw: bytes, where: str = "") -> str:
    """Text from the client, which PostgreSQL requires to be UTF-8 without NUL; the error
    names the first bad byte, and `where` which input held it."""
    if b"\0" in raw:
        bad = 0
    else:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            bad = raw[exc.start]
    raise SqlError(CHARACTER_NOT_IN_REPERTOIRE,
                   f'invalid byte sequence for encoding "UTF8": 0x{bad:02x}{where}')
