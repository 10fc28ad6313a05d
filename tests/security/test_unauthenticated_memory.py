"""Wrong-token calls cost the sidecar no memory for their bodies: the token is checked before a byte of the body is read."""

from __future__ import annotations

import threading
from pathlib import Path

import grpc
import pytest

from sidecar.client import FernClient, FernError

BODY_BYTES = 64 * 1024 * 1024
CALLS = 4
TOKEN = "memory-suite-token-0123456789abcdef"


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM in /proc status")


def _reset_peak(pid: int) -> None:
    # "5" resets the peak resident set size (VmHWM) to the current one (Linux 4.0+).
    Path(f"/proc/{pid}/clear_refs").write_text("5")


@pytest.fixture(scope="module")
def memory_sidecar(sidecar_process_class):
    """A sidecar of its own: the failures counted for 127.0.0.1 are this module's alone."""
    with sidecar_process_class(["--token", TOKEN]) as process:
        yield process


# In order: the first 4 failures are answered at once; after 4 more, the next are held for the
# back-off (2 of them: the limit per address; the other 2 at once). A held call costs what gRPC
# reads of its body meanwhile: its receive window, a fixed 1 MiB. Both phases are bounded by
# half of one body: a sidecar that read the bodies would rise by CALLS whole ones.
BOUND_MIB = BODY_BYTES / 2**20 / 2


@pytest.mark.parametrize("phase, earlier_failures", [("answered at once", 0), ("held for the back-off", 4)])
def test_wrong_token_bodies_are_never_received(memory_sidecar, phase, earlier_failures):
    """Four concurrent 64 MB Embeds with a wrong token: the sidecar's peak RSS rises by a bound that is not the bodies'."""
    pid = memory_sidecar.process.pid
    with FernClient(memory_sidecar.target, token="wrong-token", timeout=120) as client:
        for _ in range(earlier_failures):
            with pytest.raises(FernError):
                client.list_models()
    with FernClient(memory_sidecar.target, token=TOKEN, timeout=120) as client:
        client.embed(["warm the path up"])
    _reset_peak(pid)
    before = _peak_rss_mb(pid)
    codes: list[grpc.StatusCode] = []
    big = ["x" * BODY_BYTES]

    def call() -> None:
        with FernClient(memory_sidecar.target, token="wrong-token", timeout=120) as client:
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
    assert rise < BOUND_MIB, f"{phase}: peak RSS rose {rise:.0f} MiB for {CALLS} refused bodies"
    print(f"{phase}: peak RSS rose {rise:.0f} MiB for {CALLS} refused {BODY_BYTES >> 20} MB bodies")
    with FernClient(memory_sidecar.target, token=TOKEN, timeout=120) as client:
        assert len(client.embed(["still serving"])) == 1


def test_a_message_over_the_cap_is_refused_with_its_limit(memory_sidecar):
    """The stated cap: a request over MAX_MESSAGE_BYTES gets RESOURCE_EXHAUSTED, even with a right token."""
    from sidecar.server import MAX_MESSAGE_BYTES
    from sidecar.wire import embedder_pb2 as pb
    from sidecar.wire import embedder_pb2_grpc as pb_grpc

    over = pb.EmbedRequest(texts=["y" * (MAX_MESSAGE_BYTES + 1024)])
    options = [("grpc.max_send_message_length", 2 * MAX_MESSAGE_BYTES)]
    with grpc.insecure_channel(memory_sidecar.target, options=options) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        try:
            stub.Embed(over, metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=120)
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert str(MAX_MESSAGE_BYTES) in error.details()
        else:
            raise AssertionError("a request over the cap was served")
