"""`fern demo`: with the sidecar up, run the Postgres and the Qdrant adapters' demos against it."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence

from sidecar.extras import EXTRAS, import_if_installed, missing_module_message

# Demo name -> module with a `run(target: str)` function that shows the adapter end to end.
DEMOS = {"postgres": "adapters.postgres.demo", "qdrant": "adapters.qdrant.demo"}


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run_demos(target: str, *, token: str | None = None,
              only: Sequence[str] | None = None) -> dict[str, float]:
    """Run each demo against the sidecar at `target`; returns seconds per demo.

    The token (if the sidecar needs one) reaches the demos' clients through FERN_TOKEN,
    which FernClient reads. A demo whose adapter, or a library it needs, is not installed is
    skipped with a note that names the extra to install;
    a demo that fails stops the run with its error.
    """

    if token:
        os.environ["FERN_TOKEN"] = token
    os.environ.setdefault("FERN_TARGET", target)
    timings: dict[str, float] = {}
    for name in only or DEMOS:
        module_name = DEMOS[name]
        started = time.perf_counter()
        try:
            module = import_if_installed(module_name)
            if module is None:
                _say(f"fern demo: {name}: {module_name} is not available here, skipped")
                continue
            _say(f"\n=== fern demo: {name} (sidecar at {target}) ===")
            module.run(target)
        except ModuleNotFoundError as error:  # the adapter is here, a library it needs is not
            if (error.name or "").partition(".")[0] not in EXTRAS:
                raise
            _say(f"fern demo: {name}: skipped: {missing_module_message(error)}")
            continue
        timings[name] = time.perf_counter() - started
        _say(f"=== {name} demo done in {timings[name]:.1f}s ===")
    return timings
