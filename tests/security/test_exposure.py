"""The start-up warning for a door reachable beyond this host without TLS or a token, and `--insecure` that silences it."""

from __future__ import annotations

import os
import subprocess
import time

from sidecar.security import exposure_warnings, is_loopback

WARNING = "gRPC listens on 0.0.0.0, beyond this host, without TLS and without a token"


def _serve_all_interfaces(fern_cli, tmp_path, *flags: str, env: dict | None = None,
                          until: str = WARNING, timeout: float = 120) -> str:
    """Start `fern serve --host 0.0.0.0 --port 0`, read its log until `until` shows, stop it; no traffic is sent."""
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        process = subprocess.Popen([*fern_cli, "serve", "--host", "0.0.0.0", "--port", "0", "--device", "cpu",
                                    *flags], stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "OMP_NUM_THREADS": "2", **(env or {})})
    try:
        deadline = time.monotonic() + timeout
        while until not in log_path.read_text() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return log_path.read_text()
    finally:
        process.kill()
        process.wait()


def test_all_interfaces_without_tls_or_token_warns(fern_cli, tmp_path):
    log = _serve_all_interfaces(fern_cli, tmp_path)
    assert "WARNING" in log and WARNING in log and "--insecure" in log


def test_insecure_silences_the_warning(fern_cli, tmp_path):
    log = _serve_all_interfaces(fern_cli, tmp_path, env={"FERN_INSECURE": "1"}, until="fern: serving")
    assert "fern: serving" in log
    assert "beyond this host" not in log


def test_each_listener_is_judged_on_its_own():
    assert exposure_warnings([("gRPC", "127.0.0.1", False, False), ("gRPC", "::1", False, False),
                              ("gRPC", "localhost", False, False)]) == []
    assert exposure_warnings([("gRPC", "0.0.0.0", True, True)]) == []
    (tls_only,) = exposure_warnings([("gRPC", "0.0.0.0", True, False)])
    assert "without a token" in tls_only and "TLS" not in tls_only.split("without")[1]
    (token_only,) = exposure_warnings([("/metrics", "::", False, True)])
    assert token_only.startswith("/metrics listens on ::") and "without TLS" in token_only
    assert not is_loopback("0.0.0.0") and is_loopback("127.0.0.2")


def test_a_token_on_the_command_line_is_warned_about(token_sidecar):
    assert "/cmdline: prefer --token-file" in token_sidecar.process.log()
