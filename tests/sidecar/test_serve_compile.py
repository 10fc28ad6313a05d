"""`fern serve` does not wait for torch.compile: SERVING at once, the compiled engine taking over later.

A real `fern serve` on CPU with the compiler switched on (FERN_COMPILE=1, the "eager" backend so
no C++ toolchain is needed) and metrics on; checked over real gRPC and a real /metrics scrape.
"""

from __future__ import annotations

import re
import time
import urllib.request

import numpy as np

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
    with sidecar_process_class(["--metrics-port", "0"], env=COMPILING) as sidecar:
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


def test_compile_wait_reports_serving_only_once_compiled(sidecar_process_class) -> None:
    with sidecar_process_class(["--metrics-port", "0", "--compile-wait"], env=COMPILING) as sidecar:
        log = sidecar.log()
        assert "in the background" not in log
        assert compiled_gauge(log) == 1
