"""`fern serve --compile-in-background`: SERVING at once, the compiled engine taking over later; without it,
SERVING once compiled.

A real `fern serve` on CPU with the compiler switched on (FERN_COMPILE=1, the "eager" backend so
no C++ toolchain is needed) and metrics on; checked over real gRPC and a real /metrics scrape.
"""

from __future__ import annotations

import os
import re
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from sidecar.client import FernClient

COMPILING = {"FERN_COMPILE": "1", "FERN_COMPILE_BACKEND": "eager"}
TEXTS = ["what is a vector database?", "Fern embeds text next to the database."]


def compiled_gauge(log: str) -> float | None:
    url = re.search(r"^fern: metrics on (\S+)", log, re.M).group(1)
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("fern_engine_compiled{")]
    return values[0] if values else None


def test_serving_starts_before_the_compile_and_the_compiled_engine_takes_over(sidecar_process_class) -> None:
    # The environment twin of --compile-in-background.
    with sidecar_process_class(["--metrics-port", "0"], env={**COMPILING, "FERN_COMPILE_IN_BACKGROUND": "1"}) as sidecar:
        log = sidecar.log()
        assert re.search(r"^fern: serving .* compiling all-MiniLM-L6-v2 in the background", log, re.M), log
        with FernClient(sidecar.target) as client:
            first = client.embed(TEXTS).vectors
            deadline = time.monotonic() + 120
            while compiled_gauge(sidecar.log()) != 1:
                assert time.monotonic() < deadline, sidecar.log()
                time.sleep(0.2)
            # The gauge is 1 once the compiled runner is ready, even with no step since: this call runs on it.
            second = client.embed(TEXTS).vectors
        assert "compiled runner ready" in sidecar.log()
    np.testing.assert_allclose(second, first, atol=1e-6)


def test_by_default_serving_is_reported_only_once_compiled(sidecar_process_class) -> None:
    with sidecar_process_class(["--metrics-port", "0"], env=COMPILING) as sidecar:
        log = sidecar.log()
        assert "in the background" not in log
        assert compiled_gauge(log) == 1


def test_cache_dir_points_the_compilers_caches_under_it_and_the_environment_wins(tmp_path, monkeypatch) -> None:
    from sidecar.cli import build_parser
    from sidecar.serve import point_caches

    environ = {k: v for k, v in os.environ.items()
               if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE")}
    monkeypatch.setattr(os, "environ", {**environ, "FLASHINFER_WORKSPACE_BASE": "/elsewhere"})  # none of it leaks
    args = build_parser().parse_args(["serve", "--cache-dir", str(tmp_path / "fern")])
    point_caches(Path(args.cache_dir))

    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "fern" / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "fern" / "inductor" / "triton")
    assert os.environ["FLASHINFER_WORKSPACE_BASE"] == "/elsewhere"
    assert (tmp_path / "fern" / "inductor" / "triton").is_dir() and (tmp_path / "fern" / "flashinfer").is_dir()


def test_an_unusable_cache_dir_is_named(tmp_path) -> None:
    from sidecar.serve import point_caches

    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit, match="--cache-dir .*file"):
        point_caches(tmp_path / "file")
