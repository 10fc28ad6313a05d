"""`fern pg dev`: a PostgreSQL 18 + pgvector for development, in one command, until Ctrl-C."""

from __future__ import annotations

import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from adapters.postgres.embedded import EmbeddedPostgres, EmbeddedPostgresError, port_is_free


@dataclass(frozen=True)
class DevConfig:
    """Where the dev database keeps its data (None: a temporary directory) and its port."""

    data_dir: Path | None
    port: int


def run(config: DevConfig) -> int:
    """Start the server, print its DSN on stdout, serve until SIGINT/SIGTERM/SIGHUP, stop it.

    Returns 0 after a requested stop, 1 when the server exits by itself. Errors that stop
    it from starting are raised as EmbeddedPostgresError (the CLI prints them).
    """
    if config.port and not port_is_free(config.port):
        raise EmbeddedPostgresError(
            f"port {config.port} on 127.0.0.1 is in use (another PostgreSQL?): pass --port N "
            f"(env FERN_PG_DEV_PORT), or --port 0 for any free one")
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set())
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    pg = EmbeddedPostgres(port=config.port or None, data_dir=config.data_dir)
    try:
        pg.start()
        where = (f"data in {pg.pgdata} ({'new' if pg.initialized else 'existing'}, kept)"
                 if config.data_dir is not None else "a temporary directory, deleted on exit")
        print(f"fern pg dev: PostgreSQL 18 + pgvector on 127.0.0.1:{pg.port}, {where}; "
              f"log {pg.log_path}; Ctrl-C stops it", file=sys.stderr, flush=True)
        print(pg.dsn, flush=True)
        while not stop.wait(0.5):
            code = pg.exit_code()
            if code is not None:
                last = pg.log_tail().strip().splitlines()[-1:] or ["(empty log)"]
                print(f"fern pg dev: PostgreSQL exited by itself (status {code}): {last[0]}",
                      file=sys.stderr, flush=True)
                return 1
        pg.stop()
        print("fern pg dev: stopped", file=sys.stderr, flush=True)
        return 0
    finally:
        pg.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
