"""The shared pieces without a server: the token set, the TLS settings and `fern serve`'s security flags."""

from __future__ import annotations

import ssl

import pytest

from sidecar.cli import build_parser
from sidecar.serve import door_security
from sidecar.security import ClientTls, TlsSettings, TokenSet


def test_any_of_several_tokens_is_accepted_and_nothing_else():
    tokens = TokenSet(["alpha-0123456789abcdef", "beta-0123456789abcdef"])
    assert tokens.check("alpha-0123456789abcdef") and tokens.check("beta-0123456789abcdef")
    for wrong in ("", None, "alpha", "alpha-0123456789abcdeF", "alpha-0123456789abcdef ", b"\xff"):
        assert not tokens.check(wrong)
    assert tokens.check_bearer("Bearer beta-0123456789abcdef")
    assert tokens.check_bearer("bearer beta-0123456789abcdef")  # the scheme is case-insensitive (RFC 7235)
    assert not tokens.check_bearer("Basic beta-0123456789abcdef")
    assert not tokens.check_bearer("beta-0123456789abcdef")


def test_a_token_file_is_reread_and_a_bad_reread_keeps_the_tokens(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("# comment\n\n  one-0123456789abcdef  \n")
    path.chmod(0o600)
    tokens = TokenSet(file=path)
    assert tokens.check("one-0123456789abcdef") and len(tokens) == 1
    path.write_text("two-0123456789abcdef\n")
    assert tokens.reload() and tokens.check("two-0123456789abcdef") and not tokens.check("one-0123456789abcdef")
    path.unlink()
    assert not tokens.reload() and tokens.check("two-0123456789abcdef")


def test_an_empty_token_file_refuses_everything(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("# no token yet\n")
    tokens = TokenSet(file=path)
    assert tokens.enabled and len(tokens) == 0 and not tokens.check("") and not tokens.check("x")


def test_serve_flags_build_the_shared_settings(pki, tmp_path):
    path = tmp_path / "tokens"
    path.write_text("from-file-0123456789abcdef\n")
    args = build_parser().parse_args(["serve", "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
                                      "--tls-client-ca", str(pki.ca), "--token", "a-0123456789abcdef",
                                      "--token", "b-0123456789abcdef", "--token-file", str(path)])
    assert args.token == "a-0123456789abcdef" and args.tokens == ["a-0123456789abcdef", "b-0123456789abcdef"]
    security = door_security(args)
    assert all(security.tokens.check(t) for t in ("a-0123456789abcdef", "b-0123456789abcdef",
                                                   "from-file-0123456789abcdef"))
    assert security.tls.mutual
    context = security.ssl_context()  # what the HTTP and Postgres doors are given
    assert isinstance(context, ssl.SSLContext) and context.verify_mode == ssl.CERT_REQUIRED


@pytest.mark.parametrize("flags, message", [
    (["--tls-cert", "{cert}"], "both --tls-cert and --tls-key"),
    (["--tls-client-ca", "{ca}"], "--tls-client-ca needs --tls-cert"),
    (["--tls-cert", "{cert}", "--tls-key", "/nonexistent/server.key"], "--tls-key /nonexistent/server.key"),
    (["--tls-cert", "{cert}", "--tls-key", "{ca}"], "--tls-cert"),  # a certificate is not a key
    (["--token-file", "/nonexistent/tokens"], "--token-file /nonexistent/tokens"),
])
def test_bad_security_flags_name_the_flag(pki, flags, message):
    flags = [f.format(cert=pki.server_cert, ca=pki.ca) for f in flags]
    with pytest.raises(SystemExit, match=message.replace("-", r"\-")):
        door_security(build_parser().parse_args(["serve", *flags]))


def test_the_client_needs_both_halves_of_a_certificate(pki):
    with pytest.raises(ValueError, match="both tls_client_cert and tls_client_key"):
        ClientTls(pki.ca, pki.client_cert, None)
    assert TlsSettings.from_files(pki.server_cert, pki.server_key).mutual is False
