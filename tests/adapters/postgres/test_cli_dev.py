"""`fern pg dev`: a dev database in one command that prints its DSN, stops cleanly and keeps its data."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import psycopg
import pytest
from cli_helpers import assert_one_line_error, clean_env, fern_command, fern_pg

START_S = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Dev:
    """`fern pg dev ARGS` in a subprocess; `.dsn` is the first line it prints on stdout."""

    def __init__(self, *args: str):
        self.process = subprocess.Popen([*fern_command(), "pg", "dev", *args],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, env=clean_env())
        assert self.process.stdout is not None
        # readline blocks until the line or EOF; the start is bounded by the server's own timeout.
        self.dsn = self.process.stdout.readline().strip()
        if not self.dsn:
            self.process.wait(30)
            raise AssertionError(f"no DSN; status {self.process.returncode}: "
                                 f"{self.process.stderr.read()}")

    def postmaster_pid(self) -> int:
        with psycopg.connect(self.dsn) as conn:
            data = conn.execute("SHOW data_directory").fetchone()[0]
        return int(Path(data, "postmaster.pid").read_text().split()[0])

    def terminate(self) -> tuple[int, str]:
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(90)
        return code, self.process.stderr.read()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def reachable(tmp_path_factory) -> Path:
    """A fresh directory the unprivileged PostgreSQL user can reach when we run as root
    (pytest's own temporary directories are private to root)."""
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="fern-pg-dev-test-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    return state == "Z"


def _wait_gone(pid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not _gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_dev_keeps_its_data_and_leaves_no_postgres_behind(reachable):
    data = reachable / "db"
    port = _free_port()
    dev = Dev("--dir", str(data), "--port", str(port))
    try:
        assert dev.dsn == f"host=127.0.0.1 port={port} user=postgres dbname=postgres"
        with psycopg.connect(dev.dsn, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION vector")
            conn.execute("CREATE TABLE kept (id int PRIMARY KEY, v vector(2))")
            conn.execute("INSERT INTO kept VALUES (1, '[1,2]')")
        pid = dev.postmaster_pid()
        code, err = dev.terminate()
    finally:
        dev.kill()
    assert code == 0, err
    assert "Traceback" not in err and "stopped" in err
    # The postmaster went with it: stopped, not orphaned.
    assert _gone(pid)
    assert not (data / "postmaster.pid").exists()

    again = Dev("--dir", str(data), "--port", str(port))
    try:
        with psycopg.connect(again.dsn) as conn:
            assert conn.execute("SELECT id, v::text FROM kept").fetchall() == [(1, "[1,2]")]
        code, err = again.terminate()
    finally:
        again.kill()
    assert code == 0, err
    assert "existing" in err


def test_dev_without_a_directory_dies_with_its_parent():
    dev = Dev("--port", "0")
    try:
        with psycopg.connect(dev.dsn) as conn:
            data = Path(conn.execute("SHOW data_directory").fetchone()[0])
        pid = dev.postmaster_pid()
        assert data.exists()
        # A killed `fern pg dev` (no chance to clean up) still takes its server with it.
        dev.process.kill()
        dev.process.wait(30)
    finally:
        dev.kill()
    assert _wait_gone(pid), f"postgres {pid} outlived its parent"


def test_dev_on_a_port_in_use(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = fern_pg("dev", "--dir", str(tmp_path / "db"), "--port", str(port), timeout=60)
    assert_one_line_error(out, f"port {port} on 127.0.0.1 is in use", "--port", "FERN_PG_DEV_PORT")
    assert out.stdout == ""


def test_dev_on_a_directory_that_holds_something_else(reachable):
    (reachable / "notes.txt").write_text("not a database")
    out = fern_pg("dev", "--dir", str(reachable), "--port", "0", timeout=60)
    assert_one_line_error(out, f"data directory '{reachable}' is not empty", "no PG_VERSION")
    assert (reachable / "notes.txt").read_text() == "not a database"


def test_dev_as_root_under_a_private_directory_says_what_to_do(reachable):
    if os.geteuid() != 0:
        pytest.skip("only root runs PostgreSQL as another user")
    private = reachable / "private"
    private.mkdir(mode=0o700)
    out = fern_pg("dev", "--dir", str(private / "db"), "--port", "0", timeout=60)
    assert_one_line_error(out, f"cannot enter '{private}'", "chmod o+x")
