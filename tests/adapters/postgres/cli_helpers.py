"""Running `fern pg …` as a user does: the console script in a subprocess, FERN_* unset unless given."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path


def fern_command() -> list[str]:
    """The `fern` console script of this environment (as tests/conftest.py finds it)."""
    script = Path(sys.executable).with_name("fern")
    if script.exists():
        return [str(script)]
    found = shutil.which("fern")
    return [found] if found else [sys.executable, "-m", "sidecar.cli"]


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any FERN_* variable, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FERN_")}
    return {**env, **extra}


def fern_pg(*args: str, env: dict[str, str] | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
    """`fern pg ARGS` with a clean environment; the caller checks the exit status."""
    return subprocess.run([*fern_command(), "pg", *args], capture_output=True, text=True,
                          timeout=timeout, env=clean_env(**(env or {})))


def assert_one_line_error(out: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit status 1, no traceback, one line on stderr that holds every needle; returns it."""
    assert out.returncode == 1, (out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]
