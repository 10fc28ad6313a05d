"""TLS settings, the bearer-token set and the failed-authentication limiter every door of the sidecar shares.

Only the standard library (`ssl`, `hmac`, `hashlib`) and gRPC's own credentials do any
cryptography here, so the client can import this module on a database host without torch.

    tls = TlsSettings.from_files("server.pem", "server.key", client_ca="clients-ca.pem")
    grpc_server.add_secure_port(target, tls.grpc_credentials())
    context = tls.server_ssl_context()          # HTTP, the Postgres endpoint, /metrics

    tokens = TokenSet(["s3cret"], file=Path("/etc/fern/tokens"))
    tokens.check("s3cret")                      # True; constant-time, whatever the token set
    tokens.reload()                             # on SIGHUP: rotation without a restart
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import logging
import os
import socket
import ssl
import stat
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

# A token shorter than this can be guessed faster than the limiter below can slow a guesser down.
MIN_TOKEN_CHARS = 16
# Addresses the failed-auth limiter remembers at most (a few MB even when full).
MAX_ADDRESSES = 10_000


# ----------------------------------------------------------------------------- TLS

def _read(path: Path, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"{what} {path}: {error.strerror or error}") from None


@dataclass(frozen=True)
class TlsSettings:
    """A server's certificate chain and key (PEM), and optionally the CA its clients' certificates must chain to.

    With `client_ca` set every door requires a client certificate (mutual TLS).
    """

    cert_file: Path
    key_file: Path
    client_ca_file: Path | None = None
    cert_chain: bytes = field(repr=False, default=b"")
    private_key: bytes = field(repr=False, default=b"")
    client_ca: bytes | None = field(repr=False, default=None)

    @classmethod
    def from_files(cls, cert: str | os.PathLike, key: str | os.PathLike,
                   client_ca: str | os.PathLike | None = None) -> "TlsSettings":
        """Read and check the PEM files now, so a wrong path fails at start with its name."""
        cert, key = Path(cert), Path(key)
        ca = Path(client_ca) if client_ca else None
        settings = cls(cert, key, ca, _read(cert, "--tls-cert"), _read(key, "--tls-key"),
                       _read(ca, "--tls-client-ca") if ca else None)
        settings.server_ssl_context()  # raises ssl.SSLError / ValueError on a mismatched or bad PEM
        return settings

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """Server credentials for `add_secure_port`; client certificates required when mutual."""
        return grpc.ssl_server_credentials([(self.private_key, self.cert_chain)],
                                           root_certificates=self.client_ca,
                                           require_client_auth=self.mutual)

    def server_ssl_context(self) -> ssl.SSLContext:
        """An `ssl.SSLContext` for an asyncio or ASGI listener (HTTP, Postgres endpoint, metrics)."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(self.cert_file, self.key_file)
        except ssl.SSLError as error:
            raise ValueError(f"--tls-cert {self.cert_file} / --tls-key {self.key_file}: {error}") from None
        if self.client_ca is not None:
            context.load_verify_locations(cadata=self.client_ca.decode())
            context.verify_mode = ssl.CERT_REQUIRED
        return context


class ServerTls:
    """The sidecar's certificate as every door serves it, re-read by `reload()` (SIGHUP).

    The HTTP, Postgres-protocol and metrics doors share one `ssl.SSLContext`, whose certificate
    is replaced in place; gRPC's credentials ask at each new handshake whether a newer one was
    loaded. Connections already open keep the certificate they were made with. A reload whose
    files do not load (missing, mismatched key) keeps the certificate being served.
    """

    def __init__(self, settings: TlsSettings) -> None:
        self.settings = settings
        self._context = settings.server_ssl_context()
        self._generation = 0  # bumped by each reload; gRPC's fetcher compares it with what it served
        self._served = 0

    # The TlsSettings attributes the doors read.
    mutual = property(lambda self: self.settings.mutual)
    cert_file = property(lambda self: self.settings.cert_file)
    key_file = property(lambda self: self.settings.key_file)
    client_ca_file = property(lambda self: self.settings.client_ca_file)

    def server_ssl_context(self) -> ssl.SSLContext:
        return self._context

    def certificate_pem(self) -> str:
        """The served certificate chain (PEM): the Postgres endpoint binds SCRAM to its first certificate."""
        return self.settings.cert_chain.decode()

    def grpc_credentials(self) -> grpc.ServerCredentials:
        def fetch():  # gRPC calls it before each new handshake; None keeps what it has
            if self._served == self._generation:
                return None
            self._served = self._generation
            return self._grpc_config()

        return grpc.dynamic_ssl_server_credentials(self._grpc_config(), fetch,
                                                   require_client_authentication=self.mutual)

    def _grpc_config(self):
        settings = self.settings
        return grpc.ssl_server_certificate_configuration([(settings.private_key, settings.cert_chain)],
                                                         root_certificates=settings.client_ca)

    def reload(self) -> None:
        """Read the same files again; raises ValueError (naming the file) and keeps the old ones if they fail."""
        old = self.settings
        new = TlsSettings.from_files(old.cert_file, old.key_file, old.client_ca_file)
        self._context.load_cert_chain(new.cert_file, new.key_file)
        if new.client_ca is not None:  # added to the trusted CAs; removing one takes a restart
            self._context.load_verify_locations(cadata=new.client_ca.decode())
        self.settings = new
        self._generation += 1


@dataclass(frozen=True)
class ClientTls:
    """What a client trusts (`ca_file`; None: the system's roots) and the certificate it shows, if any."""

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    server_name: str | None = None  # checked against the certificate instead of the target's host

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("a client certificate needs both tls_client_cert and tls_client_key")

    def grpc_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file, "tls_ca") if self.ca_file else None,
            private_key=_read(self.key_file, "tls_client_key") if self.key_file else None,
            certificate_chain=_read(self.cert_file, "tls_client_cert") if self.cert_file else None)

    def grpc_options(self) -> tuple[tuple[str, str], ...]:
        return (("grpc.ssl_target_name_override", self.server_name),) if self.server_name else ()

    def ssl_context(self) -> ssl.SSLContext:
        """A client-side `ssl.SSLContext` (hostname checked) for the HTTP and metrics doors."""
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH,
                                             cafile=str(self.ca_file) if self.ca_file else None)
        if self.cert_file is not None:
            context.load_cert_chain(self.cert_file, self.key_file)
        return context


# ----------------------------------------------------------------------------- tokens

def _digest(token: str | bytes) -> bytes:
    # Compared as fixed-length digests, so neither the tokens' lengths nor where they differ show in timing.
    return hashlib.sha256(token.encode() if isinstance(token, str) else token).digest()


def read_token_file(path: Path) -> list[str]:
    """The tokens in a file: one a line; blank lines and lines starting with '#' are skipped."""
    text = _read(path, "--token-file").decode()
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


class TokenSet:
    """The bearer tokens a door accepts: those given directly, plus a file's, re-read by `reload()`.

    Several tokens make rotation possible without downtime: add the new one, move the
    clients over, drop the old one. An empty set means authentication is off; a token file
    that holds no token refuses every call (it fails closed).
    """

    def __init__(self, tokens: Iterable[str] = (), file: str | os.PathLike | None = None) -> None:
        self._fixed = [t for t in tokens if t]
        self.file = Path(file) if file else None
        self._lock = threading.Lock()
        self._digests: tuple[bytes, ...] = ()
        self._from_file: list[str] = []
        if self.file is not None:
            self._from_file = read_token_file(self.file)
            _check_file_mode(self.file)
        self._rebuild()

    def _rebuild(self) -> None:
        digests = tuple(_digest(t) for t in (*self._fixed, *self._from_file))
        with self._lock:
            self._digests = digests

    @property
    def enabled(self) -> bool:
        return bool(self._fixed) or self.file is not None

    def __bool__(self) -> bool:
        return self.enabled

    def __len__(self) -> int:
        return len(self._digests)

    def values(self) -> list[str]:
        """The accepted tokens themselves, for a door that must hold them (SCRAM's stored keys)."""
        return [*self._fixed, *self._from_file]

    def first(self) -> str | None:
        """One accepted token (for a door that needs a single password)."""
        tokens = self.values()
        return tokens[0] if tokens else None

    def short_tokens(self) -> int:
        """How many tokens are shorter than MIN_TOKEN_CHARS."""
        return sum(len(t) < MIN_TOKEN_CHARS for t in (*self._fixed, *self._from_file))

    def check(self, presented: str | bytes | None) -> bool:
        """True when `presented` is one of the tokens; every token is compared (hmac.compare_digest)."""
        if not presented:
            return False
        given = _digest(presented)
        ok = False
        for digest in self._digests:  # no early exit: the time does not say which token matched
            ok |= hmac.compare_digest(given, digest)
        return ok

    def check_bearer(self, header: str | bytes | None) -> bool:
        """`check` on the token of an 'authorization: Bearer <token>' value (scheme case-insensitive)."""
        if not header:
            return False
        value = header.decode("latin-1") if isinstance(header, bytes) else header
        scheme, _, token = value.partition(" ")
        return scheme.lower() == "bearer" and self.check(token.strip())

    def reload(self) -> bool:
        """Re-read the token file; on a read error keep the current tokens and say so. True when re-read."""
        if self.file is None:
            return False
        try:
            tokens = read_token_file(self.file)
        except ValueError as error:
            log.warning("kept the current tokens: could not re-read %s", error)
            return False
        self._from_file = tokens
        self._rebuild()
        log.info("re-read %s: %d token(s) accepted", self.file, len(self))
        return True


def _check_file_mode(path: Path) -> None:
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("%s can be read by other users (mode %o): chmod 600 it", path, stat.S_IMODE(mode))


# ----------------------------------------------------------------------------- failed-auth limiter

def peer_address(peer: str) -> str:
    """The address part of a gRPC peer string: 'ipv4:10.0.0.5:5123' -> '10.0.0.5', 'ipv6:[::1]:5' -> '::1'."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    if kind == "ipv6":
        return rest.rsplit(":", 1)[0].strip("[]")
    return peer  # unix sockets and the like: the whole string


@dataclass
class _Record:
    failures: int = 0
    last: float = 0.0
    held: int = 0


@dataclass(frozen=True)
class LimiterConfig:
    """How failed authentications from one address are answered; see AuthLimiter."""

    free_failures: int = 5        # answered at once: a typo, a client started with an old token
    base_delay_s: float = 0.05    # the first held answer; each further failure doubles it
    max_delay_s: float = 1.0
    lockout_after: int = 20       # failures from an address before it is refused at once
    lockout_s: float = 60.0       # quiet time after which an address's failures are forgotten
    # A held call costs what gRPC buffers of its body meanwhile, its receive window (a fixed
    # 1 MiB, sidecar.server.RECEIVE_WINDOW_BYTES), so few are held: beyond these, the answer
    # comes at once.
    max_held_per_address: int = 2 # wrong-token calls of one address held at once
    max_held: int = 16            # wrong-token calls held at once, all addresses together


@dataclass(frozen=True)
class Verdict:
    """What to do with a call whose token was wrong: wait `delay_s`, then answer; `refused` names a limit."""

    delay_s: float
    refused: str | None = None


class AuthLimiter:
    """Per-address limit on failed authentications: answer at once, then back off, then refuse for a while.

    A peer is an IP address (as fail2ban counts), never a
    source port. A correct token is always let through, whatever its address did before:
    one client with a stale token behind a shared NAT address must not lock every other
    client out, and gRPC hands the interceptor no peer before the token is checked anyway.
    A wrong or missing token is answered without its request body ever being read:
    - the first `free_failures` at once;
    - then held for a back-off that doubles from `base_delay_s` up to `max_delay_s`
      (at most `max_held_per_address` such calls per address and `max_held` in all);
    - past `lockout_after` failures, or beyond those bounds, refused at once until the
      address has been quiet for `lockout_s`: nothing more is spent on it.
    The limiter bounds the work wrong tokens cause and slows a careless guesser; a long
    random token (32 bytes) is what makes guessing hopeless.
    """

    def __init__(self, config: LimiterConfig = LimiterConfig(), clock=time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._records: dict[str, _Record] = {}
        self._held = 0
        self.failures_total = 0
        self.refused_total = 0

    def _record(self, address: str, now: float) -> _Record:
        record = self._records.get(address)
        if record is None or now - record.last > self.config.lockout_s:
            record = self._records[address] = _Record()
        if len(self._records) > MAX_ADDRESSES:  # forget quiet addresses so a scan cannot grow the table
            for key in [k for k, r in self._records.items() if now - r.last > self.config.lockout_s]:
                del self._records[key]
        if len(self._records) > MAX_ADDRESSES:  # still a flood of fresh addresses: forget the older half
            by_age = sorted(self._records, key=lambda k: self._records[k].last)
            for key in by_age[:len(by_age) // 2]:
                if key != address and not self._records[key].held:
                    del self._records[key]
        return record

    def failed(self, address: str) -> Verdict:
        """Count a failed authentication from `address` and say how to answer it."""
        now = self._clock()
        record = self._record(address, now)
        record.failures += 1
        record.last = now
        self.failures_total += 1
        c = self.config
        if record.failures <= c.free_failures:
            return Verdict(0.0)
        if record.failures > c.lockout_after:
            self.refused_total += 1
            if record.failures == c.lockout_after + 1:
                log.warning("refusing wrong tokens from %s at once: %d failed authentications", address,
                            c.lockout_after)
            return Verdict(0.0, f"too many failed authentications from this address; "
                                f"refused until it has been quiet for {c.lockout_s:g} s")
        if record.held >= c.max_held_per_address or self._held >= c.max_held:
            self.refused_total += 1
            return Verdict(0.0, "too many failed authentications in progress from this address")
        delay = min(c.max_delay_s, c.base_delay_s * 2 ** (record.failures - c.free_failures - 1))
        return Verdict(delay)

    async def penalize(self, address: str) -> str | None:
        """What every door does with a wrong or missing token: count it, wait out its back-off.

        Returns the limit's sentence to add to the refusal, or None. Call it before reading
        the request's body, and answer 401 / UNAUTHENTICATED / 28P01 after it returns.
        """
        verdict = self.failed(address)
        if verdict.refused is None and verdict.delay_s:
            with self.hold(address):
                await asyncio.sleep(verdict.delay_s)
        return verdict.refused

    def hold(self, address: str) -> "_Hold":
        """A context manager counting a held answer against the bounds."""
        return _Hold(self, address)

    def locked_addresses(self) -> int:
        now = self._clock()
        return sum(r.failures > self.config.lockout_after and now - r.last <= self.config.lockout_s
                   for r in self._records.values())

    @property
    def held_calls(self) -> int:
        """Wrong-token calls being held for their back-off now."""
        return self._held


class _Hold:
    def __init__(self, limiter: AuthLimiter, address: str) -> None:
        self.limiter, self.address = limiter, address

    def __enter__(self) -> None:
        self.limiter._held += 1
        self.record = self.limiter._records.setdefault(self.address, _Record())
        self.record.held += 1

    def __exit__(self, *exc) -> None:
        self.limiter._held -= 1
        self.record.held -= 1


# ----------------------------------------------------------------------------- exposure

def is_loopback(host: str) -> bool:
    """True when every address `host` names is a loopback one (127/8, ::1, 'localhost')."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def exposure_warnings(listeners: Iterable[tuple[str, str, bool, bool]]) -> list[str]:
    """One sentence per listener `(name, host, has_tls, has_token)` that binds beyond loopback without both."""
    out = []
    for name, host, has_tls, has_token in listeners:
        if is_loopback(host):
            continue
        missing = [what for what, ok in (("TLS", has_tls), ("a token", has_token)) if not ok]
        if missing:
            out.append(f"{name} listens on {host}, beyond this host, without {' and without '.join(missing)}: "
                       "anyone who can reach it can use it" + (" and read its traffic" if not has_tls else "")
                       + " (set --tls-cert/--tls-key and --token-file, or --insecure to accept this)")
    return out


@dataclass
class DoorSecurity:
    """What every door of one sidecar shares: TLS settings, the token set and the failed-auth limiter.

    `ssl_context()` is the server-side context for the HTTP and Postgres-protocol doors
    (None without TLS); `reload()` is what SIGHUP does.
    """

    tls: ServerTls | None = None
    tokens: TokenSet = field(default_factory=TokenSet)
    limiter: AuthLimiter = field(default_factory=AuthLimiter)
    metrics_tokens: TokenSet = field(default_factory=TokenSet)

    def ssl_context(self) -> ssl.SSLContext | None:
        return None if self.tls is None else self.tls.server_ssl_context()

    def reload(self) -> None:
        """Tokens, then the certificate; a certificate that does not load is logged and the old one kept."""
        self.tokens.reload()
        self.metrics_tokens.reload()
        if self.tls is not None:
            try:
                self.tls.reload()
            except (ValueError, ssl.SSLError) as error:
                log.error("SIGHUP: the certificate was not reloaded, the old one is still served: %s", error)
            else:
                log.info("SIGHUP: certificate reloaded from %s", self.tls.cert_file)
