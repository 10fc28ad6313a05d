"""HttpServer as a Sidecar extra, in this process: TLS and mutual TLS with a throwaway CA, drain, and the CLI flags."""

from __future__ import annotations

import asyncio
import ssl

import httpx
import pytest

from sidecar.cli import build_parser
from sidecar.http.app import bearer_checker
from sidecar.http.server import HttpServer
from sidecar.registry import ModelSource, Registry
from sidecar.server import Sidecar

trustme = pytest.importorskip("trustme")


@pytest.fixture(scope="module")
def registry_factory():
    """A fresh Registry of the bundled model on the CPU (a Sidecar closes its registry when it stops)."""
    return lambda: Registry.load([ModelSource(None)], device="cpu", tokenizer_processes=0)


def test_http_flags_and_their_environment_twins(monkeypatch):
    args = build_parser().parse_args(["serve"])
    assert args.http_port is None and args.http_host is None and args.http_max_body_bytes == 8 * 1024 * 1024
    monkeypatch.setenv("FERN_HTTP_PORT", "8080")
    monkeypatch.setenv("FERN_HTTP_HOST", "0.0.0.0")
    monkeypatch.setenv("FERN_HTTP_MAX_BODY_BYTES", "1000")
    args = build_parser().parse_args(["serve"])
    assert (args.http_port, args.http_host, args.http_max_body_bytes) == (8080, "0.0.0.0", 1000)
    assert build_parser().parse_args(["serve", "--http-port", "0"]).http_port == 0


def test_bearer_checker():
    check = bearer_checker("t0k")
    assert check("Bearer t0k")
    assert not check(None) and not check("") and not check("Bearer t0") and not check("t0k")


def test_https_and_mutual_tls_with_a_throwaway_ca(tmp_path, registry_factory):
    ca = trustme.CA()
    server_cert = ca.issue_cert("127.0.0.1", "localhost")
    client_cert = ca.issue_cert("client@example.com")
    cert, key, ca_file, client_pem = (tmp_path / n for n in ("server.pem", "server.key", "ca.pem", "client.pem"))
    server_cert.private_key_pem.write_to_path(str(key))
    server_cert.cert_chain_pems[0].write_to_path(str(cert))
    ca.cert_pem.write_to_path(str(ca_file))
    client_cert.private_key_and_cert_chain_pem.write_to_path(str(client_pem))

    async def main() -> None:
        sidecar = Sidecar(registry_factory(), port=0)
        https = HttpServer(sidecar.gateway, port=0, ssl_certfile=str(cert), ssl_keyfile=str(key),
                           ssl_ca_certs=str(ca_file), require_client_cert=True)
        sidecar.extras.append(https)
        await sidecar.start()
        try:
            assert https.url.startswith("https://127.0.0.1:")
            trusted = ssl.create_default_context(cafile=str(ca_file))
            trusted.load_cert_chain(str(client_pem))
            async with httpx.AsyncClient(verify=trusted, timeout=60) as client:
                answer = await client.post(https.url + "/v1/embeddings", json={"input": "over TLS"})
                assert answer.status_code == 200 and len(answer.json()["data"]) == 1
            no_client_cert = ssl.create_default_context(cafile=str(ca_file))
            async with httpx.AsyncClient(verify=no_client_cert, timeout=60) as client:
                with pytest.raises(httpx.HTTPError):  # the handshake, or the first read, fails
                    await client.post(https.url + "/v1/embeddings", json={"input": "no certificate"})
            async with httpx.AsyncClient(verify=True, timeout=60) as client:  # the system CAs do not know ours
                with pytest.raises(httpx.ConnectError):
                    await client.get(https.url + "/health")
        finally:
            await sidecar.stop(5)

    asyncio.run(main())


def test_stop_answers_the_request_in_flight_then_closes(registry_factory):
    async def main() -> None:
        sidecar = Sidecar(registry_factory(), port=0)
        door = HttpServer(sidecar.gateway, port=0)
        sidecar.extras.append(door)
        await sidecar.start()
        stopped = False
        try:
            async with httpx.AsyncClient(timeout=120) as client:
                texts = [f"text number {i} in a request big enough to be running when the drain starts"
                         for i in range(256)]
                in_flight = asyncio.ensure_future(client.post(door.url + "/v1/embeddings", json={"input": texts}))
                for _ in range(2000):  # bounded: 20 s at most for the request to reach the app
                    if door.app.in_flight:
                        break
                    await asyncio.sleep(0.01)
                assert door.app.in_flight == 1
                await sidecar.stop(60)
                stopped = True
                answer = await in_flight
                assert answer.status_code == 200 and len(answer.json()["data"]) == 256
                with pytest.raises(httpx.ConnectError):
                    await client.get(door.url + "/health")
        finally:
            if not stopped:
                await sidecar.stop(5)

    asyncio.run(main())
