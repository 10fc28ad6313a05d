"""TLS on the Postgres endpoint, with a throwaway CA made at test time (trustme) and libpq (psycopg) as the client: verify-full with the right CA, a wrong CA refused, plaintext refused when TLS is required, mutual TLS, and no plaintext accepted inside an upgrade."""

from __future__ import annotations

import os
import ssl
import struct

import psycopg
import pytest
import trustme
from psycopg.conninfo import make_conninfo

from tests.security.pgwire_harness import (TOKEN, closed_by_server, connect, endpoint,  # noqa: F401
                                           fields, gateway, loop_thread, startup_packet)

SSL_REQUEST = struct.pack("!II", 8, 80877103)


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def pem(ca, tmp_path_factory):
    """Paths of the CA's certificate, a stranger CA's, and a client certificate + key."""
    d = tmp_path_factory.mktemp("pki")
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    trustme.CA().cert_pem.write_to_path(str(d / "stranger.pem"))
    client = ca.issue_cert("fern-client")
    client.cert_chain_pems[0].write_to_path(str(d / "client.crt"))
    client.private_key_pem.write_to_path(str(d / "client.key"))
    os.chmod(d / "client.key", 0o600)  # libpq refuses a key others can read
    stranger_client = trustme.CA().issue_cert("intruder")
    stranger_client.cert_chain_pems[0].write_to_path(str(d / "intruder.crt"))
    stranger_client.private_key_pem.write_to_path(str(d / "intruder.key"))
    os.chmod(d / "intruder.key", 0o600)
    return {name: str(d / name) for name in ("ca.pem", "stranger.pem", "client.crt",
                                             "client.key", "intruder.crt", "intruder.key")}


def server_context(ca: trustme.CA, *, client_certs: bool = False) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1", "localhost").configure_cert(context)
    if client_certs:
        context.verify_mode = ssl.CERT_REQUIRED
        ca.configure_trust(context)
    return context


def dsn(port: int, **extra: str) -> str:
    parts = {"host": "127.0.0.1", "port": str(port), "user": "fern", "dbname": "fern",
             "password": TOKEN, "connect_timeout": "30", **extra}
    return make_conninfo("", **parts)


def embeds(conn: psycopg.Connection) -> bool:
    return conn.execute("SELECT embed('over TLS')").fetchone()[0].startswith("[")


def test_verify_full_with_the_right_ca_connects_encrypted(endpoint, ca, pem):
    server = endpoint(ssl_context=server_context(ca))
    with psycopg.connect(dsn(server.port, sslmode="verify-full", sslrootcert=pem["ca.pem"]),
                         autocommit=True) as conn:
        assert conn.pgconn.ssl_in_use
        assert embeds(conn)
    # localhost is in the certificate too.
    with psycopg.connect(dsn(server.port, host="localhost", hostaddr="127.0.0.1",
                             sslmode="verify-full", sslrootcert=pem["ca.pem"])) as conn:
        assert conn.pgconn.ssl_in_use


def test_a_wrong_ca_or_a_wrong_host_name_is_refused(endpoint, ca, pem):
    server = endpoint(ssl_context=server_context(ca))
    with pytest.raises(psycopg.OperationalError, match="certificate verify failed"):
        psycopg.connect(dsn(server.port, sslmode="verify-full", sslrootcert=pem["stranger.pem"]))
    with pytest.raises(psycopg.OperationalError, match="does not match host name"):
        psycopg.connect(dsn(server.port, host="db.example.com", hostaddr="127.0.0.1",
                            sslmode="verify-full", sslrootcert=pem["ca.pem"]))


def test_tls_offered_but_not_required_still_admits_plaintext(endpoint, ca):
    server = endpoint(ssl_context=server_context(ca))
    with psycopg.connect(dsn(server.port, sslmode="disable"), autocommit=True) as conn:
        assert not conn.pgconn.ssl_in_use and embeds(conn)
    with psycopg.connect(dsn(server.port, sslmode="prefer")) as conn:
        assert conn.pgconn.ssl_in_use        # libpq's default takes the TLS on offer


def test_require_tls_refuses_a_plaintext_startup_with_28000(endpoint, ca, pem):
    server = endpoint(ssl_context=server_context(ca), require_tls=True)
    with pytest.raises(psycopg.OperationalError, match="requires TLS"):
        psycopg.connect(dsn(server.port, sslmode="disable"))
    with connect(server.port) as s:
        s.sendall(startup_packet({"user": "fern"}))
        raw = closed_by_server(s)
    assert raw[:1] == b"E" and fields(raw[5:])["C"] == "28000"
    with psycopg.connect(dsn(server.port, sslmode="require"), autocommit=True) as conn:
        assert conn.pgconn.ssl_in_use and embeds(conn)


def test_require_tls_needs_a_certificate(gateway):
    from sidecar.pgwire import PgWireServer

    with pytest.raises(ValueError, match="cannot require TLS without a certificate"):
        PgWireServer(gateway, password=TOKEN, require_tls=True)


REFUSED = "SSL error|SSL SYSCALL error|server closed the connection unexpectedly"


def test_mutual_tls_refuses_a_client_without_a_certificate_or_with_a_strangers(endpoint, ca, pem):
    server = endpoint(ssl_context=server_context(ca, client_certs=True), require_tls=True)
    with psycopg.connect(dsn(server.port, sslmode="verify-full", sslrootcert=pem["ca.pem"],
                             sslcert=pem["client.crt"], sslkey=pem["client.key"]),
                         autocommit=True) as conn:
        assert conn.pgconn.ssl_in_use and embeds(conn)
    # The server ends the handshake when the certificate is missing or not from its CA. Under
    # TLS 1.3 the client has finished its side before the server checks the certificate, so
    # libpq reports the server's alert or the closed socket, whichever it reads first.
    with pytest.raises(psycopg.OperationalError, match=REFUSED):
        with psycopg.connect(dsn(server.port, sslmode="verify-full", sslrootcert=pem["ca.pem"],
                                 sslcertmode="disable")) as conn:
            conn.execute("SELECT 1")
    with pytest.raises(psycopg.OperationalError, match=REFUSED):
        with psycopg.connect(dsn(server.port, sslmode="verify-full", sslrootcert=pem["ca.pem"],
                                 sslcert=pem["intruder.crt"], sslkey=pem["intruder.key"])) as conn:
            conn.execute("SELECT 1")
    # A client certificate does not replace the password: SCRAM still runs.
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(dsn(server.port, sslmode="verify-full", sslrootcert=pem["ca.pem"],
                            sslcert=pem["client.crt"], sslkey=pem["client.key"],
                            password="not the token"))


def test_plaintext_sent_with_the_ssl_request_is_refused(endpoint, ca):
    server = endpoint(ssl_context=server_context(ca))
    with connect(server.port) as s:
        # An injected startup packet riding along with the SSLRequest (CVE-2021-23214's shape).
        s.sendall(SSL_REQUEST + startup_packet({"user": "fern"}))
        raw = closed_by_server(s)
    assert raw[:1] == b"S"
    err = fields(raw[6:])
    assert err["C"] == "08P01" and err["M"] == "received unencrypted data after SSL request"


def test_without_a_certificate_the_ssl_request_is_declined(endpoint, pem):
    server = endpoint()
    with connect(server.port) as s:
        s.sendall(SSL_REQUEST)
        assert s.recv(1) == b"N"
    with pytest.raises(psycopg.OperationalError, match="server does not support SSL"):
        psycopg.connect(dsn(server.port, sslmode="require"))


def _bound_context(ca: trustme.CA) -> tuple[ssl.SSLContext, str]:
    cert = ca.issue_cert("127.0.0.1", "localhost")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(context)
    return context, cert.cert_chain_pems[0].bytes().decode()


def test_scram_is_bound_to_the_tls_channel_when_the_client_asks(endpoint, ca, pem):
    context, certificate = _bound_context(ca)
    bound = endpoint(ssl_context=context, certificate=lambda: certificate)
    # libpq's channel_binding=require: SCRAM-SHA-256-PLUS over the certificate this TLS session showed.
    with psycopg.connect(dsn(bound.port, sslmode="verify-full", sslrootcert=pem["ca.pem"],
                             channel_binding="require"), autocommit=True) as conn:
        assert conn.pgconn.ssl_in_use and embeds(conn)
    # The default (prefer) binds too; a wrong password is still refused.
    with psycopg.connect(dsn(bound.port, sslmode="verify-full", sslrootcert=pem["ca.pem"]), autocommit=True) as conn:
        assert embeds(conn)
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(dsn(bound.port, sslmode="require", channel_binding="require", password="not the token"))
    # A certificate other than the one the session showed: the binding does not verify.
    _, stranger = _bound_context(ca)
    mismatched = endpoint(ssl_context=context, certificate=lambda: stranger)
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(dsn(mismatched.port, sslmode="require", channel_binding="require"))
    # Without a certificate to bind to, a client that requires binding refuses the server.
    unbound = endpoint(ssl_context=server_context(ca))
    with pytest.raises(psycopg.OperationalError, match="channel binding"):
        psycopg.connect(dsn(unbound.port, sslmode="require", channel_binding="require"))
