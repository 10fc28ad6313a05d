"""One authenticated connection of the Postgres endpoint: its settings, the simple and extended query protocols, the embeddings."""
from __future__ import annotations

import asyncio
import functools
import logging
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from sidecar.errors import EmbedError
from sidecar.gateway import EmbedParams, Gateway
from sidecar.pgwire import grammar
from sidecar.pgwire.framing import (CANNOT_CONNECT_NOW, IDLE_SESSION_TIMEOUT, INT4_OID,
                                    INTERNAL_ERROR, PROTOCOL_VIOLATION, QUERY_CANCELED, TEXT_OID,
                                    Cursor, ProtocolError, command_complete, data_row,
                                    empty_query_response, error_response, message,
                                    message_string, parameter_status, read_message,
                                    ready_for_query, row_description, utf8, vector_text)
from sidecar.pgwire.grammar import EmbedCall, EmptyQuery, SetCommand, ShowCommand, SqlError
from sidecar.scheduler import Lane

log = logging.getLogger("sidecar.pgwire")

OFF_LOOP_CHARS = 64 << 10   # statements longer than this are lexed off the event loop

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


def check_client_encoding(encoding: str, error: type[ProtocolError] | type[SqlError]) -> None:
    """Refuse a client_encoding other than UTF8 (any spelling), with `error`: FATAL at
    startup (ProtocolError), a plain ERROR for SET (SqlError)."""
    if encoding.replace("-", "").replace("_", "").upper() not in ("UTF8", "UNICODE", "SQLASCII"):
        raise error("22023", f'invalid value for parameter "client_encoding": "{encoding}" '
                    "(Fern speaks UTF8)")


@dataclass
class Session:
    """Per-connection state, and the answers to its messages once it has authenticated."""

    user: str
    pid: int
    key: int
    settings: dict[str, str]
    writer: asyncio.StreamWriter
    gateway: Gateway
    draining: Callable[[], bool]         # the server is stopping: refuse new queries
    max_message_bytes: int
    idle_timeout_s: float = 0.0          # 0 = none: close a session idle this long
    task: asyncio.Task | None = None     # the query being answered, for CancelRequest
    cancelled: bool = False
    timeout_ms: int = 0                  # SET statement_timeout: a deadline for each query
    statements: dict[str, "_Prepared"] = field(default_factory=dict)   # extended protocol
    portals: dict[str, "_Portal"] = field(default_factory=dict)

    @property
    def standard_conforming_strings(self) -> bool:
        """How the session's SQL reads backslashes in '...' (SET standard_conforming_strings)."""
        return self.settings["standard_conforming_strings"] == "on"

    async def _next_message(self, reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
        """The next frontend message; a session idle longer than idle_timeout_s ends (57P05)."""
        try:
            return await read_message(reader, self.max_message_bytes, self.idle_timeout_s or None)
        except TimeoutError:
            raise ProtocolError(IDLE_SESSION_TIMEOUT, "terminating connection due to "
                                f"idle-session timeout ({self.idle_timeout_s:g} s)") from None

    async def serve(self, reader: asyncio.StreamReader) -> None:
        writer = self.writer
        skipping_to_sync = False
        while True:
            tag, body = await self._next_message(reader)
            if tag == b"X":
                return
            if tag == b"Q":
                writer.write(await self._answer(self._simple_query, body)
                             + ready_for_query())
            elif tag == b"S":
                skipping_to_sync = False
                self.portals.pop("", None)
                writer.write(ready_for_query())
            elif tag in _EXTENDED:
                # After an error, the rest of an extended-query batch is skipped up to Sync.
                if not skipping_to_sync:
                    out = await self._answer(getattr(self, _EXTENDED[tag]), body)
                    skipping_to_sync = out[:1] == b"E"
                    writer.write(out)
            elif tag == b"F":
                writer.write(error_response(grammar.FEATURE_NOT_SUPPORTED,
                                            "function calls are not supported") + ready_for_query())
            elif tag in (b"d", b"c", b"f"):
                pass  # COPY messages outside COPY are ignored, per the protocol
            else:
                raise ProtocolError(PROTOCOL_VIOLATION, f"invalid frontend message type {tag!r}")
            await writer.drain()

    async def _answer(self, handler, body: bytes) -> bytes:
        """Run one message's handler; a refusal becomes an ErrorResponse and the session goes on."""
        try:
            return await handler(body)
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

    async def _parse_sql(self, sql: str, params: list[str | None] | None = None,
                         *, count: bool = False) -> grammar.Statement | int:
        """The statement (or, with `count`, its highest $n); a long one is lexed in a worker
        thread, since the pure-Python lexer takes about a second a megabyte of E'' string and
        the event loop must keep answering the other sessions meanwhile."""
        scs = self.standard_conforming_strings
        if count:
            work = functools.partial(grammar.count_params, sql, standard_conforming_strings=scs)
        else:
            work = functools.partial(grammar.parse, sql, standard_conforming_strings=scs,
                                     params=params)
        return await asyncio.to_thread(work) if len(sql) > OFF_LOOP_CHARS else work()

    async def _simple_query(self, body: bytes) -> bytes:
        sql = message_string(body)
        return await self._run(await self._parse_sql(sql), describe=True)

    async def _parse(self, body: bytes) -> bytes:
        """Parse: name, query, parameter types -> ParseComplete."""
        cursor = Cursor(body)
        name, sql = cursor.string(), cursor.string()
        types = [cursor.int32() for _ in range(cursor.int16())]
        if name and name in self.statements:
            raise SqlError("42P05", f'prepared statement "{name}" already exists')
        count = await self._parse_sql(sql, count=True)
        self.statements[name] = _Prepared(sql, max(count, len(types)))
        return message(b"1")

    async def _bind(self, body: bytes) -> bytes:
        """Bind: portal, statement, parameter values (text or binary text) -> BindComplete."""
        cursor = Cursor(body)
        portal, name = cursor.string(), cursor.string()
        formats = [cursor.int16() for _ in range(cursor.int16())]
        values = [cursor.bytes(cursor.int32()) for _ in range(cursor.int16())]
        result_formats = [cursor.int16() for _ in range(cursor.int16())]
        prepared = self.statements.get(name)
        if prepared is None:
            raise SqlError("26000", f'prepared statement "{name}" does not exist')
        if len(values) != prepared.params:
            raise SqlError(PROTOCOL_VIOLATION, f"bind message supplies {len(values)} parameters, "
                           f"but prepared statement \"{name}\" requires {prepared.params}")
        if len(formats) not in (0, 1, len(values)) or any(f not in (0, 1) for f in formats):
            raise SqlError(PROTOCOL_VIOLATION, "bind message has invalid parameter format codes")
        # A text parameter's binary form is its UTF-8 bytes too, so both formats read alike.
        params = [None if v is None else utf8(v, f" (parameter ${i + 1})")
                  for i, v in enumerate(values)]
        stmt = await self._parse_sql(prepared.sql, params)
        columns = _columns(stmt)
        binary = _result_binary(result_formats, len(columns))
        self.portals[portal] = _Portal(stmt, binary)
        return message(b"2")

    async def _describe(self, body: bytes) -> bytes:
        cursor = Cursor(body)
        kind, name = cursor.bytes(1), cursor.string()
        if kind == b"S":
            prepared = self.statements.get(name)
            if prepared is None:
                raise SqlError("26000", f'prepared statement "{name}" does not exist')
            stmt = await self._parse_sql(prepared.sql, [""] * prepared.params)
            params = message(b"t", struct.pack("!H", prepared.params)
                             + struct.pack("!I", TEXT_OID) * prepared.params)
            columns = _columns(stmt)
            return params + (row_description(columns) if columns else message(b"n"))
        portal = self.portals.get(name)
        if portal is None:
            raise SqlError("34000", f'portal "{name}" does not exist')
        columns = _columns(portal.stmt)
        return row_description(columns, portal.binary) if columns else message(b"n")

    async def _execute(self, body: bytes) -> bytes:
        cursor = Cursor(body)
        name = cursor.string()
        portal = self.portals.get(name)
        if portal is None:
            raise SqlError("34000", f'portal "{name}" does not exist')
        return await self._run(portal.stmt, describe=False, binary=portal.binary)

    async def _close(self, body: bytes) -> bytes:
        cursor = Cursor(body)
        kind, name = cursor.bytes(1), cursor.string()
        (self.statements if kind == b"S" else self.portals).pop(name, None)
        return message(b"3")

    async def _flush(self, body: bytes) -> bytes:
        return b""

    async def _run(self, stmt: grammar.Statement, *, describe: bool,
                   binary: tuple[bool, ...] = ()) -> bytes:
        """A statement's answer: [RowDescription] DataRow* CommandComplete (or its equivalent)."""
        if isinstance(stmt, EmptyQuery):
            return empty_query_response()
        if isinstance(stmt, SetCommand):
            return self._set(stmt)
        if isinstance(stmt, ShowCommand):
            rows, tag = [[self._show(stmt)]], "SHOW"
        else:
            rows = await self._embed_in_task(stmt)
            tag = f"SELECT {len(rows)}"
        columns = _columns(stmt)
        out = [row_description(columns, binary)] if describe else []
        out += [data_row(_encode_row(row, columns, binary)) for row in rows]
        out.append(command_complete(tag))
        return b"".join(out)

    def _set(self, stmt: SetCommand) -> bytes:
        name = stmt.name.lower()
        tag = command_complete("RESET" if stmt.reset else "SET")
        if name == "client_encoding":
            check_client_encoding(stmt.value or "UTF8", SqlError)
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
            self.settings["standard_conforming_strings"] = value
            return tag + parameter_status("standard_conforming_strings", value)
        if name == "application_name":
            self.settings["application_name"] = stmt.value or ""
            return tag + parameter_status("application_name", stmt.value or "")
        if name == "statement_timeout":
            self.timeout_ms = _milliseconds(stmt.value or "0")
            return tag
        if name in _ACCEPTED_SETTINGS:
            return tag  # what drivers set on connect; nothing here depends on them
        raise SqlError(grammar.UNDEFINED_OBJECT, f'unrecognized configuration parameter "{stmt.name}"')

    def _show(self, stmt: ShowCommand) -> str:
        by_lower = {k.lower(): v for k, v in self.settings.items()}
        if stmt.name.lower() not in by_lower:
            raise SqlError(grammar.UNDEFINED_OBJECT,
                           f'unrecognized configuration parameter "{stmt.name}"')
        return by_lower[stmt.name.lower()]

    async def _embed_in_task(self, call: EmbedCall) -> list[list[str | None]]:
        """Run the embedding as a task a CancelRequest (or stop()) can interrupt."""
        if self.draining():
            raise SqlError(CANNOT_CONNECT_NOW, "the Fern sidecar is draining for shutdown; "
                           "retry on another replica")
        self.cancelled = False
        timeouts = [t for t in (call.options.timeout_ms, self.timeout_ms) if t > 0]
        deadline = time.monotonic() + min(timeouts) / 1000 if timeouts else None
        self.task = asyncio.ensure_future(self._embed(call, deadline))
        try:
            await asyncio.wait([self.task])
        except asyncio.CancelledError:
            self.task.cancel()
            raise
        task, self.task = self.task, None
        if task.cancelled():
            reason = ("canceling statement due to user request" if self.cancelled
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
    stmt: grammar.Statement
    binary: tuple[bool, ...]


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


def _columns(stmt: grammar.Statement) -> list[tuple[str, int]]:
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
