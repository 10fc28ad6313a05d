"""The Postgres endpoint's limits under hostile clients: failed-authentication back-off and refusal per peer, the startup and idle timeouts, the cap on unauthenticated connections, and the message-size caps.

A peer is one client IP address. On Linux all of 127/8 is loopback, so a raw client bound
to 127.0.0.2 is a second peer of a server listening on 127.0.0.1. Timeouts here are small
and configured per test; every wait for the server is generous and bounded.
"""

from __future__ import annotations

import socket
import struct
import time

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from sidecar.pgwire import AuthLimits, FailedAuthLimiter, PgWireLimits
from tests.security.pgwire_harness import (TOKEN, closed_by_server, connect, endpoint,  # noqa: F401
                                           fields, gateway, login, loop_thread, query,
                                           read_message, startup_packet)


def dsn(port: int, password: str = TOKEN) -> str:
    return make_conninfo("", host="127.0.0.1", port=str(port), user="fern", dbname="fern",
                         password=password, connect_timeout="30", sslmode="disable")


def error_fields(raw: bytes) -> dict[str, str]:
    """The fields of the ErrorResponse at the start of `raw` (what a closing server sent)."""
    assert raw[:1] == b"E", raw[:40]
    (length,) = struct.unpack("!I", raw[1:5])
    return fields(raw[5:1 + length])


# ---- failed authentications -------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_limiter_backs_off_then_refuses_then_forgets():
    clock = FakeClock()
    limits = AuthLimits(delay_after=2, delay_s=0.5, max_delay_s=3.0, refuse_after=6,
                        refuse_s=60.0, window_s=300.0)
    limiter = FailedAuthLimiter(limits, clock)
    delays = [limiter.failed("10.0.0.1") for _ in range(6)]
    assert delays == [0.0, 0.0, 0.5, 1.0, 2.0, 3.0]      # doubling, capped
    assert limiter.refused_for("10.0.0.1") == pytest.approx(60.0)
    assert limiter.refused_for("10.0.0.2") == 0.0       # another peer is not touched
    assert (limiter.failures_total, limiter.refusals_total, limiter.refused_peers) == (6, 1, 1)
    clock.now += 61
    assert limiter.refused_for("10.0.0.1") == 0.0 and limiter.refused_peers == 0
    clock.now += 300                                     # failures older than the window
    assert limiter.failed("10.0.0.1") == 0.0
    limiter.failed("10.0.0.3")
    limiter.succeeded("10.0.0.3")                        # a success forgets the failures
    assert [limiter.failed("10.0.0.3") for _ in range(3)] == [0.0, 0.0, 0.5]


def test_the_limiters_table_is_bounded():
    limiter = FailedAuthLimiter(AuthLimits(max_peers=100), FakeClock())
    for i in range(1000):
        limiter.failed(f"10.1.{i // 256}.{i % 256}")
    assert len(limiter._peers) == 100


def test_200_rapid_wrong_passwords_back_off_then_are_refused_and_another_peer_logs_in(endpoint):
    auth = AuthLimits(delay_after=3, delay_s=0.02, max_delay_s=0.08, refuse_after=10,
                      refuse_s=600.0)
    server = endpoint(limits=PgWireLimits(auth=auth))
    codes: list[str] = []
    started = time.monotonic()
    for _ in range(200):
        with pytest.raises(psycopg.OperationalError) as info:
            psycopg.connect(dsn(server.port, "wrong password"))
        text = str(info.value)
        codes.append("28P01" if "password authentication failed" in text
                     else "refused" if "too many failed authentication attempts from 127.0.0.1"
                     in text else text)
    elapsed = time.monotonic() - started
    assert codes[:10] == ["28P01"] * 10
    assert codes[10:] == ["refused"] * 190
    assert server.auth_limiter.failures_total == 10
    assert server.auth_limiter.refusals_total == 190
    assert server.auth_limiter.refused_peers == 1
    # Failures 4..10 waited 0.02, 0.04, then 0.08 each before their answer: a lower bound.
    assert elapsed >= 0.02 + 0.04 + 0.08 * 5
    # The locked-out peer is refused even with the right password, before SCRAM starts ...
    with pytest.raises(psycopg.OperationalError, match="too many failed authentication"):
        psycopg.connect(dsn(server.port))
    with connect(server.port, "127.0.0.1") as s:
        refusal = login(s, TOKEN)
    assert refusal is not None and refusal["C"] == "28000"
    # ... while another peer, 127.0.0.2, logs in and embeds.
    with connect(server.port, "127.0.0.2") as s:
        assert login(s, TOKEN) is None
        answer = query(s, "SELECT embed('another peer')")
        assert [tag for tag, _ in answer] == [b"T", b"D", b"C", b"Z"]


def test_wrong_passwords_from_one_peer_do_not_slow_another(endpoint):
    auth = AuthLimits(delay_after=0, delay_s=5.0, max_delay_s=5.0, refuse_after=3,
                      refuse_s=600.0)
    server = endpoint(limits=PgWireLimits(auth=auth))
    with connect(server.port, "127.0.0.3") as s:
        assert login(s, "wrong")["C"] == "28P01"   # answered after the 5 s back-off
    with connect(server.port, "127.0.0.4") as s:
        assert login(s, TOKEN) is None
    assert server.auth_limiter.failures_total == 1


# ---- unauthenticated connections ----------------------------------------------------------


def test_300_idle_unauthenticated_connections_are_capped_and_timed_out(endpoint):
    server = endpoint(limits=PgWireLimits(max_unauthenticated=64, startup_timeout_s=1.0))
    socks = []
    try:
        for i in range(300):
            s = connect(server.port, timeout=60)
            if i % 2:
                s.sendall(struct.pack("!I", 64))   # a startup length, then nothing
            socks.append(s)
        answers = [closed_by_server(s) for s in socks]   # each read ends when the server closes
    finally:
        for s in socks:
            s.close()
    reasons = [error_fields(a)["M"] if a else "" for a in answers]
    timed_out = sum("canceling authentication due to timeout" in r for r in reasons)
    capped = sum("too many clients already" in r for r in reasons)
    assert timed_out + capped == 300, set(reasons)
    assert timed_out >= 64 and capped >= 1
    assert all(error_fields(a)["C"] in ("08P01", "53300") for a in answers)
    deadline = time.monotonic() + 30
    while server.unauthenticated and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.unauthenticated == 0
    with psycopg.connect(dsn(server.port), autocommit=True) as conn:
        assert conn.execute("SELECT embed('after the flood')").fetchone()[0].startswith("[")


def test_a_client_that_stalls_inside_scram_is_timed_out(endpoint):
    server = endpoint(limits=PgWireLimits(startup_timeout_s=1.0))
    with connect(server.port) as s:
        s.sendall(startup_packet({"user": "fern"}))
        assert read_message(s)[0] == b"R"              # AuthenticationSASL, then silence
        assert "canceling authentication due to timeout" in error_fields(closed_by_server(s))["M"]


def test_an_idle_session_is_closed_with_57p05(endpoint):
    server = endpoint(limits=PgWireLimits(idle_session_timeout_s=0.5))
    with connect(server.port) as s:
        assert login(s, TOKEN) is None
        assert [t for t, _ in query(s, "SHOW server_version")][-1] == b"Z"
        err = error_fields(closed_by_server(s))
    assert err["C"] == "57P05" and "idle-session timeout" in err["M"]
    # Off (the default): a session may stay idle; it still answers afterwards.
    quiet = endpoint()
    with connect(quiet.port) as s:
        assert login(s, TOKEN) is None
        time.sleep(1.0)
        assert [t for t, _ in query(s, "SHOW server_version")][-1] == b"Z"


# ---- message-size caps ---------------------------------------------------------------------


def test_a_startup_packet_over_10000_bytes_is_refused_unread(endpoint):
    server = endpoint()
    with connect(server.port) as s:
        s.sendall(struct.pack("!I", 10_001))           # and no body
        err = error_fields(closed_by_server(s))
    assert err["C"] == "08P01" and err["M"] == "invalid length of startup packet"
    with connect(server.port) as s:
        s.sendall(startup_packet({"user": "fern", "application_name": "x" * 9_900}))
        assert read_message(s)[0] == b"R"              # 9,9xx bytes: within the cap


def test_a_sasl_message_over_10000_bytes_is_refused(endpoint):
    server = endpoint()
    with connect(server.port) as s:
        s.sendall(startup_packet({"user": "fern"}))
        assert read_message(s)[0] == b"R"
        s.sendall(b"p" + struct.pack("!I", 10_005))
        err = error_fields(closed_by_server(s))
    assert err["C"] == "54000" and "exceeds Fern's limit of 10000" in err["M"]


def test_a_query_over_64_mib_is_refused_before_its_body_is_sent(endpoint):
    server = endpoint()
    assert server.max_message_bytes == 64 << 20
    with connect(server.port) as s:
        assert login(s, TOKEN) is None
        s.sendall(b"Q" + struct.pack("!I", (64 << 20) + 5))   # the header alone
        err = error_fields(closed_by_server(s))
    assert err["C"] == "54000" and err["M"] == ("message of 67108865 bytes exceeds Fern's "
                                                "limit of 67108864")


def test_a_configured_cap_admits_a_query_at_the_cap_and_refuses_one_byte_more(endpoint):
    cap = 1 << 20
    server = endpoint(limits=PgWireLimits(max_message_bytes=cap))
    filler = "x" * (cap - len("SELECT embed('')") - 1)   # the NUL makes it exactly `cap`
    with connect(server.port) as s:
        assert login(s, TOKEN) is None
        answer = query(s, f"SELECT embed('{filler}')")
        assert [t for t, _ in answer] == [b"T", b"D", b"C", b"Z"]
        body = f"SELECT embed('{filler}x')".encode() + b"\0"
        try:
            s.sendall(b"Q" + struct.pack("!I", len(body) + 4) + body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may close before the whole body is written
        raw = closed_by_server(s)
    assert error_fields(raw)["C"] == "54000"


def test_the_tls_handshake_counts_against_the_startup_timeout(endpoint, tmp_path):
    import ssl

    import trustme

    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    server = endpoint(ssl_context=context, limits=PgWireLimits(startup_timeout_s=1.0))
    with connect(server.port) as s:
        s.sendall(struct.pack("!II", 8, 80877103))
        assert s.recv(1) == b"S"
        s.sendall(b"\x16\x03\x01")                     # the start of a ClientHello, then nothing
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if not s.recv(4096):
                    break
            except (ConnectionResetError, socket.timeout):
                break
        assert time.monotonic() < deadline
    assert server.unauthenticated == 0


def test_a_long_statement_is_lexed_off_the_event_loop(endpoint, monkeypatch):
    """While one session's multi-megabyte E'' statement is being lexed, another session logs
    in and is answered: the order of the two answers shows the loop was free."""
    import threading

    from sidecar.pgwire import grammar

    server = endpoint()
    # About 6 MB of escapes, refused after the literal (an alias is not in the grammar), so
    # nothing is embedded: the cost is the lexing alone.
    big = "SELECT embed(E'" + "a\\'b " * 1_200_000 + "') AS v"
    lexing = threading.Event()
    real_parse = grammar.parse

    def observed_parse(sql, **kw):
        if len(sql) > 1_000_000:
            lexing.set()   # the hook only says when lexing starts; the real parser runs
        return real_parse(sql, **kw)

    monkeypatch.setattr(grammar, "parse", observed_parse)
    order: list[str] = []

    def long_statement() -> None:
        with connect(server.port, timeout=300) as s:
            assert login(s, TOKEN) is None
            body = big.encode() + b"\0"
            s.sendall(b"Q" + struct.pack("!I", len(body) + 4) + body)
            answer = [tag for tag, _ in query_reply(s)]
            assert answer == [b"E", b"Z"]
            order.append("long statement")

    worker = threading.Thread(target=long_statement)
    worker.start()
    assert lexing.wait(120)
    with connect(server.port, "127.0.0.2", timeout=300) as s:
        assert login(s, TOKEN) is None
        assert [t for t, _ in query(s, "SHOW server_version")][-1] == b"Z"
        order.append("other session")
    worker.join(300)
    assert order == ["other session", "long statement"]


def query_reply(sock: socket.socket) -> list[tuple[bytes, bytes]]:
    out = []
    while True:
        tag, payload = read_message(sock)
        out.append((tag, payload))
        if tag == b"Z":
            return out


def test_a_flood_of_refusals_is_logged_once(endpoint, caplog):
    import logging

    auth = AuthLimits(delay_after=100, refuse_after=3, refuse_s=600.0)
    server = endpoint(limits=PgWireLimits(auth=auth))
    with caplog.at_level(logging.INFO, logger="sidecar.pgwire"):
        for _ in range(30):
            with pytest.raises(psycopg.OperationalError):
                psycopg.connect(dsn(server.port, "wrong password"))
    assert server.auth_limiter.refusals_total == 27
    assert caplog.text.count("refusing 127.0.0.1 for 600 s after 3 failed") == 1
    assert caplog.text.count("authentication failed for user") == 3
