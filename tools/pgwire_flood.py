"""Floods an in-process Postgres endpoint (bundled model, CPU) with 200 rapid wrong passwords and 300 idle unauthenticated connections, and says what happened.

    PYTHONPATH=TREE python tools/pgwire_flood.py --idle-wait 35 --label NAME [--out FILE]

Runs against whichever tree PYTHONPATH names, so the same flood shows the endpoint before
and after its limits (the default limits of that tree).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path

import psycopg

from sidecar.gateway import Gateway
from sidecar.pgwire import PgWireServer
from sidecar.registry import ModelSource, Registry
from sidecar.scheduler import SchedulerConfig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--idle-wait", type=float, default=35.0,
                    help="seconds to wait before counting the idle connections still open")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(120)

    registry = Registry.load([ModelSource(None)], device="cpu",
                             scheduler_config=SchedulerConfig.for_device("cpu"),
                             tokenizer_workers=1)
    run(registry.start())
    server = PgWireServer(Gateway(registry), "127.0.0.1", 0, "the-token")
    run(server.start())
    dsn = f"host=127.0.0.1 port={server.port} user=fern dbname=fern sslmode=disable"

    outcomes: dict[str, int] = {}
    started = time.monotonic()
    for _ in range(200):
        try:
            psycopg.connect(dsn + " password=wrong").close()
            key = "accepted"
        except psycopg.OperationalError as exc:
            text = str(exc)
            key = ("28P01 password authentication failed" if "password authentication" in text
                   else "28000 refused: too many failed attempts" if "too many failed" in text
                   else text[-80:])
        outcomes[key] = outcomes.get(key, 0) + 1
    wrong_s = time.monotonic() - started

    socks = []
    for i in range(300):
        s = socket.create_connection(("127.0.0.1", server.port))
        if i % 2:
            s.sendall(struct.pack("!I", 64))   # a startup length, then nothing
        s.setblocking(False)
        socks.append(s)
    time.sleep(args.idle_wait)
    still_open = 0
    for s in socks:
        try:
            while s.recv(65536):
                pass               # an error message; the close follows it
        except BlockingIOError:
            still_open += 1        # nothing more to read and not closed
        except ConnectionResetError:
            pass
        s.close()
    try:
        sidecar_path = Path(__import__("sidecar").__file__).resolve().parent.parent
        rev = subprocess.run(["git", "-C", str(sidecar_path), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True).stdout.strip() or "not a git tree"
    except OSError:
        rev = "unknown"
    result = {
        "command": f"PYTHONPATH=TREE python tools/pgwire_flood.py --idle-wait {args.idle_wait:g}"
                   + (f" --label {args.label}" if args.label else ""),
        "label": args.label, "tree": rev,
        "wrong_passwords": {"attempts": 200, "seconds": round(wrong_s, 2), "outcomes": outcomes},
        "idle_unauthenticated": {"connections": 300, "half_sent_a_length_only": True,
                                 "waited_s": args.idle_wait, "still_open": still_open},
    }
    try:
        with psycopg.connect(dsn + " password=the-token", autocommit=True) as conn:
            conn.execute("SHOW server_version")
        after = "accepted"
    except psycopg.OperationalError as exc:
        after = str(exc).rsplit(":", 1)[-1].strip()[:120]
    result["right_password_afterwards_from_the_same_peer"] = after
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
