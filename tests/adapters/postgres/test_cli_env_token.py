"""Every `fern pg` flag has an environment twin; worker and vectorize send the sidecar's token; the worker reports."""

from __future__ import annotations

import re

import psycopg
import pytest
from cli_helpers import assert_one_line_error, fern_pg

VERBS = ["install", "vectorize", "worker", "status", "dev"]


def _options(help_text: str) -> dict[str, str]:
    """Each --flag of a --help page and the help text that follows it."""
    body = help_text.split("options:", 1)[1]
    found: dict[str, str] = {}
    current = None
    for line in body.splitlines():
        m = re.match(r"^  (-\w, )?(--[\w-]+)", line)
        if m:
            current = m.group(2)
            found[current] = line
        elif current:
            found[current] += " " + line.strip()
    return found


@pytest.mark.parametrize("verb", VERBS)
def test_every_flag_names_its_environment_twin(verb):
    out = fern_pg(verb, "--help")
    assert out.returncode == 0, out.stderr
    options = _options(out.stdout)
    options.pop("--help")
    assert options
    for flag, text in options.items():
        assert re.search(r"env FERN_[A-Z_]+", " ".join(text.split())), (verb, flag, text)


def test_model_is_a_served_model_name_read_from_fern_embed_model():
    text = " ".join(fern_pg("vectorize", "--help").stdout.split())
    assert "--model MODEL which served model, by name (env FERN_EMBED_MODEL" in text


@pytest.fixture
def posts(pg_db):
    with psycopg.connect(pg_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE posts (id int PRIMARY KEY, title text, body text)")
        conn.execute("INSERT INTO posts SELECT g, 'title ' || g, 'body ' || g "
                     "FROM generate_series(1, 10) g")
    return pg_db


def test_vectorize_and_worker_configured_by_the_environment_alone(posts, pg_target):
    env = {"FERN_PG_DSN": posts, "FERN_TARGET": pg_target, "FERN_PG_TEMPLATE": "{title}\\n{body}",
           "FERN_PG_TARGET_COLUMN": "vec", "FERN_PG_HYBRID": "1", "FERN_PG_LANGUAGE": "simple"}
    out = fern_pg("vectorize", "posts", env=env)
    assert out.returncode == 0, out.stderr
    assert "on public.posts.vec" in out.stdout and "10 row(s) queued" in out.stdout
    with psycopg.connect(posts) as conn:
        row = conn.execute("SELECT template, hybrid, language, target_column "
                           "FROM fern.vectorizers").fetchone()
    assert row == ("{title}\n{body}", True, "simple", "vec")

    worker = fern_pg("worker", env={**env, "FERN_PG_BATCH_SIZE": "3", "FERN_PG_ONCE": "1",
                                    "FERN_PG_PROGRESS": "off"})
    assert worker.returncode == 0, worker.stderr
    # 10 rows in batches of 3: four batches, and the final report says so, per vectorizer.
    assert "done: 10 row(s) embedded in 4 batch(es)" in worker.stderr, worker.stderr
    assert "public.posts.vec: 0 pending, 0 failed" in worker.stderr, worker.stderr
    with psycopg.connect(posts) as conn:
        assert conn.execute("SELECT count(*) FROM posts WHERE vec IS NULL").fetchone() == (0,)


def test_a_flag_beats_its_environment_twin(posts, pg_target):
    env = {"FERN_PG_DSN": posts, "FERN_TARGET": pg_target, "FERN_PG_COLUMNS": "title,body"}
    out = fern_pg("vectorize", "posts", "--column", "body", env=env)
    assert out.returncode == 0, out.stderr
    with psycopg.connect(posts) as conn:
        assert conn.execute("SELECT template FROM fern.vectorizers").fetchone() == ("{body}",)


def test_worker_and_vectorize_send_the_token(posts, sidecar_factory):
    side = sidecar_factory("--token", "s3cret")
    args = ["--dsn", posts, "--target", side.target]
    refused = fern_pg("vectorize", *args, "posts", "-c", "body")
    assert_one_line_error(refused, f"the sidecar at {side.target} refused the token", "--token",
                          "FERN_TOKEN")
    wrong = fern_pg("vectorize", *args, "posts", "-c", "body", "--token", "guess")
    assert_one_line_error(wrong, "refused the token")
    assert "guess" not in wrong.stderr

    ok = fern_pg("vectorize", *args, "posts", "-c", "body", "--token", "s3cret")
    assert ok.returncode == 0, ok.stderr
    # A worker without the token stops at once (a wrong token never heals) ...
    assert_one_line_error(fern_pg("worker", *args, "--once"), "refused the token")
    # ... and with it, from the environment, embeds the queue.
    done = fern_pg("worker", *args, "--once", env={"FERN_TOKEN": "s3cret"})
    assert done.returncode == 0, done.stderr
    assert "done: 10 row(s) embedded" in done.stderr
    with psycopg.connect(posts) as conn:
        assert conn.execute("SELECT count(*) FROM posts WHERE embedding IS NULL").fetchone() == (0,)


@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM"])
def test_a_running_worker_reports_as_rows_come_in(posts, pg_target, stop):
    import queue
    import signal
    import subprocess
    import threading
    import time

    from cli_helpers import clean_env, fern_command

    assert fern_pg("vectorize", "--dsn", posts, "--target", pg_target, "posts",
                   "-c", "body").returncode == 0
    # PYTHONFAULTHANDLER: a worker that does not stop dumps every thread's stack on SIGABRT below.
    # SIGINT as a terminal's Ctrl-C delivers it: a test run started in the background (`make test &`)
    # has SIGINT ignored, which its children inherit and Python then leaves ignored.
    worker = subprocess.Popen([*fern_command(), "pg", "worker", "--dsn", posts, "--target",
                               pg_target, "--report-every", "0.5"], stderr=subprocess.PIPE,
                              text=True, env=clean_env(PYTHONFAULTHANDLER="1"),
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in worker.stderr],
                              daemon=True)
    reader.start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while not any("10 row(s) embedded" in s and "done:" not in s for s in seen):
            assert time.monotonic() < deadline, seen
            try:
                seen.append(lines.get(timeout=1))
            except queue.Empty:
                pass
        assert any("worker started" in s for s in seen), seen
        assert any("public.posts.embedding: 0 pending, 0 failed" in s for s in seen), seen
        # Ctrl-C, or a service manager's SIGTERM: the worker stops and says what it did in all.
        worker.send_signal(getattr(signal, stop))
        try:
            code = worker.wait(60)
        except subprocess.TimeoutExpired:
            code = None
            worker.send_signal(signal.SIGABRT)  # where each of its threads is stuck, into its stderr
            worker.wait(30)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    reader.join(30)  # the pipe closes when the worker has exited
    rest = []
    while not lines.empty():
        rest.append(lines.get())
    assert code is not None, f"the worker did not stop within 60 s of {stop}:\n" + "".join(seen + rest)
    assert code == 0
    assert any("done: 10 row(s) embedded" in s for s in rest), seen + rest
    assert not any("Traceback" in s for s in seen + rest)
