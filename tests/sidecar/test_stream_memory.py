"""EmbedStream against a real `fern serve`: bounded queue, bounded reading, bounded sidecar RSS."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from sidecar.client import FernClient

QUEUE_BOUND = 1024  # --max-queued-tokens-batch: small, so flow control is busy all along
MESSAGES = 1000
TEXTS_PER_MESSAGE = 4
# Each text is a short sentence padded with whitespace, which the tokenizer drops: every
# text costs the engine ~6 tokens, but the stream carries 40 MB, far more than gRPC's
# transport buffers held here (~11-17 MB), so a sidecar that read ahead would show it.
PAD = 10_000
# Over the warmed-up baseline while 40 MB stream through (measured: +57..62 MiB, most of it
# gRPC's own flow-control buffers; reading the whole stream ahead would exceed it).
RSS_GROWTH_BOUND = 128 * 2**20
HALF_GROWTH_BOUND = 32 * 2**20  # the second half of the stream may not grow the first half's peak
_DRAINED = re.compile(r"BATCH high water (\d+) of (\d+) tokens")


def text(i: int, j: int) -> str:
    return f"short text {i} {j}" + " " * PAD


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RSS from /proc")
def test_streaming_many_texts_keeps_queue_and_rss_bounded(sidecar_factory):
    sidecar = sidecar_factory(
        "--max-queued-tokens-batch", str(QUEUE_BOUND),
        "--max-step-tokens", "512",
        "--online-step-tokens", "128",
    )
    pid = sidecar.process.pid
    yielded = 0
    received = 0
    ahead = 0  # most requests the client had handed to gRPC but not yet had answered

    def items():
        nonlocal yielded, ahead
        for i in range(MESSAGES):
            yielded += 1
            ahead = max(ahead, yielded - received)
            yield str(i), [text(i, j) for j in range(TEXTS_PER_MESSAGE)]

    samples: list[tuple[int, int]] = []  # (responses received so far, RSS)
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append((received, rss_bytes(pid)))
            time.sleep(0.02)

    with FernClient(sidecar.target, timeout=300) as client:
        # Warm up every path the stream takes (tokenizer threads, step shapes, gRPC buffers).
        warm = [(str(i), [text(i, j) for j in range(TEXTS_PER_MESSAGE)]) for i in range(100)]
        assert sum(1 for _ in client.embed_stream(warm)) == 100
        baseline = rss_bytes(pid)
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        answered: dict[str, np.ndarray] = {}
        started = time.monotonic()
        try:
            for result in client.embed_stream(items()):
                assert result.error is None, result.error
                received += 1
                if int(result.request_id) % 250 == 0:
                    answered[result.request_id] = result.embeddings.vectors
                assert result.embeddings.vectors.shape == (TEXTS_PER_MESSAGE, 384)
        finally:
            stop.set()
            sampler.join()
        elapsed = time.monotonic() - started
        assert received == MESSAGES
        # Spot-check vectors against unary calls for the same texts.
        for request_id, vectors in answered.items():
            i = int(request_id)
            expected = client.embed([text(i, j) for j in range(TEXTS_PER_MESSAGE)]).vectors
            np.testing.assert_allclose(vectors, expected, rtol=0, atol=1e-5)

    assert sidecar.terminate() == 0
    drained = _DRAINED.search(sidecar.log())
    assert drained, sidecar.log()[-2000:]
    high_water, bound = map(int, drained.groups())
    assert bound == QUEUE_BOUND
    assert 0 < high_water <= QUEUE_BOUND  # queued tokens never passed the bound

    # The sidecar stopped reading while it had no room, so the client could not hand it
    # the stream far ahead of the answers: measured 281..415 of 1,000 requests (its window
    # of read-but-unanswered requests, the queue, and gRPC's transport windows, which grow
    # with the measured bandwidth). A sidecar reading eagerly would let it run nearly the
    # whole stream ahead: reading 40 MB takes well under a second, embedding it ~20 s.
    assert ahead < 0.75 * MESSAGES, f"client ran {ahead} requests ahead of {MESSAGES}"

    peak = max(r for _, r in samples)
    first = max((r for n, r in samples if n < MESSAGES // 2), default=baseline)
    second = max((r for n, r in samples if n >= MESSAGES // 2), default=baseline)
    report = (f"{MESSAGES * TEXTS_PER_MESSAGE} texts in {elapsed:.1f}s; RSS baseline "
              f"{baseline / 2**20:.0f} MiB, peak {peak / 2**20:.0f} MiB (first half "
              f"{first / 2**20:.0f}, second {second / 2**20:.0f}); client ahead by {ahead}")
    print(report)
    assert peak - baseline <= RSS_GROWTH_BOUND, report
    assert second <= first + HALF_GROWTH_BOUND, report
