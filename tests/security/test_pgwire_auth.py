"""Who gets in to the Postgres endpoint: SCRAM-SHA-256 through scramp, several tokens at once and their rotation, and nothing about the secret in a refusal or the log."""

from __future__ import annotations

import logging

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from sidecar.pgwire import AuthenticationFailed, PgWireServer, ScramExchange, ScramVerifier
from tests.security.pgwire_harness import endpoint, gateway, loop_thread  # noqa: F401

OLD, NEW = "token-being-retired", "token-taking-over"


def dsn(port: int, password: str) -> str:
    return make_conninfo("", host="127.0.0.1", port=str(port), user="fern", dbname="fern",
                         password=password, connect_timeout="30", sslmode="disable")


def logs_in(port: int, password: str) -> bool:
    try:
        with psycopg.connect(dsn(port, password), autocommit=True) as conn:
            return conn.execute("SHOW server_version").fetchone()[0].endswith("(Fern)")
    except psycopg.OperationalError as exc:
        assert "password authentication failed" in str(exc)
        return False


def test_each_of_several_tokens_logs_in_and_rotation_retires_one(loop_thread, gateway):
    server = PgWireServer(gateway, "127.0.0.1", 0, [OLD, NEW])
    loop_thread.run(server.start())
    try:
        assert logs_in(server.port, OLD) and logs_in(server.port, NEW)
        assert not logs_in(server.port, "neither")
        with psycopg.connect(dsn(server.port, OLD), autocommit=True) as open_session:
            server.set_passwords([NEW])
            assert not logs_in(server.port, OLD)
            assert logs_in(server.port, NEW)
            # A session that logged in with the retired token goes on.
            assert open_session.execute("SELECT embed('still here')").fetchone()[0][0] == "["
    finally:
        loop_thread.run(server.stop(grace=1.0))


def test_a_server_without_a_token_is_refused(gateway):
    for password in ("", [], ["ok", ""]):
        with pytest.raises(ValueError, match="needs a password"):
            PgWireServer(gateway, password=password)


def test_an_exchange_needs_verifiers_with_one_salt():
    with pytest.raises(ValueError, match="share one salt"):
        ScramExchange([ScramVerifier.from_password("a"), ScramVerifier.from_password("b")])
    shared = ScramVerifier.for_passwords(["a", "b"])
    assert len({v.salt for v in shared}) == 1 and shared[0].stored_key != shared[1].stored_key


def test_the_proof_is_checked_by_scramp_in_constant_time():
    import inspect

    import scramp.core

    exchange = ScramExchange(ScramVerifier.for_passwords(["pencil"]))
    assert all(isinstance(s, scramp.core.ScramServer) for s in exchange._servers)
    assert "compare_digest" in inspect.getsource(scramp.core._set_client_final)
    with pytest.raises(AuthenticationFailed):
        exchange.server_final(b"c=biws,r=x,p=AAAA")    # before client-first: refused


def test_a_refusal_and_the_log_say_nothing_of_the_secret(endpoint, caplog):
    server = endpoint()
    from tests.security.pgwire_harness import TOKEN

    guess = "guess-" + TOKEN[:6]
    with caplog.at_level(logging.DEBUG, logger="sidecar.pgwire"):
        with pytest.raises(psycopg.OperationalError) as info:
            psycopg.connect(dsn(server.port, guess))
    assert 'password authentication failed for user "fern"' in str(info.value)
    for text in [str(info.value), caplog.text]:
        assert TOKEN not in text and guess not in text
    assert "authentication failed" in caplog.text
