"""The Postgres-protocol endpoint of a real `fern serve --pg-port`, driven by libpq (psycopg) and raw sockets.

Vectors are held to the gRPC client's for the same text from the same sidecar; errors to
PostgreSQL's SQLSTATEs; and after every refusal the connection and the endpoint keep serving.
"""

from __future__ import annotations

import signal
import socket
import struct
import threading
import time

import numpy as np
import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from sidecar.client import FernClient
from tests.sidecar.lane_holder import batch_lane_held, until_refused

TOKEN = "pg-endpoint-secret"


# The BATCH lane's queue holds BATCH_QUEUE_TOKENS: one longer text never fits it.
BATCH_QUEUE_TOKENS = 200


@pytest.fixture(scope="module")
def sidecar(sidecar_process_class):
    args = ["--token", TOKEN, "--pg-port", "0", "--max-queued-tokens-batch", str(BATCH_QUEUE_TOKENS)]
    with sidecar_process_class(args) as process:
        yield process


@pytest.fixture(scope="module")
def grpc_client(sidecar):
    with FernClient(sidecar.target, token=TOKEN, timeout=120) as client:
        yield client


def dsn(sidecar, password: str | None = TOKEN, **extra: str) -> str:
    parts = {"host": "127.0.0.1", "port": str(sidecar.pg_port), "user": "fern", "dbname": "fern",
             "connect_timeout": "10", **extra}
    if password is not None:
        parts["password"] = password
    return make_conninfo("", **parts)


@pytest.fixture
def pg(sidecar):
    with psycopg.connect(dsn(sidecar), autocommit=True) as conn:
        yield conn


def vector(text: str) -> np.ndarray:
    assert text.startswith("[") and text.endswith("]")
    return np.array([float(x) for x in text[1:-1].split(",")], dtype=np.float32)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def literal(conn: psycopg.Connection, text: str) -> str:
    return sql.Literal(text).as_string(conn)


def assert_usable(conn: psycopg.Connection) -> None:
    row = conn.execute("SELECT embed('still serving')").fetchone()
    assert vector(row[0]).shape == (384,)


def sqlstate_of(conn: psycopg.Connection, query: str) -> psycopg.Error:
    with pytest.raises(psycopg.Error) as info:
        conn.execute(query)
    return info.value


def test_handshake_reports_a_postgres_server(pg):
    assert pg.info.server_version >= 180000
    assert pg.info.parameter_status("client_encoding") == "UTF8"
    assert pg.info.parameter_status("standard_conforming_strings") == "on"
    assert pg.info.backend_pid > 0
    assert pg.execute("SHOW server_version").fetchone()[0].endswith("(Fern)")


def test_embed_equals_the_grpc_clients_vector(pg, grpc_client):
    text = "Fern answers the Postgres protocol so dblink can reach the GPU."
    cur = pg.execute(f"SELECT embed({literal(pg, text)})")
    assert [d.name for d in cur.description] == ["embed"]
    (got,), = cur.fetchall()
    want = grpc_client.embed([text]).vectors[0]
    assert cosine(vector(got), want) >= 0.99999
    assert cur.statusmessage == "SELECT 1"


def test_embed_many_returns_one_row_per_text_in_order(pg, grpc_client):
    texts = ["first text", None, "third, with 'quotes'", "fourth"]
    elements = ", ".join("NULL" if t is None else literal(pg, t) for t in texts)
    cur = pg.execute(f"SELECT * FROM embed_many(ARRAY[{elements}])")
    assert [d.name for d in cur.description] == ["ord", "embedding"]
    rows = cur.fetchall()
    assert [r[0] for r in rows] == [1, 2, 3, 4]
    assert rows[1][1] is None
    want = grpc_client.embed([t for t in texts if t is not None]).vectors
    got = [vector(r[1]) for r in rows if r[1] is not None]
    for g, w in zip(got, want, strict=True):
        assert cosine(g, w) >= 0.99999
    assert pg.execute("SELECT embed_many(ARRAY[])").fetchall() == []


def test_options_reach_the_gateway(pg, grpc_client):
    text = "matryoshka and lanes"
    (got,), = pg.execute(f"SELECT embed({literal(pg, text)}, '', "
                         "'lane=batch, dimensions=64, prompt=query, normalize=false')").fetchall()
    want = grpc_client.embed([text], lane="batch", dimensions=64, prompt="query",
                             normalize=False).vectors[0]
    got = vector(got)
    assert got.shape == (64,)
    assert cosine(got, want) >= 0.99999
    assert abs(np.linalg.norm(got) - np.linalg.norm(want)) < 1e-4 * np.linalg.norm(want)
    model = grpc_client.list_models()[0].name
    (named,), = pg.execute(f"SELECT embed({literal(pg, text)}, {literal(pg, model)})").fetchall()
    assert cosine(vector(named), grpc_client.embed([text]).vectors[0]) >= 0.99999


@pytest.mark.parametrize("query, sqlstate, message", [
    ("SELECT embed('')", "22023", "texts[0]: empty text"),
    ("SELECT embed_many(ARRAY['ok', NULL, ''])", "22023", "texts[2]: empty text"),
    ("SELECT embed('x', 'no-such-model')", "42704", "no-such-model"),
    ("SELECT embed('x', '', 'dimensions=4096')", "22023", "dimensions"),
    ("SELECT embed('x', '', 'prompt=nonsense')", "22023", "nonsense"),
    ("SELECT embed('x', '', 'lane=urgent')", "22023", "lane must be online or batch"),
    ("SELECT embed(E'a\\x00b')", "22021", "0x00"),
    ("SELECT embed(U&'\\0000')", "42601", "invalid Unicode escape value"),
    ("SELECT embed('unterminated)", "42601", "unterminated quoted string"),
    ("SELECT embed('a'); DROP TABLE x; --')", "0A000", "one statement per query"),
    ("DROP TABLE x", "0A000", "does not run DROP statements"),
    ("SELECT version()", "42883", "function version() does not exist"),
    ("SELECT 1", "0A000", "answers only SELECT embed"),
    ("SET search_pth = x", "42704", "unrecognized configuration parameter"),
    ("SHOW data_directory", "42704", "unrecognized configuration parameter"),
])
def test_refusals_carry_sqlstates_and_the_connection_stays_usable(pg, query, sqlstate, message):
    error = sqlstate_of(pg, query)
    assert error.sqlstate == sqlstate
    assert message in error.diag.message_primary
    assert_usable(pg)


def test_a_full_queue_is_53400(pg, sidecar):
    text = "words " * 120  # fits the empty 200-token BATCH queue, not one a stream holds

    def refused():
        try:
            pg.execute(f"SELECT embed('{text}', '', 'lane=batch')").fetchone()
        except psycopg.Error as error:
            return error
        return None

    with batch_lane_held(sidecar.target, TOKEN) as holder:
        error = until_refused(holder, refused)
    assert error.sqlstate == "53400" and "queue" in error.diag.message_primary
    assert_usable(pg)


def test_a_text_longer_than_the_whole_queue_is_refused_as_a_bad_value(pg):
    long_text = "words " * 250  # more tokens than the BATCH queue holds: retrying could never help
    error = sqlstate_of(pg, f"SELECT embed('{long_text}', '', 'lane=batch')")
    assert error.sqlstate == "22023" and "never fits" in error.diag.message_primary
    assert_usable(pg)


def test_syntax_errors_carry_a_position(pg):
    error = sqlstate_of(pg, "SELECT embed('a') trailing")
    assert error.diag.statement_position == str(len("SELECT embed('a') ") + 1)


HOSTILE = [
    "'); DROP TABLE x; --",
    "it''s ' \" \\' \\\\ \\x00 \\u0000",
    "$$ $tag$ E'\\n' U&'\\0041'",
    "Robert'); SELECT embed('pwned'); --",
    "\\",
    "'",
    "ends with backslash \\",
    "multi\nline\r\nand\ttabs",
    "unicode: 日本語 😀 é",
]


def test_hostile_texts_are_embedded_as_data(pg, grpc_client):
    """Quoted the standard way (client-side, as psycopg and format('%L') do), they are just text."""
    want = grpc_client.embed(HOSTILE).vectors
    for text, w in zip(HOSTILE, want):
        for quoted in (literal(pg, text), "E'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"):
            (got,), = pg.execute(f"SELECT embed({quoted})").fetchall()
            assert cosine(vector(got), w) >= 0.99999, quoted


def test_a_megabyte_text_is_embedded(pg, grpc_client):
    text = ("a long document with 'quotes' and \\backslashes\\ " * 25_000)[:1_000_000]
    (got,), = pg.execute(f"SELECT embed({literal(pg, text)})").fetchall()
    want = grpc_client.embed([text]).vectors[0]  # truncated at the model's limit by both
    assert cosine(vector(got), want) >= 0.99999
    over_limit = "many words " * 2000
    error = sqlstate_of(pg, f"SELECT embed({literal(pg, over_limit)}, '', 'truncate=false')")
    assert error.sqlstate == "22023" and "texts[0]" in error.diag.message_primary
    assert_usable(pg)


def test_extended_protocol_binds_parameters_as_text(pg, grpc_client):
    """psycopg's default: parameters travel apart from the SQL; after 5 runs it prepares."""
    texts = ["bound as a parameter: it's \\ not SQL", "'); DROP TABLE x; --"]
    want = grpc_client.embed(texts, dimensions=32).vectors
    for _ in range(7):                                   # past psycopg's prepare_threshold
        rows = pg.execute("SELECT * FROM embed_many(ARRAY[%s, NULL, %s], %s, %s)",
                          [texts[0], texts[1], "", "dimensions=32"]).fetchall()
        assert [r[0] for r in rows] == [1, 2, 3] and rows[1][1] is None
        assert cosine(vector(rows[0][1]), want[0]) >= 0.99999
        assert cosine(vector(rows[2][1]), want[1]) >= 0.99999
    with pg.cursor(binary=True) as cur:                  # binary results: int4 and text
        (ord_, got), = cur.execute("SELECT * FROM embed_many(ARRAY[%s])", [texts[0]]).fetchall()
    assert ord_ == 1 and cosine(vector(got), grpc_client.embed([texts[0]]).vectors[0]) >= 0.99999
    assert pg.execute("SHOW server_version", prepare=True).fetchone()[0].endswith("(Fern)")
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="lane must be online or batch"):
        pg.execute("SELECT embed(%s, '', %s)", ["x", "lane=zzz"])
    with pytest.raises(psycopg.errors.InvalidParameterValue, match=r"texts\[0\]: empty text"):
        pg.execute("SELECT embed(%s)", [""])
    assert_usable(pg)


def test_parameter_references_need_the_extended_protocol(pg):
    error = sqlstate_of(pg, "SELECT embed($1)")
    assert error.sqlstate == "42601" and "there is no parameter $1" in error.diag.message_primary
    assert_usable(pg)


def test_client_cursor_binds_parameters_client_side(sidecar, grpc_client):
    text = "bound by ClientCursor: it's \\ fine"
    with psycopg.connect(dsn(sidecar), autocommit=True, cursor_factory=psycopg.ClientCursor) as conn:
        (got,), = conn.execute("SELECT embed(%s)", [text]).fetchall()
    assert cosine(vector(got), grpc_client.embed([text]).vectors[0]) >= 0.99999


def test_set_show_and_empty_queries(pg):
    pg.execute("SET application_name = 'fern-test'")
    assert pg.info.parameter_status("application_name") == "fern-test"
    assert pg.execute("SHOW application_name").fetchone() == ("fern-test",)
    pg.execute("SET client_encoding TO 'UTF8'")
    pg.execute("SET standard_conforming_strings = off")
    assert pg.info.parameter_status("standard_conforming_strings") == "off"
    (off,), = pg.execute("SELECT embed('it\\'s')").fetchall()   # backslash escapes now
    pg.execute("RESET standard_conforming_strings")
    (on,), = pg.execute("SELECT embed('it''s')").fetchall()
    assert cosine(vector(off), vector(on)) >= 0.99999
    assert pg.execute("").statusmessage is None
    assert pg.execute(" -- only a comment").statusmessage is None
    error = sqlstate_of(pg, "SET client_encoding TO 'LATIN1'")
    assert error.sqlstate == "22023"
    assert_usable(pg)


def test_wrong_password_is_an_authentication_failure(sidecar):
    with pytest.raises(psycopg.OperationalError, match='password authentication failed for user "fern"'):
        psycopg.connect(dsn(sidecar, password="not the token"))


def test_no_password_is_refused(sidecar):
    for password in (None, ""):
        with pytest.raises(psycopg.OperationalError, match="no password supplied"):
            psycopg.connect(dsn(sidecar, password=password))
    # A client that goes through SCRAM with an empty password anyway is refused too.
    with raw(sidecar) as s:
        s.sendall(startup_packet({"user": "u"}))
        with pytest.raises(AssertionError, match="28P01"):
            scram_login(s, "")


def test_encryption_requests_are_declined_and_sslmode_require_fails(sidecar):
    with pytest.raises(psycopg.OperationalError, match="server does not support SSL"):
        psycopg.connect(dsn(sidecar, sslmode="require"))
    with psycopg.connect(dsn(sidecar, sslmode="prefer"), autocommit=True) as conn:
        assert_usable(conn)


# ---- raw protocol -------------------------------------------------------------------------


def startup_packet(params: dict[str, str], version: int = 3 << 16) -> bytes:
    body = struct.pack("!I", version) + b"".join(
        k.encode() + b"\0" + v.encode() + b"\0" for k, v in params.items()) + b"\0"
    return struct.pack("!I", len(body) + 4) + body


def read_message(sock: socket.socket) -> tuple[bytes, bytes]:
    header = recv_exactly(sock, 5)
    (length,) = struct.unpack("!I", header[1:])
    return header[:1], recv_exactly(sock, length - 4)


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def fields(body: bytes) -> dict[str, str]:
    return {part[:1].decode(): part[1:].decode() for part in body.split(b"\0") if part}


def raw(sidecar) -> socket.socket:
    return socket.create_connection(("127.0.0.1", sidecar.pg_port), timeout=10)


def test_ssl_and_gssenc_requests_get_n_then_auth_starts(sidecar):
    with raw(sidecar) as s:
        s.sendall(struct.pack("!II", 8, 80877104))   # GSSENCRequest
        assert recv_exactly(s, 1) == b"N"
        s.sendall(struct.pack("!II", 8, 80877103))   # SSLRequest
        assert recv_exactly(s, 1) == b"N"
        s.sendall(startup_packet({"user": "u"}))
        tag, body = read_message(s)
        assert tag == b"R" and struct.unpack("!I", body[:4])[0] == 10   # AuthenticationSASL
        assert b"SCRAM-SHA-256\0" in body


def test_newer_protocol_minor_is_negotiated_down(sidecar):
    with raw(sidecar) as s:
        s.sendall(startup_packet({"user": "u", "_pq_.unknown": "1"}, (3 << 16) | 2))
        tag, body = read_message(s)
        assert tag == b"v"
        minor, count = struct.unpack("!II", body[:8])
        assert (minor, count) == (0, 1) and body[8:] == b"_pq_.unknown\0"
        tag, _ = read_message(s)
        assert tag == b"R"


@pytest.mark.parametrize("packet, sqlstate", [
    (startup_packet({"user": "u"}, 2 << 16), "0A000"),
    (startup_packet({}), "28000"),
    (startup_packet({"user": "u", "replication": "database"}), "0A000"),
    (startup_packet({"user": "u", "client_encoding": "LATIN1"}), "22023"),
    (struct.pack("!I", 1 << 20) + b"x" * 16, "08P01"),
])
def test_bad_startups_get_a_fatal_error(sidecar, packet, sqlstate):
    with raw(sidecar) as s:
        s.sendall(packet)
        tag, body = read_message(s)
        assert tag == b"E"
        assert fields(body)["S"] == "FATAL" and fields(body)["C"] == sqlstate


def test_a_wrong_sasl_mechanism_is_a_protocol_violation(sidecar):
    with raw(sidecar) as s:
        s.sendall(startup_packet({"user": "u"}))
        read_message(s)
        body = b"PLAIN\0" + struct.pack("!i", 3) + b"abc"
        s.sendall(b"p" + struct.pack("!I", len(body) + 4) + body)
        tag, body = read_message(s)
        assert tag == b"E" and fields(body)["C"] == "08P01"


def test_a_nul_inside_a_query_message_is_refused_and_the_session_goes_on(sidecar):
    # libpq cannot send this (queries are C strings), so speak the protocol by hand.
    with raw(sidecar) as s:
        s.sendall(startup_packet({"user": "u"}))
        scram_login(s, TOKEN)
        query = b"SELECT embed('a\0b')\0"
        s.sendall(b"Q" + struct.pack("!I", len(query) + 4) + query)
        tag, body = read_message(s)
        assert tag == b"E" and fields(body)["C"] == "08P01"
        assert read_message(s)[0] == b"Z"
        query = b"SELECT embed('after')\0"
        s.sendall(b"Q" + struct.pack("!I", len(query) + 4) + query)
        assert [read_message(s)[0] for _ in range(4)] == [b"T", b"D", b"C", b"Z"]
        s.sendall(b"X" + struct.pack("!I", 4))
        assert s.recv(1) == b""


def frontend(tag: bytes, body: bytes) -> bytes:
    return tag + struct.pack("!I", len(body) + 4) + body


def bind(portal: bytes, statement: bytes, params: list[bytes]) -> bytes:
    body = portal + b"\0" + statement + b"\0" + struct.pack("!hh", 1, 0)
    body += struct.pack("!h", len(params)) + b"".join(struct.pack("!i", len(p)) + p for p in params)
    return frontend(b"B", body + struct.pack("!h", 0))


def test_extended_protocol_refusals_skip_to_sync(sidecar):
    """A NUL inside a parameter and a wrong parameter count are errors; the batch resumes at Sync."""
    with raw(sidecar) as s:
        s.sendall(startup_packet({"user": "u"}))
        scram_login(s, TOKEN)
        parse = frontend(b"P", b"\0SELECT embed($1)\0" + struct.pack("!h", 0))
        execute = frontend(b"E", b"\0" + struct.pack("!i", 0))
        sync = frontend(b"S", b"")
        s.sendall(parse + bind(b"", b"", [b"a\0b"]) + execute + sync)
        assert read_message(s)[0] == b"1"                       # ParseComplete
        tag, body = read_message(s)
        assert tag == b"E" and fields(body)["C"] == "22021"      # the Execute is skipped
        assert read_message(s)[0] == b"Z"
        s.sendall(bind(b"", b"", [b"one", b"two"]) + execute + sync)
        tag, body = read_message(s)
        assert tag == b"E" and fields(body)["C"] == "08P01"
        assert read_message(s)[0] == b"Z"
        s.sendall(bind(b"", b"", ["ok: é".encode()]) + execute + sync)
        assert [read_message(s)[0] for _ in range(4)] == [b"2", b"D", b"C", b"Z"]
        s.sendall(frontend(b"E", b"nope\0" + struct.pack("!i", 0)) + sync)
        tag, body = read_message(s)
        assert tag == b"E" and fields(body)["C"] == "34000"
        assert read_message(s)[0] == b"Z"


def scram_login(s: socket.socket, password: str) -> None:
    """Client side of SCRAM-SHA-256 (RFC 5802), independent of the server's code, up to ReadyForQuery."""
    import base64
    import hashlib
    import hmac

    tag, body = read_message(s)
    assert tag == b"R" and struct.unpack("!I", body[:4])[0] == 10
    client_nonce = base64.b64encode(b"0123456789abcdef0123").decode()
    first_bare = f"n=,r={client_nonce}"
    initial = b"SCRAM-SHA-256\0" + struct.pack("!i", len(first_bare) + 3) + b"n,," + first_bare.encode()
    s.sendall(b"p" + struct.pack("!I", len(initial) + 4) + initial)
    tag, body = read_message(s)
    assert struct.unpack("!I", body[:4])[0] == 11
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
    s.sendall(b"p" + struct.pack("!I", len(final) + 4) + final)
    tag, body = read_message(s)
    assert tag == b"R", f"login refused: {fields(body)}"
    assert struct.unpack("!I", body[:4])[0] == 12
    server_key = hmac.digest(salted, b"Server Key", "sha256")
    assert body[4:] == b"v=" + base64.b64encode(hmac.digest(server_key, auth, "sha256"))
    while True:
        tag, _ = read_message(s)
        if tag == b"Z":
            return


def test_cancel_request_interrupts_a_long_query(sidecar):
    texts = ", ".join(f"'document {i}: " + "many words of text " * 60 + "'" for i in range(1500))
    with psycopg.connect(dsn(sidecar), autocommit=True) as conn:
        def cancel_soon() -> None:
            time.sleep(0.5)
            conn.cancel_safe()

        threading.Thread(target=cancel_soon).start()
        started = time.monotonic()
        with pytest.raises(psycopg.errors.QueryCanceled, match="canceling statement due to user request"):
            conn.execute(f"SELECT * FROM embed_many(ARRAY[{texts}])")
        assert time.monotonic() - started < 30
        assert_usable(conn)


def test_timeouts_drop_the_work_and_answer_57014(sidecar):
    """SET statement_timeout (and the timeout_ms option, which fern.embed passes) become deadlines."""
    texts = ", ".join(f"'document {i}: " + "many words of text " * 60 + "'" for i in range(1500))
    with psycopg.connect(dsn(sidecar), autocommit=True) as conn:
        for setup, options in (("SET statement_timeout = '300ms'", ""), ("RESET statement_timeout",
                                                                          "timeout_ms=300")):
            conn.execute(setup)
            started = time.monotonic()
            with pytest.raises(psycopg.errors.QueryCanceled, match="deadline"):
                conn.execute(f"SELECT * FROM embed_many(ARRAY[{texts}], '', '{options}')")
            assert time.monotonic() - started < 30      # ~150 s of CPU work without a deadline
        assert_usable(conn)
        error = sqlstate_of(conn, "SET statement_timeout = 'soon'")
        assert error.sqlstate == "22023"
        conn.execute("SET statement_timeout = '1min'")
        assert_usable(conn)


def test_concurrent_connections_get_their_own_vectors(sidecar, grpc_client):
    texts = [f"concurrent text number {i}" for i in range(8)]
    want = grpc_client.embed(texts).vectors
    results: dict[int, np.ndarray] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            with psycopg.connect(dsn(sidecar), autocommit=True) as conn:
                for _ in range(3):
                    (got,), = conn.execute(f"SELECT embed('{texts[i]}')").fetchall()
                results[i] = vector(got)
        except BaseException as exc:  # surfaced by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    for i, w in enumerate(want):
        assert cosine(results[i], w) >= 0.99999


def test_drain_refuses_new_queries_with_57p03_then_ends_sessions(sidecar_process_class):
    """SIGTERM: new queries get 57P03 while the query in flight has its grace; then sessions end."""
    with sidecar_process_class(["--token", TOKEN, "--pg-port", "0"]) as own:
        busy = psycopg.connect(dsn(own), autocommit=True)
        idle = psycopg.connect(dsn(own), autocommit=True)
        assert_usable(idle)
        texts = ", ".join(f"'document {i}: " + "many words of text " * 60 + "'" for i in range(1500))
        outcome: list[BaseException] = []

        def long_query() -> None:
            try:
                busy.execute(f"SELECT * FROM embed_many(ARRAY[{texts}])")
            except psycopg.Error as exc:
                outcome.append(exc)

        worker = threading.Thread(target=long_query)
        worker.start()
        time.sleep(2.0)                                   # the long query is in the scheduler
        own.process.send_signal(signal.SIGTERM)
        time.sleep(1.0)                                   # drain has begun; grace not over
        error = sqlstate_of(idle, "SELECT embed('during the drain')")
        assert error.sqlstate == "57P03" and "draining" in error.diag.message_primary
        worker.join(60)
        assert outcome and isinstance(outcome[0], psycopg.Error)   # cut at the end of the grace
        assert own.process.wait(60) == 0
        for conn in (busy, idle):
            conn.close()


def test_over_grpc_a_text_that_never_fits_is_invalid_argument_naming_it(grpc_client):
    import grpc

    from sidecar.client import FernError

    with pytest.raises(FernError) as info:
        grpc_client.embed(["fits", "words " * 250], lane="batch")
    # Not RESOURCE_EXHAUSTED: a balanced client would retry that on every sidecar, in vain.
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and info.value.index == 1
    assert info.value.message.startswith("texts[1]: 252 tokens exceeds the BATCH lane's queue of 200 tokens")
