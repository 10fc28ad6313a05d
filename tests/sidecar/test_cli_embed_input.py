"""`fern embed` takes texts from stdin and files (lines or JSONL) and says which texts reached the model's limit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

LONG = "word " * 300  # 300 words: past all-MiniLM-L6-v2's 256-token limit


def fern_command() -> list[str]:
    script = Path(sys.executable).with_name("fern")
    if script.exists():
        return [str(script)]
    found = shutil.which("fern")
    return [found] if found else [sys.executable, "-m", "sidecar.cli"]


def fern(*args: str, stdin: str | bytes | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "FERN_DEBUG"}
    return subprocess.run([*fern_command(), *args], capture_output=True, input=stdin, env=env,
                          text=not isinstance(stdin, bytes), timeout=300)


def test_texts_from_stdin_one_a_line(sidecar_target, client):
    done = fern("embed", "--target", sidecar_target, "-", stdin="first line\nsecond line\n")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    expected = client.embed(["first line", "second line"])
    np.testing.assert_allclose(np.array(out["vectors"], dtype=np.float32), expected.vectors, atol=1e-6)
    assert out["token_counts"] == list(expected.token_counts)
    assert out["truncated"] == [False, False] and done.stderr == ""


def test_texts_from_a_jsonl_file_after_the_arguments(sidecar_target, client, tmp_path):
    records = tmp_path / "docs.jsonl"
    records.write_text('{"id": 1, "text": "tea with milk"}\n\n{"id": 2, "text": "ünïcode ☕"}\n', encoding="utf-8")
    done = fern("embed", "--target", sidecar_target, "an argument", "--file", str(records), "--jsonl")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    expected = client.embed(["an argument", "tea with milk", "ünïcode ☕"]).vectors
    np.testing.assert_allclose(np.array(out["vectors"], dtype=np.float32), expected, atol=1e-6)


def test_stdin_is_read_as_utf8_whatever_the_locale(sidecar_target, client):
    done = fern("embed", "--target", sidecar_target, "-", stdin="naïve café\r\n".encode())
    assert done.returncode == 0, done.stderr
    expected = client.embed(["naïve café"]).vectors  # the CRLF ending is not part of the text
    np.testing.assert_allclose(np.array(json.loads(done.stdout)["vectors"], dtype=np.float32), expected, atol=1e-6)


def test_a_text_at_the_models_limit_is_flagged_and_named_on_stderr(sidecar_target):
    done = fern("embed", "--target", sidecar_target, "-", stdin=f"short\n{LONG}\n")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["token_counts"] == [3, 256]
    assert out["truncated"] == [False, True]
    assert "texts[1] reached all-MiniLM-L6-v2's limit of 256 tokens" in done.stderr
    assert "texts[0]" not in done.stderr


def test_no_truncate_refuses_instead_of_flagging(sidecar_target):
    done = fern("embed", "--target", sidecar_target, "--no-truncate", "short", LONG)
    assert done.returncode == 1
    assert "texts[1]" in done.stderr and "Traceback" not in done.stderr


def test_local_embed_flags_truncation_from_the_models_spec():
    done = fern("embed", "--local", "--device", "cpu", "-", stdin=f"{LONG}\nshort\n")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["truncated"] == [True, False]
    assert "texts[0] reached all-MiniLM-L6-v2's limit of 256 tokens" in done.stderr


def test_bad_input_files_name_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"title": "no text field"}\n')
    done = fern("embed", "--file", str(bad), "--jsonl")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert f"fern embed: --file '{bad}' line 2: needs a \"text\" string field" in done.stderr
    done = fern("embed", "--jsonl", "-", stdin='{"text": "fine"}\nnot json\n')
    assert done.returncode == 1 and "fern embed: stdin line 2: not JSON" in done.stderr
    missing = tmp_path / "missing.txt"
    done = fern("embed", "--file", str(missing))
    assert done.returncode == 1 and f"fern embed: --file '{missing}': No such file or directory" in done.stderr
    binary = tmp_path / "latin1.txt"
    binary.write_bytes("caf\xe9\n".encode("latin-1"))
    done = fern("embed", "--file", str(binary))
    assert done.returncode == 1 and f"--file '{binary}' is not UTF-8 text" in done.stderr
