"""SIGHUP reloads the certificate on every door (gRPC, HTTP, the Postgres endpoint, /metrics) without a restart; a certificate that does not load leaves the served one in place."""

from __future__ import annotations

import re
import signal
import socket
import ssl
import struct
import time

import trustme

from sidecar.client import FernClient

TOKEN = "reload-suite-token-0123456789abcdef"


def _issue(ca: trustme.CA, cert_path, key_path) -> int:
    """A new server certificate for 127.0.0.1 written over the files; returns its serial number."""
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert.private_key_pem.write_to_path(key_path)
    cert.cert_chain_pems[0].write_to_path(cert_path)
    from cryptography import x509

    return x509.load_pem_x509_certificate(cert.cert_chain_pems[0].bytes()).serial_number


def _serial(port: int, ca_file, *, alpn: str | None = None, postgres: bool = False) -> int:
    """The serial number of the certificate a door shows a new connection."""
    context = ssl.create_default_context(cafile=str(ca_file))
    if alpn:
        context.set_alpn_protocols([alpn])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
        if postgres:  # SSLRequest, then TLS on the same socket
            raw.sendall(struct.pack("!II", 8, 80877103))
            assert raw.recv(1) == b"S"
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            return int(tls.getpeercert()["serialNumber"], 16)


def _port(pattern: str, log: str) -> int:
    found = re.search(pattern, log, re.M)
    assert found, log[-2000:]
    return int(found.group(1))


def _wait_for(process, text: str, count: int) -> None:
    deadline = time.monotonic() + 30
    while process.log().count(text) < count:
        assert time.monotonic() < deadline, process.log()[-2000:]
        time.sleep(0.05)


def test_sighup_swaps_the_certificate_on_every_door(sidecar_process_class, tmp_path):
    ca = trustme.CA()
    ca_file, cert, key = tmp_path / "ca.pem", tmp_path / "server.pem", tmp_path / "server.key"
    ca.cert_pem.write_to_path(ca_file)
    first = _issue(ca, cert, key)
    args = ["--tls-cert", str(cert), "--tls-key", str(key), "--token", TOKEN, "--http-port", "0",
            "--pg-port", "0", "--metrics-port", "0"]
    with sidecar_process_class(args, client_kwargs={"tls_ca": str(ca_file)}) as process:
        log = process.log()
        doors = {
            "grpc": dict(port=int(process.target.rsplit(":", 1)[1]), alpn="h2"),
            "http": dict(port=_port(r"^fern: HTTP on https://127\.0\.0\.1:(\d+)", log)),
            "pgwire": dict(port=process.pg_port, postgres=True),
            "metrics": dict(port=_port(r"^fern: metrics on https://127\.0\.0\.1:(\d+)", log)),
        }
        assert {name: _serial(ca_file=ca_file, **door) for name, door in doors.items()} == dict.fromkeys(doors, first)
        with FernClient(process.target, token=TOKEN, tls_ca=str(ca_file), timeout=60) as before:
            assert len(before.embed(["before the reload"])) == 1

            second = _issue(ca, cert, key)
            process.process.send_signal(signal.SIGHUP)
            _wait_for(process, "certificate reloaded", 1)
            assert {name: _serial(ca_file=ca_file, **door) for name, door in doors.items()} == dict.fromkeys(doors, second)
            # A connection made before the reload goes on working; a new client gets the new certificate.
            assert len(before.embed(["after the reload, old connection"])) == 1
        with FernClient(process.target, token=TOKEN, tls_ca=str(ca_file), timeout=60) as after:
            assert len(after.embed(["after the reload, new connection"])) == 1

        # A key that does not match: logged, and the certificate being served stays.
        key.write_bytes(trustme.CA().issue_cert("127.0.0.1").private_key_pem.bytes())
        process.process.send_signal(signal.SIGHUP)
        _wait_for(process, "the certificate was not reloaded", 1)
        assert {name: _serial(ca_file=ca_file, **door) for name, door in doors.items()} == dict.fromkeys(doors, second)
        assert process.process.poll() is None
