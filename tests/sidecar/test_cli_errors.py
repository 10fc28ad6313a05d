"""Ordinary mistakes with the `fern` command end in one line that names the input, never a traceback."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# Imported before anything else at start-up (it is on PYTHONPATH): hides the modules named in
# FERN_TEST_HIDE, as on an install without the extra that brings them.
_HIDER = """
import os, sys
for name in os.environ.get("FERN_TEST_HIDE", "").split(","):
    if name:
        sys.modules[name] = None  # `import name` now raises ModuleNotFoundError
"""


def fern_command() -> list[str]:
    script = Path(sys.executable).with_name("fern")
    if script.exists():
        return [str(script)]
    found = shutil.which("fern")
    return [found] if found else [sys.executable, "-m", "sidecar.cli"]


def fern(*args: str, env: dict[str, str] | None = None, stdin: str | None = None,
         timeout: float = 300) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "FERN_DEBUG"}
    full_env.update(env or {})
    return subprocess.run([*fern_command(), *args], capture_output=True, text=True, env=full_env,
                          input=stdin, timeout=timeout)


@pytest.fixture(scope="module")
def hiding_env(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("hide")
    (folder / "sitecustomize.py").write_text(_HIDER)
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path}


def assert_one_line_error(done: subprocess.CompletedProcess, starts: str) -> str:
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(starts), lines[0]
    return lines[0]


def test_version_is_the_installed_distributions():
    done = fern("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"fern {importlib.metadata.version('fern-embed')}"


def test_embed_local_with_a_missing_model_dir_names_the_path(tmp_path):
    missing = tmp_path / "no-such-model"
    line = assert_one_line_error(fern("embed", "--local", "--device", "cpu", "--model-dir", str(missing), "x"),
                                 "fern embed: ")
    assert str(missing) in line and "does not exist" in line


def test_debug_shows_the_traceback_instead(tmp_path):
    missing = str(tmp_path / "no-such-model")
    for done in (fern("--debug", "embed", "--local", "--device", "cpu", "--model-dir", missing, "x"),
                 fern("embed", "--local", "--device", "cpu", "--model-dir", missing, "x", "--debug"),
                 fern("embed", "--local", "--device", "cpu", "--model-dir", missing, "x",
                      env={"FERN_DEBUG": "1"})):
        assert done.returncode == 1
        assert "Traceback" in done.stderr and "FileNotFoundError" in done.stderr


def test_a_failing_adapter_verb_is_one_line_too(tmp_path):
    # No database answers on this socket directory: psycopg's two-line message becomes one line.
    done = fern("pg", "status", "--dsn", f"host={tmp_path} connect_timeout=5")
    line = assert_one_line_error(done, "fern pg status: ")
    assert str(tmp_path) in line


@pytest.mark.parametrize("hidden, argv, extra", [
    ("psycopg", ("pg", "status", "--dsn", "host=/nowhere"), "postgres"),
    ("qdrant_client", ("qdrant", "ingest", "--collection", "docs", "--qdrant", ":memory:", "RECORDS"), "qdrant"),
])
def test_a_missing_extra_says_which_to_install(hiding_env, tmp_path, hidden, argv, extra):
    records = tmp_path / "records.jsonl"
    records.write_text('{"id": 1, "text": "water"}\n')
    argv = tuple(str(records) if a == "RECORDS" else a for a in argv)
    done = fern(*argv, env={**hiding_env, "FERN_TEST_HIDE": hidden})
    line = assert_one_line_error(done, f"fern {argv[0]} {argv[1]}: ")
    assert hidden in line  # the adapter's own wording, or the CLI's stand-in's
    assert f"pip install 'fern-embed[{extra}]'" in line


def test_the_client_verbs_work_without_the_adapters_libraries(hiding_env):
    done = fern("--help", env={**hiding_env, "FERN_TEST_HIDE": "psycopg,qdrant_client,matplotlib"})
    assert done.returncode == 0, done.stderr
    assert "embed" in done.stdout and "pg" in done.stdout


def test_bench_without_the_benchmarks_package_says_where_it_lives(hiding_env):
    env = {**hiding_env, "FERN_TEST_HIDE": "benchmarks"}
    listed = fern("--help", env=env)
    assert listed.returncode == 0 and "bench" in listed.stdout
    line = assert_one_line_error(fern("bench", "--suite", "cpu", env=env), "fern bench: ")
    assert "in a checkout" in line and "make bench" in line


def test_debug_after_a_double_dash_is_a_text_to_embed(tmp_path):
    missing = str(tmp_path / "no-such-model")
    done = fern("embed", "--local", "--device", "cpu", "--model-dir", missing, "--", "--debug")
    assert_one_line_error(done, "fern embed: ")


def test_embed_with_no_texts_says_how_to_give_them():
    line = assert_one_line_error(fern("embed"), "fern embed: ")
    assert "TEXT" in line and "--file" in line and "-" in line


def test_a_bad_log_format_from_the_environment_is_one_line():
    done = fern("serve", "--port", "0", "--device", "cpu", env={"FERN_LOG_FORMAT": "xml"})
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "--log-format 'xml': text or json" in done.stderr


def test_demo_skips_an_adapter_whose_library_is_missing_and_names_the_extra(hiding_env):
    done = fern("demo", "--exit", "--only", "qdrant", "--port", "0", "--http-port", "0", "--device", "cpu",
                env={**hiding_env, "FERN_TEST_HIDE": "qdrant_client", "OMP_NUM_THREADS": "2"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("fern demo: qdrant: skipped: qdrant_client is not installed; this command needs the 'qdrant' "
            "extra: pip install 'fern-embed[qdrant]'") in done.stderr
    assert "Traceback" not in done.stderr and "fern: stopped" in done.stderr


def test_an_unknown_sparse_language_names_it_and_the_known_ones():
    line = assert_one_line_error(fern("embed", "--local", "--device", "cpu", "--sparse",
                                      "--sparse-language", "klingon", "x"), "fern embed: --sparse-language: ")
    assert "'klingon'" in line and "english" in line and "german" in line
    line = assert_one_line_error(fern("serve", "--device", "cpu", "--port", "0", "--sparse-language", "elvish"),
                                 "fern: --sparse-language: ")
    assert "'elvish'" in line and "english" in line


def test_sparse_language_of_a_running_sidecar_is_its_own():
    line = assert_one_line_error(fern("embed", "--sparse", "--sparse-language", "german", "x"),
                                 "fern embed: --sparse-language needs --local")
    assert "fern serve --sparse-language" in line
