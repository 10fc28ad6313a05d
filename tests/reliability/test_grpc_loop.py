"""A max-size request does not freeze the sidecar's event loop: health checks answer meanwhile (real `fern serve`)."""

from __future__ import annotations

import threading
import time

import pytest

from sidecar.client import FernClient
from sidecar.gateway import MAX_INPUTS

# Generous against the 2-core CI host's noise, far below what a loop held for the whole request
# gives (health checks waited 1.5-5.4 s there before long requests yielded).
HEALTH_BOUND_S = 1.0


@pytest.fixture(scope="module")
def sidecar(sidecar_factory):
    process = sidecar_factory()
    yield process
    process.stop()


@pytest.mark.slow
@pytest.mark.parametrize("sparse", [False, True])
def test_health_answers_during_a_max_size_request(sidecar, sparse):
    texts = [f"text number {i} about vectors, search and databases" for i in range(MAX_INPUTS)]
    waits: list[float] = []
    done = threading.Event()

    def ping() -> None:
        with FernClient(sidecar.target) as pinger:
            assert pinger.health()
            while not done.is_set():
                started = time.monotonic()
                assert pinger.health(timeout=60)
                waits.append(time.monotonic() - started)
                time.sleep(0.02)

    with FernClient(sidecar.target, timeout=600) as client:
        client.embed(texts[:512], sparse=sparse)  # warm the paths the big request takes
        pinger = threading.Thread(target=ping, daemon=True)
        pinger.start()
        time.sleep(0.3)
        try:
            result = client.embed(texts, sparse=sparse)
        finally:
            done.set()
            pinger.join()
    assert result.vectors.shape == (MAX_INPUTS, 384)
    assert len(waits) >= 5
    print(f"health waits during the request: max {max(waits):.3f} s over {len(waits)} checks")
    assert max(waits) < HEALTH_BOUND_S, sorted(waits)[-5:]
