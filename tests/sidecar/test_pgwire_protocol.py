"""Pure pieces of the Postgres endpoint: SCRAM-SHA-256 (scramp) against RFC 7677's example, startup packets, pgvector text."""

import base64
import hashlib
import hmac
import struct

import numpy as np
import pytest

from sidecar.pgwire import (AuthenticationFailed, ProtocolError, ScramExchange, ScramVerifier,
                            data_row, error_response, parse_startup, vector_text)

# RFC 7677, section 3: user "user", password "pencil".
RFC_SALT = base64.b64decode("W22ZaJ0SNY7soEsUEjb6gQ==")
RFC_CLIENT_FIRST = b"n,,n=user,r=rOprNGfwEbeRWgbNEkqO"
RFC_SERVER_NONCE = "%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0"
RFC_SERVER_FIRST = (b"r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,"
                    b"s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096")
RFC_CLIENT_FINAL = (b"c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,"
                    b"p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ=")
RFC_SERVER_FINAL = b"v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="


def rfc_exchange(password: str = "pencil") -> ScramExchange:
    return ScramExchange(ScramVerifier.from_password(password, salt=RFC_SALT), RFC_SERVER_NONCE)


def test_scram_matches_rfc_7677():
    exchange = rfc_exchange()
    assert exchange.server_first(RFC_CLIENT_FIRST) == RFC_SERVER_FIRST
    assert exchange.server_final(RFC_CLIENT_FINAL) == RFC_SERVER_FINAL


def test_scram_rejects_a_wrong_password():
    exchange = rfc_exchange("not pencil")
    exchange.server_first(RFC_CLIENT_FIRST)
    with pytest.raises(AuthenticationFailed, match="client keys don't match"):
        exchange.server_final(RFC_CLIENT_FINAL)


@pytest.mark.parametrize("client_final, reason", [
    (RFC_CLIENT_FINAL.replace(b"c=biws", b"c=eSws"), "channel bindings don't match"),
    (RFC_CLIENT_FINAL.replace(b"k0,p=", b"k1,p="), "nonce doesn't match"),
    (RFC_CLIENT_FINAL.split(b",p=")[0], "Malformed client final"),
    (RFC_CLIENT_FINAL[:-8] + b"AAAAAAA=", "client keys don't match"),
    (b"\xff" + RFC_CLIENT_FINAL, "SCRAM proof refused"),
])
def test_scram_rejects_tampered_messages(client_final, reason):
    exchange = rfc_exchange()
    exchange.server_first(RFC_CLIENT_FIRST)
    with pytest.raises(AuthenticationFailed, match=reason):
        exchange.server_final(client_final)


@pytest.mark.parametrize("client_first", [b"p=tls-server-end-point,,n=,r=abc", b"n,a=admin,n=,r=abc",
                                          b"n,,n=user", b"garbage", b"n,,n=,r=", b"\xff,,n=,r=a"])
def test_scram_refuses_channel_binding_authzid_and_junk(client_first):
    with pytest.raises(AuthenticationFailed):
        rfc_exchange().server_first(client_first)


def test_libpqs_empty_user_name_is_accepted_and_signed_as_sent():
    """libpq sends "n=" (PostgreSQL takes the user from the startup packet): the proof over
    the client's own bytes verifies (the client side computed here by hand, RFC 5802)."""
    nonce = "rOprNGfwEbeRWgbNEkqO"
    exchange = rfc_exchange()
    server_first = exchange.server_first(f"n,,n=,r={nonce}".encode()).decode()
    attrs = dict(part.split("=", 1) for part in server_first.split(","))
    salted = hashlib.pbkdf2_hmac("sha256", b"pencil", base64.b64decode(attrs["s"]), int(attrs["i"]))
    client_key = hmac.digest(salted, b"Client Key", "sha256")
    without_proof = f"c=biws,r={attrs['r']}"
    auth = f"n=,r={nonce},{server_first},{without_proof}".encode()
    signature = hmac.digest(hashlib.sha256(client_key).digest(), auth, "sha256")
    proof = base64.b64encode(bytes(a ^ b for a, b in zip(client_key, signature))).decode()
    final = exchange.server_final(f"{without_proof},p={proof}".encode())
    server_key = hmac.digest(salted, b"Server Key", "sha256")
    assert final == b"v=" + base64.b64encode(hmac.digest(server_key, auth, "sha256"))


def startup_body(params: dict[str, str], version: int = 3 << 16) -> bytes:
    body = b"".join(k.encode() + b"\0" + v.encode() + b"\0" for k, v in params.items())
    return struct.pack("!I", version) + body + b"\0"


def test_startup_packet_parses():
    packet = parse_startup(startup_body({"user": "fern", "database": "fern",
                                         "application_name": "fern.embed"}))
    assert (packet.major, packet.minor) == (3, 0)
    assert packet.parameters == {"user": "fern", "database": "fern", "application_name": "fern.embed"}
    assert parse_startup(startup_body({}, (3 << 16) | 2)).minor == 2


@pytest.mark.parametrize("body", [b"\0\3\0", startup_body({"user": "x"})[:-1],
                                  struct.pack("!I", 3 << 16) + b"user\0x\0dangling\0\0"])
def test_malformed_startup_packets_are_protocol_violations(body):
    with pytest.raises(ProtocolError) as info:
        parse_startup(body)
    assert info.value.sqlstate == "08P01"


def test_vector_text_gives_back_every_float32_exactly():
    rng = np.random.default_rng(0)
    row = np.concatenate([rng.standard_normal(1000), [1e-30, -3.4e38, 0.1, 1 / 3]]).astype("<f4")
    text = vector_text(row)
    assert text.startswith("[") and text.endswith("]") and " " not in text
    back = np.array([float(x) for x in text[1:-1].split(",")], dtype="<f4")
    assert np.array_equal(back, row)


def test_messages_are_length_prefixed():
    msg = data_row(["é", None])
    assert msg[:1] == b"D" and struct.unpack("!I", msg[1:5])[0] == len(msg) - 1
    assert msg[5:] == struct.pack("!H", 2) + struct.pack("!i", 2) + "é".encode() + struct.pack("!i", -1)
    err = error_response("22023", "texts[0]: empty text", position=3)
    assert b"C22023\0" in err and b"Mtexts[0]: empty text\0" in err and b"P3\0" in err
    assert err.endswith(b"\0\0")
