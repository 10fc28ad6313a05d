"""README's five-minute tour runs as written, against a real `fern serve` with its HTTP door, so README and code cannot drift apart.

The PostgreSQL part of the tour is docs/postgres.md's tour, block for block; that doc's own
test (tests/adapters/postgres/test_cli_docs.py) runs it against `fern pg dev`, and this test
checks README still shows exactly those blocks.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
POSTGRES_DOC = ROOT / "docs" / "postgres.md"
GRPC, HTTP = "127.0.0.1:50051", "http://127.0.0.1:8080"


def _blocks(text: str, section: str) -> list[tuple[str, str]]:
    body = text.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(\w+)\n(.*?)```", body, flags=re.S)


def _tour() -> list[tuple[str, str]]:
    return _blocks(README.read_text(), "A five-minute tour")


def _postgres_blocks() -> set[str]:
    return {code for _, code in _blocks(POSTGRES_DOC.read_text(), "Five minutes, start to finish")}


@pytest.fixture(scope="module")
def served(sidecar_factory):
    process = sidecar_factory("--http-port", "0")
    yield process
    process.stop()


def _run(argv: list[str], process, code: str) -> subprocess.CompletedProcess:
    bin_dir = str(Path(sys.executable).parent)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "FERN_TARGET": process.target, "HOME": str(ROOT),
           "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert done.returncode == 0, (code, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    return done


def test_the_tour_runs_as_written(served):
    blocks = _tour()
    postgres = _postgres_blocks()
    ran = 0
    for lang, code in blocks:
        if code in postgres:
            continue
        code = code.replace(GRPC, served.target).replace(HTTP, served.http_url)
        if lang == "sh":
            lines = [line for line in code.splitlines() if not line.startswith("fern serve")]
            if any(line.startswith("curl ") for line in lines) and shutil.which("curl") is None:
                pytest.skip("curl is not installed here")
            done = _run(["bash", "-euo", "pipefail", "-c", "\n".join(lines)], served, code)
            if "fern embed" in code:
                assert '"vectors"' in done.stdout
        else:
            done = _run([sys.executable, "-c", code], served, code)
        ran += 1
    assert ran >= 5  # the shell verbs, FernClient, the OpenAI SDK, curl, Qdrant


def test_the_postgres_part_is_the_tested_postgres_tour():
    postgres = _postgres_blocks()
    shown = [code for _, code in _tour() if "FERN_PG_DSN" in code or code.startswith("fern pg")
             or "fern pg dev" in code]
    assert shown, "README's tour shows no PostgreSQL part"
    for code in shown:
        assert code in postgres, f"README block not in docs/postgres.md's tested tour:\n{code}"


def test_the_first_block_starts_the_sidecar_readme_talks_to():
    lang, first = _tour()[0]
    assert lang == "sh" and first.startswith("fern serve --http-port 8080 &")
