"""The per-address limit on failed authentications: 200 rapid wrong tokens end in refusals, and right tokens still work."""

from __future__ import annotations

import re
import time
import urllib.request

import grpc

from sidecar.client import FernClient, FernError
from sidecar.security import AuthLimiter, LimiterConfig, peer_address

ATTEMPTS = 200


def test_200_wrong_tokens_back_off_then_are_refused(token_sidecar, relay, metrics_url):
    """From 127.0.0.2 (through a relay): answered at once, then held, then refused; a right token works from both addresses."""
    config = LimiterConfig()
    attacker = relay(token_sidecar.target)
    messages: list[str] = []
    started = time.monotonic()
    with FernClient(attacker.target, token="guess", timeout=60) as client:
        for _ in range(ATTEMPTS):
            try:
                client.list_models()
            except FernError as error:
                assert error.code == grpc.StatusCode.UNAUTHENTICATED
                messages.append(error.message)
    elapsed = time.monotonic() - started
    refused = [m for m in messages if "too many failed authentications" in m]
    assert len(messages) == ATTEMPTS
    assert len(refused) == ATTEMPTS - config.lockout_after
    assert all("too many" not in m for m in messages[:config.lockout_after])
    assert all("too many" in m for m in messages[config.lockout_after:])
    # The back-off held answers 6..20 for at least their delays: a lower bound, whatever the machine.
    held = sum(min(config.max_delay_s, config.base_delay_s * 2 ** k)
               for k in range(config.lockout_after - config.free_failures))
    assert elapsed >= held

    # Another address (127.0.0.1, direct) with a right token: served.
    with FernClient(token_sidecar.target, token=token_sidecar.flag_token, timeout=60) as client:
        assert len(client.embed(["another peer"])) == 1
    # The locked-out address itself with a right token: served too (a stale client behind a
    # shared address must not lock the others out).
    with FernClient(attacker.target, token=token_sidecar.flag_token, timeout=60) as client:
        assert len(client.embed(["same address, right token"])) == 1

    scrape = urllib.request.Request(metrics_url(token_sidecar.process),
                                    headers={"Authorization": f"Bearer {token_sidecar.metrics_token}"})
    with urllib.request.urlopen(scrape, timeout=10) as response:
        text = response.read().decode()
    value = {m[1]: int(m[2]) for m in re.finditer(r"^(fern_auth_\w+)\{door=\"grpc\"\} (\d+)(?:\.0)?$", text, re.M)}
    assert value["fern_auth_failures_total"] >= ATTEMPTS
    assert value["fern_auth_refused_total"] >= ATTEMPTS - config.lockout_after
    assert value["fern_auth_locked_addresses"] >= 1
    assert "refusing wrong tokens from 127.0.0.2" in token_sidecar.process.log()


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_held_answers_are_bounded_per_address_and_in_all():
    config = LimiterConfig(free_failures=0, max_held_per_address=2, max_held=3, lockout_after=100)
    limiter = AuthLimiter(config, clock=_Clock())
    holds = []
    for address in ("10.0.0.1", "10.0.0.1"):
        assert limiter.failed(address).refused is None
        holds.append(limiter.hold(address))
        holds[-1].__enter__()
    assert "in progress" in limiter.failed("10.0.0.1").refused  # third from one address
    assert limiter.failed("10.0.0.2").refused is None
    holds.append(limiter.hold("10.0.0.2"))
    holds[-1].__enter__()
    assert limiter.failed("10.0.0.3").refused is not None  # three held in all
    for hold in holds:
        hold.__exit__(None, None, None)
    assert limiter.failed("10.0.0.3").refused is None


def test_an_address_is_forgiven_after_a_quiet_lockout_period():
    clock = _Clock()
    config = LimiterConfig(free_failures=1, lockout_after=3, lockout_s=60)
    limiter = AuthLimiter(config, clock=clock)
    verdicts = [limiter.failed("10.0.0.9") for _ in range(5)]
    assert [v.delay_s > 0 for v in verdicts[:3]] == [False, True, True]
    assert all(v.refused for v in verdicts[3:])
    assert limiter.locked_addresses() == 1
    clock.now += 61
    assert limiter.locked_addresses() == 0
    assert limiter.failed("10.0.0.9") == verdicts[0]


def test_a_peer_is_its_address_not_its_port():
    assert peer_address("ipv4:127.0.0.1:50123") == peer_address("ipv4:127.0.0.1:50999") == "127.0.0.1"
    assert peer_address("ipv6:[::1]:50123") == "::1"
    assert peer_address("unix:/run/fern.sock") == "unix:/run/fern.sock"


def test_penalize_holds_then_refuses():
    """The one call the other doors make for a wrong token: back-off while below the limit, a sentence past it."""
    import asyncio

    limiter = AuthLimiter(LimiterConfig(free_failures=1, base_delay_s=0.001, max_delay_s=0.001, lockout_after=2),
                          clock=_Clock())

    async def three() -> list[str | None]:
        return [await limiter.penalize("192.0.2.7") for _ in range(3)]

    first, held, refused = asyncio.run(three())
    assert first is None and held is None and "too many failed authentications" in refused
    assert limiter.failures_total == 3 and limiter.refused_total == 1 and limiter._held == 0


def test_the_postgres_endpoints_failed_logins_are_on_metrics_by_door(sidecar_process_class, metrics_url):
    import psycopg
    from prometheus_client.parser import text_string_to_metric_families

    token = "pgwire-metrics-token-0123456789"
    with sidecar_process_class(["--token", token, "--pg-port", "0", "--metrics-port", "0"]) as process:
        for _ in range(2):
            try:
                psycopg.connect(host="127.0.0.1", port=process.pg_port, user="fern", dbname="fern",
                                password="wrong", sslmode="disable", connect_timeout=30).close()
            except psycopg.OperationalError as error:
                assert "password authentication failed" in str(error)
            else:
                raise AssertionError("a wrong password was accepted")
        text = urllib.request.urlopen(metrics_url(process), timeout=30).read().decode()
    value = {(sample.name, sample.labels["door"]): sample.value
             for family in text_string_to_metric_families(text) if family.name.startswith("fern_auth_")
             for sample in family.samples if "door" in sample.labels}
    assert value[("fern_auth_failures_total", "pgwire")] == 2
    assert value[("fern_auth_failures_total", "grpc")] == 0
    assert value[("fern_auth_locked_addresses", "pgwire")] == 0
