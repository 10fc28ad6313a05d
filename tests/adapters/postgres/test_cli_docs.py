"""docs/postgres.md's five-minute tour runs as written, against a real sidecar and `fern pg dev`."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from cli_helpers import clean_env, fern_command

DOC = Path(__file__).resolve().parents[3] / "docs" / "postgres.md"


def _blocks(section: str) -> list[tuple[str, str]]:
    """(language, code) of each fenced block in the doc's section titled `section`."""
    text = DOC.read_text()
    body = text.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(\w+)\n(.*?)```", body, flags=re.S)


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A fresh directory the unprivileged PostgreSQL user can reach when we run as root."""
    path = Path(tempfile.mkdtemp(prefix="fern-pg-tour-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_five_minute_tour_runs_as_written(workdir, pg_target):
    blocks = _blocks("Five minutes, start to finish")
    assert [lang for lang, _ in blocks] == ["sh", "sh", "python", "sh", "python"]
    start, export, make_table, commands, query = (code for _, code in blocks)
    assert "fern serve" in start
    dev_line = next(line for line in start.splitlines() if line.startswith("fern pg dev"))
    dev_args = shlex.split(dev_line.split("#")[0])[3:]
    assert dev_args == ["--dir", "./pgdata"]
    assert export.startswith("export FERN_PG_DSN=")

    # The sidecar is the tests' own; the database is `fern pg dev` as documented, on a free
    # port (5432 may be taken on a test machine).
    dev = subprocess.Popen([*fern_command(), "pg", "dev", *dev_args, "--port", "0"],
                           cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, env=clean_env())
    try:
        assert dev.stdout is not None
        dsn = dev.stdout.readline().strip()
        assert dsn.startswith("host=127.0.0.1 port="), dev.stderr.read() if not dsn else dsn
        env = clean_env(FERN_PG_DSN=dsn, FERN_TARGET=pg_target)
        bin_dir = str(Path(fern_command()[0]).parent)
        env["PATH"] = f"{bin_dir}:{env.get('PATH', '')}"
        for lang, code in [("python", make_table), ("sh", commands), ("python", query)]:
            argv = [sys.executable, "-c", code] if lang == "python" else ["bash", "-euc", code]
            out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300,
                                 cwd=workdir)
            assert out.returncode == 0, (code, out.stdout, out.stderr)
            assert "Traceback" not in out.stderr
        assert "Fern care" in out.stdout.splitlines()[0]
    finally:
        if dev.poll() is None:
            dev.terminate()
        dev.wait(90)
    assert dev.returncode == 0
    assert (workdir / "pgdata" / "PG_VERSION").exists()


def test_the_embedded_postgres_snippet_runs():
    code = next(code for lang, code in _blocks("A dev database: `fern pg dev`") if lang == "python")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env=clean_env())
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("18.")
