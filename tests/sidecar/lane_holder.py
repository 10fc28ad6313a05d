"""Keeping a sidecar's BATCH lane full for a while, to see what a request that finds it full gets."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from sidecar.client import FernClient


@contextlib.contextmanager
def batch_lane_held(target: str, token: str, requests: int = 400) -> Iterator[threading.Thread]:
    """A gRPC stream of one-text requests, each of which waits for room (streams do), so the
    lane stays full until the stream ends; yields its thread, alive while the lane is held."""
    texts = [[f"bulk {i}: " + "word " * 16] for i in range(requests)]
    failed: list[BaseException] = []

    def stream() -> None:
        try:
            with FernClient(target, token=token, timeout=300) as client:
                for _ in client.embed_stream(texts, lane="batch"):
                    pass
        except BaseException as error:  # a failed hold fails the test below, with its reason
            failed.append(error)

    holder = threading.Thread(target=stream)
    holder.start()
    time.sleep(0.3)
    try:
        yield holder
    finally:
        holder.join(300)
        assert not failed, failed


def until_refused(holder: threading.Thread, send):
    """`send()` again until it raises or returns a refusal (the lane is full only while `holder` runs).

    `send` returns the refusal (anything but None) or None when it was served."""
    while holder.is_alive():
        refused = send()
        if refused is not None:
            return refused
        time.sleep(0.01)
    raise AssertionError("the BATCH lane never refused a request while a stream held it")
