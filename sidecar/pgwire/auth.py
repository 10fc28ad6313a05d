"""Who may talk to the Postgres endpoint: SCRAM-SHA-256 through scramp, and the per-peer limit on failed authentications."""
from __future__ import annotations

import base64
import secrets
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import scramp

SCRAM_ITERATIONS = 4096               # PostgreSQL's default scram_iterations
_MECHANISM = scramp.ScramMechanism("SCRAM-SHA-256")
# With channel binding (RFC 5929's tls-server-end-point, what PostgreSQL and libpq use): the
# proof also signs the hash of the certificate this server showed, so a man in the middle who
# terminates TLS with another certificate cannot relay the exchange.
_MECHANISM_PLUS = scramp.ScramMechanism("SCRAM-SHA-256-PLUS")
CHANNEL_BINDING = "tls-server-end-point"


class AuthenticationFailed(Exception):
    """The client's proof does not match the secret (or the exchange is malformed)."""


@dataclass(frozen=True)
class ScramVerifier:
    """What a server keeps of a password: salt, iteration count, StoredKey and ServerKey."""

    salt: bytes
    iterations: int
    stored_key: bytes
    server_key: bytes

    @classmethod
    def from_password(cls, password: str, *, salt: bytes | None = None,
                      iterations: int = SCRAM_ITERATIONS) -> ScramVerifier:
        salt_, stored_key, server_key, iterations_ = _MECHANISM.make_auth_info(
            password, iteration_count=iterations, salt=salt)
        return cls(salt_, iterations_, stored_key, server_key)

    @classmethod
    def for_passwords(cls, passwords: Sequence[str]) -> tuple[ScramVerifier, ...]:
        """One verifier a password, sharing one salt: the server-first message is sent
        before the client has shown which password it holds."""
        if not passwords or not all(passwords):
            raise ValueError("the Postgres endpoint needs a password (the sidecar's token); "
                             "it never accepts unauthenticated connections")
        salt = secrets.token_bytes(16)
        return tuple(cls.from_password(p, salt=salt) for p in passwords)


class ScramExchange:
    """One server-side exchange (RFC 5802 / RFC 7677): client-first -> server-first,
    client-final -> server-final; the proof is checked by scramp, in constant time.

    With several verifiers (tokens being rotated) the proof is checked against each, all
    of them every time, and any one that matches admits the client. `certificate` (the PEM of
    the certificate the TLS connection showed) makes it SCRAM-SHA-256-PLUS, bound to it."""

    def __init__(self, verifiers: ScramVerifier | Sequence[ScramVerifier],
                 nonce: str | None = None, *, certificate: str | None = None) -> None:
        if isinstance(verifiers, ScramVerifier):
            verifiers = (verifiers,)
        if not verifiers or len({(v.salt, v.iterations) for v in verifiers}) != 1:
            raise ValueError("a SCRAM exchange needs verifiers that share one salt")
        nonce = nonce or base64.b64encode(secrets.token_bytes(18)).decode()
        self.mechanism = "SCRAM-SHA-256-PLUS" if certificate else "SCRAM-SHA-256"
        mechanism = _MECHANISM_PLUS if certificate else _MECHANISM
        binding = (CHANNEL_BINDING, certificate) if certificate else None
        self._servers = [
            mechanism.make_server(
                lambda _user, v=v: (v.salt, v.stored_key, v.server_key, v.iterations),
                channel_binding=binding, s_nonce=nonce)
            for v in verifiers]

    def server_first(self, client_first: bytes) -> bytes:
        try:
            text = client_first.decode("utf-8")
            header, sep, bare = _split_gs2(text)
            # libpq always sends an empty user name ("n=", PostgreSQL takes the user from the
            # startup packet) and scramp refuses empty attributes: scramp parses a copy that
            # names someone, and the AuthMessage it signs is put back to the client's own bytes.
            named = bare.replace("n=,", "n=*,", 1) if bare.startswith("n=,") else bare
            firsts = set()
            for server in self._servers:
                server.set_client_first(header + sep + named)
                server.client_first_bare = bare
                firsts.add(server.get_server_first())
            (first,) = firsts    # one salt, one nonce: the same message from every verifier
            return first.encode()
        except (scramp.ScramException, UnicodeDecodeError, ValueError) as exc:
            raise AuthenticationFailed(f"malformed SCRAM client-first message: {exc}") from None

    def server_final(self, client_final: bytes) -> bytes:
        try:
            text = client_final.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise AuthenticationFailed(f"SCRAM proof refused: {exc}") from None
        accepted, refusal = None, None
        for server in self._servers:
            try:
                server.set_client_final(text)
                final = server.get_server_final()
                accepted = accepted or final
            except scramp.ScramException as exc:
                refusal = exc
        if accepted is None:
            raise AuthenticationFailed(f"SCRAM proof refused: {refusal}")
        return accepted.encode()


def _split_gs2(text: str) -> tuple[str, str, str]:
    """'n,,n=,r=…' -> ('n,', ',', 'n=,r=…'): the GS2 header and the bare message."""
    first = text.index(",")
    second = text.index(",", first + 1)
    return text[:second], ",", text[second + 1:]


@dataclass(frozen=True)
class AuthLimits:
    """The per-peer limit on failed authentications.

    A peer is one client IP address (as PostgreSQL's pg_hba and fail2ban-style limits
    count): every connection from 127.0.0.2 is one peer, whatever its port. After
    `delay_after` failures each further failure is answered only after a back-off that
    doubles from `delay_s` up to `max_delay_s`; after `refuse_after` failures the peer's
    new connections are refused for `refuse_s` seconds without trying the password. A
    success forgets the peer's failures; failures older than `window_s` are forgotten too.
    """

    delay_after: int = 3
    delay_s: float = 0.1
    max_delay_s: float = 2.0
    refuse_after: int = 10
    refuse_s: float = 60.0
    window_s: float = 600.0
    max_peers: int = 10_000           # the table's bound; the oldest peer is forgotten first


@dataclass
class _Peer:
    failures: int = 0
    last_failure: float = 0.0
    refused_until: float = 0.0


class FailedAuthLimiter:
    """Counts failed authentications per peer; `failures_total` and `refusals_total` are for metrics."""

    def __init__(self, limits: AuthLimits, clock=time.monotonic) -> None:
        self.limits = limits
        self._clock = clock
        self._peers: OrderedDict[str, _Peer] = OrderedDict()
        self.failures_total = 0
        self.refusals_total = 0
        self.held = 0  # failed authentications waiting out their back-off now (the server counts them)

    def refused_for(self, peer: str) -> float:
        """Seconds this peer is still refused for (0: it may try); counts a refusal."""
        state = self._peers.get(peer)
        left = 0.0 if state is None else state.refused_until - self._clock()
        if left > 0:
            self.refusals_total += 1
            return left
        return 0.0

    def failed(self, peer: str) -> float:
        """Record one failure; returns the back-off to wait before answering it."""
        now, limits = self._clock(), self.limits
        state = self._peers.pop(peer, None) or _Peer()
        if now - state.last_failure > limits.window_s:
            state.failures = 0
        state.failures += 1
        state.last_failure = now
        self.failures_total += 1
        if state.failures >= limits.refuse_after:
            state.refused_until = now + limits.refuse_s
        self._peers[peer] = state
        while len(self._peers) > limits.max_peers:
            self._peers.popitem(last=False)
        over = state.failures - limits.delay_after
        return 0.0 if over <= 0 else min(limits.delay_s * 2 ** (over - 1), limits.max_delay_s)

    def failures_of(self, peer: str) -> int:
        state = self._peers.get(peer)
        return 0 if state is None else state.failures

    def succeeded(self, peer: str) -> None:
        self._peers.pop(peer, None)

    @property
    def refused_peers(self) -> int:
        """How many peers are being refused now (a gauge)."""
        now = self._clock()
        return sum(1 for p in self._peers.values() if p.refused_until > now)

    # The names sidecar.metrics' auth families read, shared with the gRPC and HTTP doors' limiter.
    @property
    def refused_total(self) -> int:
        return self.refusals_total

    def locked_addresses(self) -> int:
        return self.refused_peers

    @property
    def held_calls(self) -> int:
        return self.held
