"""One `fern serve` with TLS and a token file: gRPC, HTTP and the Postgres endpoint all take the same settings, refuse what they should, and rotate tokens together on SIGHUP."""

from __future__ import annotations

import signal
import ssl
import time

import grpc
import numpy as np
import psycopg
import pytest

from sidecar.client import FernClient, FernError

openai = pytest.importorskip("openai")

OLD, NEW = "every-door-token-old-0123456789", "every-door-token-new-0123456789"


@pytest.fixture(scope="module")
def door_sidecar(sidecar_process_class, pki, tmp_path_factory):
    token_file = tmp_path_factory.mktemp("tokens") / "tokens"
    token_file.write_text(OLD + "\n")
    token_file.chmod(0o600)
    args = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
            "--token-file", str(token_file), "--http-port", "0", "--pg-port", "0", "--pg-require-tls"]
    with sidecar_process_class(args, client_kwargs={"tls_ca": str(pki.ca), "token": OLD}) as process:
        process.token_file = token_file
        yield process


def _grpc_vector(process, pki, token: str) -> np.ndarray:
    with FernClient(process.target, token=token, tls_ca=str(pki.ca), timeout=60) as client:
        return client.embed(["a door test"]).vectors[0]


def _https_vector(process, pki, token: str) -> np.ndarray:
    import httpx

    url = process.http_url.replace("http://", "https://")
    with httpx.Client(verify=ssl.create_default_context(cafile=str(pki.ca))) as http:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=token, http_client=http, max_retries=0)
        return np.asarray(client.embeddings.create(model="all-MiniLM-L6-v2", input="a door test",
                                                   encoding_format="float").data[0].embedding)


def _pg_vector(process, pki, token: str, sslmode: str = "verify-full") -> np.ndarray:
    dsn = (f"host=127.0.0.1 port={process.pg_port} user=fern dbname=fern password={token} "
           f"sslmode={sslmode} sslrootcert={pki.ca} connect_timeout=10")
    if sslmode != "disable":  # over TLS the SCRAM exchange is bound to the sidecar's certificate
        dsn += " channel_binding=require"
    with psycopg.connect(dsn, autocommit=True) as conn:
        text = conn.execute("SELECT embed('a door test')").fetchone()[0]
    return np.asarray([float(x) for x in text.strip("[]").split(",")])


def test_every_door_speaks_tls_with_one_token_and_gives_the_same_vector(door_sidecar, pki):
    assert door_sidecar.http_url and door_sidecar.pg_port
    reference = _grpc_vector(door_sidecar, pki, OLD)
    for vector in (_https_vector(door_sidecar, pki, OLD), _pg_vector(door_sidecar, pki, OLD)):
        assert float(np.dot(vector, reference)) > 0.99999


def test_every_door_refuses_a_wrong_token_and_plaintext(door_sidecar, pki):
    with pytest.raises(FernError) as info:
        _grpc_vector(door_sidecar, pki, "wrong-token-0123456789")
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(openai.AuthenticationError):
        _https_vector(door_sidecar, pki, "wrong-token-0123456789")
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        _pg_vector(door_sidecar, pki, "wrong-token-0123456789")
    with pytest.raises(psycopg.OperationalError, match="TLS"):
        _pg_vector(door_sidecar, pki, OLD, sslmode="disable")
    import httpx

    with pytest.raises(httpx.HTTPError):  # plaintext HTTP to the TLS port never gets an answer
        httpx.post(f"{door_sidecar.http_url}/embed", json={"inputs": "x"}, timeout=10)


def test_sighup_rotates_the_token_on_every_door(door_sidecar, pki):
    door_sidecar.token_file.write_text(NEW + "\n")
    door_sidecar.process.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 60
    while True:  # the re-read happens on the sidecar's loop: wait until gRPC sees it
        try:
            _grpc_vector(door_sidecar, pki, NEW)
            break
        except FernError:
            assert time.monotonic() < deadline, door_sidecar.log()[-3000:]
            time.sleep(0.2)
    _https_vector(door_sidecar, pki, NEW)
    _pg_vector(door_sidecar, pki, NEW)
    with pytest.raises(openai.AuthenticationError):
        _https_vector(door_sidecar, pki, OLD)
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        _pg_vector(door_sidecar, pki, OLD)
