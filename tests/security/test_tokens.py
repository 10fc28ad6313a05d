"""Bearer tokens on the gRPC door and /metrics: missing, wrong, right (flag and file), rotated by SIGHUP; nothing of a secret in a message or the log."""

from __future__ import annotations

import signal
import subprocess
import time
import urllib.error
import urllib.request

import grpc
import pytest

from sidecar.client import FernClient, FernError

WRONG = "wrong-token-not-configured-42"


def _code(target: str, token: str | None, call: str = "embed") -> tuple[grpc.StatusCode, str]:
    with FernClient(target, token=token or "", timeout=60) as client:
        with pytest.raises(FernError) as info:
            if call == "embed":
                client.embed(["x"])
            elif call == "stream":
                list(client.embed_stream([["x"]]))
            else:
                client.list_models()
    return info.value.code, info.value.message


def test_health_needs_no_token(token_sidecar):
    with FernClient(token_sidecar.target, token="") as client:
        assert client.health()


@pytest.mark.parametrize("call", ["embed", "stream", "models"])
def test_missing_and_wrong_tokens_are_unauthenticated(token_sidecar, call):
    for token in (None, WRONG):
        code, message = _code(token_sidecar.target, token, call)
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert "Bearer <token>" in message
        for secret in (token_sidecar.flag_token, token_sidecar.file_token, WRONG):
            assert secret not in message


def test_every_configured_token_is_accepted(token_sidecar):
    for token in (token_sidecar.flag_token, token_sidecar.file_token):
        with FernClient(token_sidecar.target, token=token, timeout=60) as client:
            assert client.list_models()[0].dimensions == 384
            assert len(client.embed(["right token"])) == 1
            assert [r.error for r in client.embed_stream([["streamed"]])] == [None]


def test_the_client_reads_its_token_from_a_file(token_sidecar, fern_cli, tmp_path):
    path = tmp_path / "client-token"
    path.write_text(token_sidecar.flag_token + "\n")
    out = subprocess.run([*fern_cli, "models", "--target", token_sidecar.target, "--token-file", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_metrics_token(token_sidecar, metrics_url):
    url = metrics_url(token_sidecar.process)
    for header in ({}, {"Authorization": f"Bearer {WRONG}"}, {"Authorization": f"Bearer {token_sidecar.flag_token}"}):
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(urllib.request.Request(url, headers=header), timeout=10)
        assert info.value.code == 401
    right = urllib.request.Request(url, headers={"Authorization": f"Bearer {token_sidecar.metrics_token}"})
    with urllib.request.urlopen(right, timeout=10) as response:
        assert b"fern_auth_failures_total" in response.read()


def test_sighup_rereads_the_token_file(token_sidecar):
    """Rotation without downtime: the new file token works after SIGHUP, the old one stops, the flag token stays."""
    rotated = "rotated-token-0123456789abcdef"
    token_sidecar.token_file.write_text(f"{rotated}\n")
    token_sidecar.process.process.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 60
    with FernClient(token_sidecar.target, token=rotated, timeout=60) as client:
        while True:
            try:
                client.list_models()
                break
            except FernError as error:
                assert error.code == grpc.StatusCode.UNAUTHENTICATED
                assert time.monotonic() < deadline, "the rotated token was never accepted"
                time.sleep(0.2)
    assert _code(token_sidecar.target, token_sidecar.file_token)[0] == grpc.StatusCode.UNAUTHENTICATED
    with FernClient(token_sidecar.target, token=token_sidecar.flag_token, timeout=60) as client:
        assert len(client.embed(["still accepted"])) == 1
    assert "1 token(s)" not in token_sidecar.process.log()  # the flag token counts too
    assert "2 token(s) accepted" in token_sidecar.process.log()
    token_sidecar.file_token = rotated


def test_no_secret_in_the_log(token_sidecar):
    log = token_sidecar.process.log()
    for secret in (token_sidecar.flag_token, token_sidecar.file_token, token_sidecar.metrics_token, WRONG):
        assert secret not in log
