"""`fern qdrant ingest` as a user runs it: the real console script, stdin by default, one-line errors, FERN_ env twins."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
from pathlib import Path

import pytest

from adapters.qdrant.client import FernQdrantClient
from adapters.qdrant.ingest import point_id
from tests.conftest import fern_command

RECORDS = [{"id": f"r{i}", "text": f"record number {i} is about {['cars', 'tea', 'tides'][i % 3]}"}
           for i in range(7)]


def jsonl(records: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def fern(*args: str, stdin: str = "", env: dict[str, str] | None = None,
         timeout: float = 180) -> subprocess.CompletedProcess:
    """Run `fern ARGS` with no FERN_ variables but those in `env`; text stdin, captured output."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("FERN_", "QDRANT_"))}
    return subprocess.run([*fern_command(), *args], input=stdin, capture_output=True, text=True,
                          env={**clean, "OMP_NUM_THREADS": "1", **(env or {})}, timeout=timeout)


def one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """The single stderr line of a failed run; it must name every needle and show no traceback."""
    assert proc.returncode not in (0, None), proc
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def closed_port() -> int:
    """A loopback port nothing listens on (just bound and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def count(store: Path, collection: str = "docs") -> int:
    client = FernQdrantClient(path=str(store), fern="127.0.0.1:9")
    try:
        return client.count(collection).count
    finally:
        client.close()


def test_ingest_reads_stdin_when_no_file_is_given(sidecar_target, tmp_path):
    store = tmp_path / "qdrant"
    proc = fern("qdrant", "ingest", "--collection", "docs", "--qdrant", str(store),
                "--target", sidecar_target, stdin=jsonl(RECORDS))
    assert proc.returncode == 0, proc.stderr
    assert "ingested 7 rows into 'docs'" in proc.stdout
    proc = fern("qdrant", "ingest", "-", "--collection", "docs", "--qdrant", str(store),
                "--target", sidecar_target, stdin=jsonl(RECORDS))
    assert proc.returncode == 0, proc.stderr
    assert count(store) == 7
    client = FernQdrantClient(path=str(store), fern=sidecar_target)
    assert client.search("docs", RECORDS[4]["text"], k=1)[0].id == point_id("r4")
    client.close()


def test_a_qdrant_that_does_not_answer_is_one_line(sidecar_target):
    url = f"http://127.0.0.1:{closed_port()}"
    proc = fern("qdrant", "ingest", "--collection", "docs", "--qdrant", url,
                "--target", sidecar_target, stdin=jsonl(RECORDS))
    one_line_error(proc, url, "--qdrant")


def test_a_sidecar_that_does_not_answer_is_one_line(tmp_path):
    target = f"127.0.0.1:{closed_port()}"
    proc = fern("qdrant", "ingest", "--collection", "docs", "--qdrant", str(tmp_path / "q"),
                "--target", target, "--timeout", "5", stdin=jsonl(RECORDS))
    one_line_error(proc, target, "fern serve", "--target")


def test_missing_and_unreadable_files_are_one_line(sidecar_target, tmp_path):
    missing = tmp_path / "nope.jsonl"
    proc = fern("qdrant", "ingest", str(missing), "--collection", "docs", "--qdrant",
                str(tmp_path / "q"), "--target", sidecar_target)
    one_line_error(proc, str(missing))
    proc = fern("qdrant", "ingest", str(tmp_path), "--collection", "docs", "--qdrant",
                str(tmp_path / "q"), "--target", sidecar_target)
    one_line_error(proc, str(tmp_path))
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(jsonl(RECORDS[:3]).encode() + b'{"id": 9, "text": "\xff\xfe"}\n')
    proc = fern("qdrant", "ingest", str(binary), "--collection", "docs", "--qdrant",
                str(tmp_path / "q"), "--target", sidecar_target)
    one_line_error(proc, f"{binary}:4", "UTF-8")


def test_bad_json_lines_are_named_by_line_number(sidecar_target, tmp_path):
    store = tmp_path / "q"
    text = jsonl(RECORDS[:2]) + "\n" + '{"id": "x", "text": oops}\n'
    proc = fern("qdrant", "ingest", "--collection", "docs", "--qdrant", str(store),
                "--target", sidecar_target, stdin=text)
    one_line_error(proc, "<stdin>:4", "not valid JSON")
    source = tmp_path / "list.jsonl"
    source.write_text(jsonl(RECORDS[:1]) + "[1, 2]\n")
    proc = fern("qdrant", "ingest", str(source), "--collection", "docs", "--qdrant", str(store),
                "--target", sidecar_target)
    one_line_error(proc, f"{source}:2", "JSON object")


def test_a_missing_field_names_the_line_field_and_flag(sidecar_target, tmp_path):
    store = tmp_path / "q"
    records = RECORDS[:3] + [{"id": "r3", "body": "no text field here"}] + RECORDS[4:]
    proc = fern("qdrant", "ingest", "--collection", "docs", "--qdrant", str(store),
                "--target", sidecar_target, "--batch-size", "2", stdin=jsonl(records))
    one_line_error(proc, "<stdin>:4", "'text'", "--text")
    proc = fern("qdrant", "ingest", "--collection", "docs", "--qdrant", str(store),
                "--target", sidecar_target, "--id", "key", stdin=jsonl(RECORDS))
    one_line_error(proc, "<stdin>:1", "'key'", "--id")
    proc = fern("qdrant", "ingest", "--collection", "docs", "--qdrant", str(store),
                "--target", sidecar_target, "--text", "{title}: {text}", stdin=jsonl(RECORDS))
    one_line_error(proc, "<stdin>:1", "'title'", "--text")
    proc = fern("qdrant", "ingest", "--collection", "docs", "--qdrant", str(store),
                "--target", sidecar_target, stdin=jsonl([{"id": 1, "text": 42}]))
    one_line_error(proc, "<stdin>:1", "--text")


def test_model_is_a_served_name_from_fern_embed_model_not_fern_model(sidecar_target, tmp_path):
    store = tmp_path / "q"
    # FERN_MODEL is `fern serve`'s model directory: a client verb does not read it.
    proc = fern("qdrant", "ingest", "--collection", "docs", "--qdrant", str(store),
                "--target", sidecar_target, stdin=jsonl(RECORDS),
                env={"FERN_MODEL": str(tmp_path / "some-model-dir")})
    assert proc.returncode == 0, proc.stderr
    proc = fern("qdrant", "ingest", "--collection", "other", "--qdrant", str(store),
                "--target", sidecar_target, stdin=jsonl(RECORDS),
                env={"FERN_EMBED_MODEL": "no-such-model"})
    one_line_error(proc, "no-such-model")


def test_every_flag_has_a_fern_env_twin_shown_in_help(sidecar_target, tmp_path):
    proc = fern("qdrant", "ingest", "--help")
    assert proc.returncode == 0
    flat = " ".join(proc.stdout.split())
    flat = flat[flat.index("options:"):]  # the option list, past the usage summary
    flags = sorted(set(re.findall(r"(--[a-z][a-z-]+)", flat)) - {"--help"})
    assert {"--collection", "--model", "--token", "--target", "--qdrant"} <= set(flags)
    for flag in flags:
        # Each option's help text names its FERN_ variable.
        entry = flat[flat.index(flag):]
        following = re.search(r" --[a-z]", entry[len(flag):])
        entry = entry[:len(flag) + following.start()] if following else entry
        assert "FERN_" in entry, (flag, entry)
    assert "FERN_EMBED_MODEL" in flat and "FERN_TOKEN" in flat
    # And the twins work: no flags at all, everything from the environment.
    store = tmp_path / "q"
    proc = fern("qdrant", "ingest", stdin=jsonl(RECORDS), env={
        "FERN_QDRANT": str(store), "FERN_QDRANT_COLLECTION": "envdocs",
        "FERN_TARGET": sidecar_target, "FERN_QDRANT_BATCH_SIZE": "3"})
    assert proc.returncode == 0, proc.stderr
    assert count(store, "envdocs") == 7
    proc = fern("qdrant", "ingest", stdin=jsonl(RECORDS), env={
        "FERN_QDRANT": str(store), "FERN_QDRANT_COLLECTION": "envdocs",
        "FERN_TARGET": sidecar_target, "FERN_QDRANT_BATCH_SIZE": "many"})
    one_line_error(proc, "FERN_QDRANT_BATCH_SIZE", "many")


@pytest.fixture(scope="module")
def token_sidecar(sidecar_process_class):
    with sidecar_process_class(["--token", "ingest-secret"]) as process:
        yield process


def test_token_flag_and_env_reach_the_sidecar(token_sidecar, tmp_path):
    store = tmp_path / "q"
    base = ("qdrant", "ingest", "--collection", "docs", "--qdrant", str(store),
            "--target", token_sidecar.target)
    one_line_error(fern(*base, stdin=jsonl(RECORDS)), "--token", "FERN_TOKEN")
    one_line_error(fern(*base, "--token", "wrong", stdin=jsonl(RECORDS)), "--token")
    proc = fern(*base, "--token", "ingest-secret", stdin=jsonl(RECORDS))
    assert proc.returncode == 0, proc.stderr
    proc = fern(*base, stdin=jsonl(RECORDS), env={"FERN_TOKEN": "ingest-secret"})
    assert proc.returncode == 0, proc.stderr
    assert count(store) == 7
