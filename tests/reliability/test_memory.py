"""The sidecar's memory is bounded by what it keeps, not by the size of hostile inputs: RSS of a real `fern serve`."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from sidecar.client import FernClient, FernError

MB = 2**20
TEN_MB = "word " * (2 * MB)  # 10 MiB of text, ~2 M tokens
# Measured on the 2-core CI host: peak and after both +164 MiB over the warmed-up baseline of
# 386 MiB (the 30 MB request itself, held by gRPC, protobuf and Python at once, and kept by the
# allocator for the next one); +256 MiB after in a full-suite run on a loaded host, where the
# allocator keeps more. Tokenizing these texts whole: peak +4,123 MiB, after +3,463 MiB.
PEAK_GROWTH_BOUND = 384 * MB
AFTER_GROWTH_BOUND = 320 * MB


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RSS from /proc")
def test_rss_after_hostile_long_texts_returns_near_its_baseline(sidecar_factory):
    sidecar = sidecar_factory()
    pid = sidecar.process.pid
    peak = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, rss_bytes(pid))
            time.sleep(0.01)

    with FernClient(sidecar.target, timeout=300) as client:
        # Warm every path the run takes (tokenizer threads, sparse, gRPC's buffers for 10 MB).
        client.embed(["warm " * 60_000], sparse=True)
        client.embed(["warm up"] * 64)
        time.sleep(0.5)
        baseline = rss_bytes(pid)
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            for _ in range(2):
                with pytest.raises(FernError) as refused:
                    client.embed([TEN_MB], truncate=False)
                assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
                assert "texts[0]:" in refused.value.message and "tokens exceeds the model's limit of 256" in refused.value.message
                with pytest.raises(FernError, match=r"texts\[1\]:.* tokens exceeds"):
                    client.embed(["short", TEN_MB, TEN_MB], truncate=False)
                kept = client.embed([TEN_MB, "word word"], sparse=True)
                assert kept.token_counts.tolist() == [256, 4]
                assert len(kept.sparse[0].indices) == 1  # one distinct term, counted over a bounded prefix
                # Mostly whitespace: it fits in the limit, so it embeds even with truncation off.
                sparse_text = " " * (10 * MB) + "word"
                fits = client.embed([sparse_text, "word"], truncate=False)
                np.testing.assert_allclose(fits.vectors[0], fits.vectors[1], atol=1e-5)
        finally:
            stop.set()
            sampler.join()
        time.sleep(1.0)
        after = rss_bytes(pid)
        assert client.embed(["still serving"]).vectors.shape == (1, 384)
    print(f"RSS baseline {baseline / MB:.0f} MiB, peak +{(peak - baseline) / MB:.0f} MiB, "
          f"after +{(after - baseline) / MB:.0f} MiB")
    assert peak - baseline < PEAK_GROWTH_BOUND, (baseline, peak)
    assert after - baseline < AFTER_GROWTH_BOUND, (baseline, after)
