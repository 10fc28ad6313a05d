"""`fern serve` on Unix sockets: gRPC (--uds, --no-tcp), the Postgres endpoint (--pg-socket-dir)
and HTTP (--http-uds), each socket file with its mode, stale ones replaced, removed on SIGTERM."""

from __future__ import annotations

import grp
import json
import os
import shutil
import socket
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import psycopg
import pytest
import trustme
from psycopg.conninfo import make_conninfo

from sidecar.client import FernClient
from sidecar.unixsocket import UnixSocket
from tests.conftest import fern_command
from tests.security.pgwire_harness import TOKEN as PG_TOKEN
from tests.security.pgwire_harness import endpoint, gateway, loop_thread  # noqa: F401
from tests.security.test_pgwire_tls import server_context
from tests.sidecar.test_metrics import listening_ports

TOKEN = "uds-door-secret"
TEXTS = ["a query over a Unix socket", "the same vectors as over TCP"]


@pytest.fixture(scope="module")
def socket_dir() -> Iterator[Path]:
    """A short directory under /tmp: a socket's path must fit in 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="fern-uds-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def every_door(sidecar_factory, socket_dir):
    """One sidecar with every door on TCP and on a socket file, default mode."""
    process = sidecar_factory("--token", TOKEN, "--uds", str(socket_dir / "grpc.sock"),
                              "--pg-port", "0", "--pg-socket-dir", str(socket_dir),
                              "--http-port", "0", "--http-uds", str(socket_dir / "http.sock"))
    yield process
    process.stop()


def mode_of(path: Path) -> int:
    info = os.lstat(path)
    assert stat.S_ISSOCK(info.st_mode), f"{path} is not a socket"
    return stat.S_IMODE(info.st_mode)


def serve(*args: str) -> subprocess.CompletedProcess:
    """`fern serve` with `args`, for start-ups that are refused before the models load."""
    return subprocess.run([*fern_command(), "serve", "--device", "cpu", *args],
                          capture_output=True, text=True, timeout=120)


def stale_socket(path: Path) -> None:
    """A socket file nobody listens on, as a process that died leaves it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.close()


def test_embed_over_unix_equals_tcp(every_door, socket_dir):
    target = f"unix:{socket_dir / 'grpc.sock'}"
    with FernClient(target, token=TOKEN, timeout=120) as over_unix, \
            FernClient(every_door.target, token=TOKEN, timeout=120) as over_tcp:
        got, want = over_unix.embed(TEXTS), over_tcp.embed(TEXTS)
    assert got.vectors.shape == (2, 384)
    np.testing.assert_array_equal(got.vectors, want.vectors)
    assert f"fern: gRPC on {target}" in every_door.log()


def test_fern_embed_takes_a_unix_target(every_door, socket_dir):
    target = f"unix:{socket_dir / 'grpc.sock'}"
    done = subprocess.run([*fern_command(), "embed", "--target", target, "--token", TOKEN, TEXTS[0]],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    with FernClient(target, token=TOKEN, timeout=120) as client:
        want = client.embed(TEXTS[:1]).vectors[0]
    np.testing.assert_allclose(json.loads(done.stdout)["vectors"][0], want, rtol=1e-6)


def test_tokens_still_apply_on_the_socket(every_door, socket_dir):
    from sidecar.client import FernError

    with FernClient(f"unix:{socket_dir / 'grpc.sock'}", timeout=60) as client:
        with pytest.raises(FernError, match="UNAUTHENTICATED"):
            client.embed(TEXTS)


def test_socket_files_are_owner_only_by_default(every_door, socket_dir):
    pg_socket = socket_dir / f".s.PGSQL.{every_door.pg_port}"
    for path in (socket_dir / "grpc.sock", socket_dir / "http.sock", pg_socket):
        assert mode_of(path) == 0o600, path


def test_psycopg_reaches_the_postgres_endpoint_through_the_socket_dir(every_door, socket_dir):
    dsn = make_conninfo("", host=str(socket_dir), port=str(every_door.pg_port), user="fern",
                        dbname="fern", password=TOKEN, connect_timeout="10")
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.info.host == str(socket_dir)  # libpq took the socket, not TCP
        (got,), = conn.execute("SELECT embed(%s)", [TEXTS[0]]).fetchall()
    vector = np.array([float(x) for x in got.strip("[]").split(",")], dtype=np.float32)
    with FernClient(every_door.target, token=TOKEN, timeout=120) as client:
        want = client.embed(TEXTS[:1]).vectors[0]
    np.testing.assert_allclose(vector, want, rtol=1e-5, atol=1e-6)


def test_http_over_the_socket(every_door, socket_dir):
    transport = httpx.HTTPTransport(uds=str(socket_dir / "http.sock"))
    with httpx.Client(transport=transport, timeout=120) as http:
        answer = http.post("http://fern/v1/embeddings", json={"input": TEXTS},
                           headers={"Authorization": f"Bearer {TOKEN}"})
        refused = http.post("http://fern/v1/embeddings", json={"input": TEXTS})
    assert answer.status_code == 200, answer.text
    assert refused.status_code == 401
    got = np.array([row["embedding"] for row in answer.json()["data"]], dtype=np.float32)
    with FernClient(every_door.target, token=TOKEN, timeout=120) as client:
        want = client.embed(TEXTS).vectors
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert every_door.http_url.startswith("http://127.0.0.1:")


def test_every_socket_file_is_gone_after_sigterm(every_door, socket_dir):
    files = [socket_dir / "grpc.sock", socket_dir / "http.sock", socket_dir / f".s.PGSQL.{every_door.pg_port}"]
    assert all(os.path.lexists(path) for path in files)
    assert every_door.terminate() == 0, every_door.log()
    assert [path for path in files if os.path.lexists(path)] == []


def test_no_tcp_mode_stale_socket_and_removal_on_sigterm(sidecar_factory, socket_dir):
    path = socket_dir / "only.sock"
    stale_socket(path)
    group = grp.getgrgid(os.getgid()).gr_name
    process = sidecar_factory("--no-tcp", "--uds", str(path), "--uds-mode", "0660", "--uds-group", group)
    try:
        assert process.target == f"unix:{path}"
        assert mode_of(path) == 0o660
        assert os.lstat(path).st_gid == os.getgid()
        assert listening_ports(process.process.pid) == set()
        with FernClient(process.target, timeout=120) as client:
            assert client.embed(TEXTS).vectors.shape == (2, 384)
    finally:
        status = process.terminate()
    assert status == 0, process.log()
    assert not os.path.lexists(path)
    process.stop()


def test_a_regular_file_at_the_path_is_refused(socket_dir):
    path = socket_dir / "not-a-socket"
    path.write_text("keep me")
    done = serve("--port", "0", "--uds", str(path))
    assert done.returncode != 0
    assert str(path) in done.stderr and "not a socket" in done.stderr, done.stderr
    assert path.read_text() == "keep me"


def test_a_socket_another_process_listens_on_is_refused(socket_dir):
    path = socket_dir / "taken.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as other:
        other.bind(str(path))
        other.listen()
        done = serve("--port", "0", "--uds", str(path))
    assert done.returncode != 0
    assert str(path) in done.stderr and "another process is listening" in done.stderr, done.stderr


@pytest.mark.parametrize("args, message", [
    (["--no-tcp"], "--no-tcp needs --uds"),
    (["--pg-socket-dir", "/tmp"], "--pg-socket-dir needs --pg-port"),
    (["--uds", "/tmp/fern-x.sock", "--http-uds", "/tmp/fern-x.sock"], "name the same path"),
    (["--pg-port", "0", "--token", TOKEN, "--pg-socket-dir", "/tmp/no-such-dir-here"], "not a directory"),
    (["--uds", "/tmp/fern-x.sock", "--uds-mode", "rw"], "'rw' is not an octal number"),
    (["--uds", "/tmp/fern-x.sock", "--uds-group", "no-such-group-here"], "'no-such-group-here': no such group"),
])
def test_bad_socket_flags_are_refused_clearly(args, message):
    done = serve("--port", "0", *args)
    assert done.returncode != 0
    assert message in done.stderr, done.stderr


def test_require_tls_holds_for_tcp_but_not_for_the_socket(endpoint, socket_dir):  # noqa: F811
    server = endpoint(ssl_context=server_context(trustme.CA()), require_tls=True,
                      socket_dir=UnixSocket(socket_dir))
    parts = {"user": "fern", "dbname": "fern", "password": PG_TOKEN, "connect_timeout": "30"}
    with psycopg.connect(make_conninfo("", host=str(socket_dir), port=str(server.port), **parts),
                         autocommit=True) as conn:
        assert conn.execute("SELECT embed('over the socket')").fetchone()[0].startswith("[")
    with pytest.raises(psycopg.OperationalError, match="requires TLS"):
        psycopg.connect(make_conninfo("", host="127.0.0.1", port=str(server.port), sslmode="disable", **parts))
    socket_file = server.unix_socket.path
    assert mode_of(socket_file) == 0o600
