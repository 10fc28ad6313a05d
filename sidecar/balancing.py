"""Several sidecars behind one client channel: gRPC's own round_robin, retries and keepalive.

A target names one sidecar ("host:port", "unix:/path") or several: a comma-separated list
("10.0.0.1:50051,10.0.0.2:50051"), or a name gRPC resolves to many addresses and re-resolves
("dns:///fern.default.svc:50051", a headless Service in Kubernetes). For more than one
address the channel balances calls round-robin, and retries an Embed call that a sidecar
refused with UNAVAILABLE (down, draining) or RESOURCE_EXHAUSTED (queue full) on the next one,
and one it cancelled (a call that reaches a sidecar in the instant between its drain and its
connections closing is cancelled by gRPC's own shutdown; a call the caller cancels is never
retried): embedding is a pure function of its inputs, so a retried call cannot apply twice.
Streams are not retried (a stream that broke midway has already delivered results).
"""

from __future__ import annotations

import ipaddress
import json
import socket
from collections.abc import Sequence

SERVICE = "fern.v1.Embedder"
# Unary methods that may run again on another sidecar (all read-only or pure).
RETRYABLE_METHODS = ("Embed", "ListModels")
RETRY_POLICY = {
    "maxAttempts": 4,
    "initialBackoff": "0.05s",
    "maxBackoff": "1s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE", "RESOURCE_EXHAUSTED", "CANCELLED"],
}
# A ping every 30 s on a channel with calls in flight finds a dead peer (a host that vanished
# without closing its connections) within 40 s instead of the kernel's TCP timeout.
KEEPALIVE_OPTIONS = (
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 0),
)


def is_balanced(target: str) -> bool:
    """Whether `target` names several sidecars (a list, or a dns:/// name that may resolve to many)."""
    return "," in target or target.startswith("dns:")


def channel_target(target: str) -> str:
    """The gRPC target for `target`: a comma list becomes an ipv4:/ipv6: address list.

    Host names in a list are resolved once, here (use dns:/// for a name whose addresses change).
    """
    if "," not in target:
        return target
    addresses = [_address(part.strip(), target) for part in target.split(",") if part.strip()]
    families = {family for family, _ in addresses}
    if len(families) > 1:
        raise ValueError(f"target {target!r}: mixes IPv4 and IPv6 addresses; gRPC takes one family per list")
    return f"{families.pop()}:" + ",".join(address for _, address in addresses)


def _address(part: str, target: str) -> tuple[str, str]:
    host, sep, port = part.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"target {target!r}: {part!r} is not host:port")
    host = host.strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        try:
            info = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise ValueError(f"target {target!r}: cannot resolve {host!r} ({exc.strerror})") from None
        ip = ipaddress.ip_address(info[0][4][0])
    if ip.version == 6:
        return "ipv6", f"[{ip}]:{port}"
    return "ipv4", f"{ip}:{port}"


def service_config(*, retries: bool = True) -> str:
    """The channel's service config: round_robin, and the retry policy for the pure unary methods."""
    config: dict = {"loadBalancingConfig": [{"round_robin": {}}]}
    if retries:
        config["methodConfig"] = [{"name": [{"service": SERVICE, "method": m} for m in RETRYABLE_METHODS],
                                   "retryPolicy": RETRY_POLICY}]
    return json.dumps(config)


def channel_options(target: str, *, retries: bool = True) -> tuple[tuple[str, object], ...]:
    """Channel options for `target`: keepalive always; round_robin and retries where it is balanced."""
    options: list[tuple[str, object]] = list(KEEPALIVE_OPTIONS)
    if is_balanced(target):
        options += [("grpc.service_config", service_config(retries=retries)), ("grpc.enable_retries", 1)]
    return tuple(options)


def server_options(max_connection_age_s: float | None) -> list[tuple[str, int]]:
    """Server options for balanced clients: a max connection age so they re-resolve and rebalance,
    and pings accepted at the clients' keepalive rate."""
    options = [("grpc.http2.min_recv_ping_interval_without_data_ms", 20_000),
               ("grpc.keepalive_permit_without_calls", 1)]
    if max_connection_age_s:
        options += [("grpc.max_connection_age_ms", int(max_connection_age_s * 1000)),
                    ("grpc.max_connection_age_grace_ms", 30_000)]
    return options


def split_targets(targets: Sequence[str] | str) -> str:
    """Several targets given one by one (repeated --target flags) as one comma list."""
    return targets if isinstance(targets, str) else ",".join(targets)
