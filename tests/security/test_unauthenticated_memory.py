"""Wrong-token calls cost the sidecar no memory for their bodies: the token is checked before a byte of the body is read."""

from __future__ import annotations

import threading
from pathlib import Path

import grpc

from sidecar.client import FernClient, FernError

BODY_BYTES = 64 * 1024 * 1024
CALLS = 4


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM in /proc status")


def _reset_peak(pid: int) -> None:
    # "5" resets the peak resident set size (VmHWM) to the current one (Linux 4.0+).
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def test_wrong_token_bodies_are_never_received(token_sidecar):
    """Four concurrent 64 MB Embeds with a wrong token raise the sidecar's peak RSS by less than one body."""
    pid = token_sidecar.process.process.pid
    with FernClient(token_sidecar.target, token=token_sidecar.flag_token, timeout=120) as client:
        client.embed(["warm the path up"])
    _reset_peak(pid)
    before = _peak_rss_mb(pid)
    codes: list[grpc.StatusCode] = []
    big = ["x" * BODY_BYTES]

    def call() -> None:
        with FernClient(token_sidecar.target, token="wrong-token", timeout=120) as client:
            try:
                client.embed(big)
            except FernError as error:
                codes.append(error.code)

    threads = [threading.Thread(target=call) for _ in range(CALLS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    rise = _peak_rss_mb(pid) - before
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * CALLS
    assert rise < BODY_BYTES / 2**20, f"peak RSS rose {rise:.0f} MiB for {CALLS} refused bodies"
    with FernClient(token_sidecar.target, token=token_sidecar.flag_token, timeout=120) as client:
        assert len(client.embed(["still serving"])) == 1


def test_a_message_over_the_cap_is_refused_with_its_limit(token_sidecar):
    """The stated cap: a request over MAX_MESSAGE_BYTES gets RESOURCE_EXHAUSTED, even with a right token."""
    from sidecar.server import MAX_MESSAGE_BYTES
    from sidecar.wire import embedder_pb2 as pb
    from sidecar.wire import embedder_pb2_grpc as pb_grpc

    over = pb.EmbedRequest(texts=["y" * (MAX_MESSAGE_BYTES + 1024)])
    options = [("grpc.max_send_message_length", 2 * MAX_MESSAGE_BYTES)]
    with grpc.insecure_channel(token_sidecar.target, options=options) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        try:
            stub.Embed(over, metadata=(("authorization", f"Bearer {token_sidecar.flag_token}"),), timeout=120)
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert str(MAX_MESSAGE_BYTES) in error.details()
        else:
            raise AssertionError("a request over the cap was served")
