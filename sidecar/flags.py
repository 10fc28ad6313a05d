"""The FERN_* environment twins of the command-line flags, and when this `fern` process started.

`fern`'s parsers read a flag's default from its twin through these helpers, so a container
is configured without a command line.
"""

from __future__ import annotations

import os
import time

STARTED = time.monotonic()  # the first Fern module a `fern` process loads: start-up is counted from here


def env(name: str, default=None):
    return os.environ.get(f"FERN_{name}", default)


def env_int(name: str, default: int | None) -> int | None:
    value = env(name)
    if value in (None, ""):
        return default
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"fern: FERN_{name}={value!r} is not an integer") from None


def env_bool(name: str) -> bool:
    return (env(name, "") or "").strip().lower() in ("1", "true", "yes", "on")


def env_models() -> list[str]:
    # Several models in one variable: separated by commas.
    return [m for m in (env("MODEL", "") or "").split(",") if m.strip()]
