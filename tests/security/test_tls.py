"""TLS on the gRPC door and on /metrics: the right CA connects, a wrong CA or plaintext does not, and mutual TLS refuses a client without a certificate."""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import pytest

from sidecar.client import AsyncFernClient, FernClient, FernError

TOKEN = "tls-suite-token-0123456789abcdef"


def _refused(**kwargs) -> grpc.StatusCode:
    with FernClient(timeout=10, **kwargs) as client:
        with pytest.raises(FernError) as info:
            client.embed(["should not be served"])
    return info.value.code


def _scrape(url: str, context: ssl.SSLContext | None, token: str | None = None) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, context=context, timeout=10) as response:
        return response.status


@pytest.fixture(scope="module")
def tls_sidecar(sidecar_process_class, pki):
    args = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key), "--token", TOKEN,
            "--metrics-port", "0", "--metrics-token", "metrics-token-0123456789"]
    with sidecar_process_class(args, client_kwargs={"tls_ca": str(pki.ca)}) as process:
        yield process


@pytest.fixture(scope="module")
def mtls_sidecar(sidecar_process_class, pki):
    args = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
            "--tls-client-ca", str(pki.ca), "--metrics-port", "0"]
    client = {"tls_ca": str(pki.ca), "tls_client_cert": str(pki.client_cert),
              "tls_client_key": str(pki.client_key)}
    with sidecar_process_class(args, client_kwargs=client) as process:
        yield process


def test_grpc_over_tls_with_the_right_ca(tls_sidecar, pki):
    with FernClient(tls_sidecar.target, token=TOKEN, tls_ca=pki.ca, timeout=60) as client:
        assert client.embed(["over TLS"]).vectors.shape == (1, 384)
    assert "(TLS)" in tls_sidecar.log()


def test_the_async_client_speaks_tls_too(tls_sidecar, pki):
    async def embed():
        async with AsyncFernClient(tls_sidecar.target, token=TOKEN, tls_ca=pki.ca, timeout=60) as client:
            return await client.embed(["async over TLS"])

    assert asyncio.run(embed()).vectors.shape == (1, 384)


def test_grpc_refuses_a_wrong_ca_and_plaintext(tls_sidecar, pki):
    assert _refused(target=tls_sidecar.target, token=TOKEN, tls_ca=pki.other_ca) == grpc.StatusCode.UNAVAILABLE
    assert _refused(target=tls_sidecar.target, token=TOKEN, tls=False) == grpc.StatusCode.UNAVAILABLE


def test_metrics_over_tls_with_its_token(tls_sidecar, pki, metrics_url):
    url = metrics_url(tls_sidecar)
    assert url.startswith("https://")
    right = ssl.create_default_context(cafile=str(pki.ca))
    assert _scrape(url, right, "metrics-token-0123456789") == 200
    with pytest.raises(urllib.error.HTTPError) as info:
        _scrape(url, right)
    assert info.value.code == 401 and info.value.headers["WWW-Authenticate"].startswith("Bearer")
    with pytest.raises(urllib.error.HTTPError) as info:
        _scrape(url, right, TOKEN)  # the gRPC token is not the metrics token
    assert info.value.code == 401
    with pytest.raises(urllib.error.URLError) as info:
        _scrape(url, ssl.create_default_context(cafile=str(pki.other_ca)), "metrics-token-0123456789")
    assert isinstance(info.value.reason, ssl.SSLCertVerificationError)


def test_mutual_tls_refuses_a_client_without_a_certificate(mtls_sidecar, pki):
    assert _refused(target=mtls_sidecar.target, tls_ca=pki.ca) == grpc.StatusCode.UNAVAILABLE
    with FernClient(mtls_sidecar.target, tls_ca=pki.ca, tls_client_cert=pki.client_cert,
                    tls_client_key=pki.client_key, timeout=60) as client:
        assert len(client.embed(["with a client certificate"])) == 1
    assert "client certificates required" in mtls_sidecar.log()


def test_mutual_tls_on_metrics(mtls_sidecar, pki, metrics_url):
    url = metrics_url(mtls_sidecar)
    bare = ssl.create_default_context(cafile=str(pki.ca))
    with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
        _scrape(url, bare)
    with_cert = ssl.create_default_context(cafile=str(pki.ca))
    with_cert.load_cert_chain(pki.client_cert, pki.client_key)
    assert _scrape(url, with_cert) == 200


def test_the_client_cli_flags_reach_a_tls_sidecar(mtls_sidecar, pki, fern_cli):
    out = subprocess.run([*fern_cli, "models", "--target", mtls_sidecar.target, "--tls-ca", str(pki.ca),
                          "--tls-client-cert", str(pki.client_cert), "--tls-client-key", str(pki.client_key)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)[0]["dimensions"] == 384
    env_out = subprocess.run([*fern_cli, "models", "--target", mtls_sidecar.target],
                             capture_output=True, text=True, timeout=120,
                             env={**os.environ, "FERN_TLS_CA": str(pki.ca),
                                  "FERN_TLS_CLIENT_CERT": str(pki.client_cert),
                                  "FERN_TLS_CLIENT_KEY": str(pki.client_key)})
    assert env_out.returncode == 0, env_out.stderr


def test_the_adapter_clis_take_the_tls_flags(tls_sidecar, pki, tmp_path):
    # `fern qdrant ingest` and `fern pg` reach a TLS sidecar through --tls-ca, as the client verbs do.
    records = tmp_path / "records.jsonl"
    records.write_text("".join(json.dumps({"id": f"r{i}", "text": f"record {i}"}) + "\n" for i in range(3)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FERN_")}
    base = [sys.executable, "-m", "sidecar.cli", "qdrant", "ingest", str(records), "--collection", "docs",
            "--qdrant", str(tmp_path / "q"), "--target", tls_sidecar.target, "--token", TOKEN]
    done = subprocess.run([*base, "--tls-ca", str(pki.ca)], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "ingested 3 rows into 'docs'" in done.stdout
    plaintext = subprocess.run(base, capture_output=True, text=True, env=env, timeout=120)
    assert plaintext.returncode != 0
    help_text = subprocess.run([sys.executable, "-m", "sidecar.cli", "pg", "worker", "--help"],
                               capture_output=True, text=True, env=env, timeout=60).stdout
    for flag in ("--tls-ca", "--tls-client-cert", "--tls-client-key", "--tls-server-name", "--token-file"):
        assert flag in help_text, flag
