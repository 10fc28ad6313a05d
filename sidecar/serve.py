"""`fern serve`: the registry, the doors and their security built from the parsed flags, run until SIGTERM.

`sidecar.cli` parses the command line; this module composes what `fern serve` runs from it
(it and the CLI are the only places in `sidecar/` that import the adapters: the in-process
Postgres worker).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from sidecar.flags import STARTED as _STARTED
from sidecar.flags import env as _env
from sidecar.flags import env_models as _env_models

if TYPE_CHECKING:
    from core_engine.settings import SidecarConfig
    from sidecar.registry import Registry
    from sidecar.scheduler import SchedulerConfig
    from sidecar.security import DoorSecurity

log = logging.getLogger("fern")

# Scheduler knobs `fern serve` exposes: flag name -> SchedulerConfig field.
SCHEDULER_KNOBS = {
    "max-step-tokens": "max_step_tokens",
    "online-step-tokens": "online_step_tokens",
    "max-step-sequences": "max_step_sequences",
    "max-queued-tokens-online": "max_queued_tokens_online",
    "max-queued-tokens-batch": "max_queued_tokens_batch",
}


def _scheduler_config(args: argparse.Namespace, settings: SidecarConfig) -> Callable[[str], SchedulerConfig]:
    from sidecar.scheduler import SchedulerConfig

    overrides = {"launch_on_arrival": settings.launch_on_arrival, "online_poll_s": settings.online_poll_s}
    overrides.update({field: getattr(args, field) for field in SCHEDULER_KNOBS.values()
                      if getattr(args, field, None) is not None})
    return lambda device_type: SchedulerConfig.for_device(device_type, **overrides)


def point_caches(directory: Path) -> None:
    """Put the compilers' on-disk caches under `directory` (before torch, Triton or FlashInfer reads where):
    inductor/ (torch.compile's code and Triton's kernels) and flashinfer/ (its JIT-built kernels).
    A variable the environment already sets wins. Each cache keys its entries by the source it
    compiled and the library versions, so one directory serves upgrades and several models."""
    directory = directory.expanduser().resolve()
    for variable, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "inductor/triton"),
                          ("FLASHINFER_WORKSPACE_BASE", "flashinfer")):
        path = directory / sub
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise SystemExit(f"fern: --cache-dir {str(directory)!r}: {error.strerror}") from None
        os.environ.setdefault(variable, str(path))


def load_registry(args: argparse.Namespace, timings: dict[str, float] | None = None) -> Registry:
    """The served models from `--model`/`--device`/… (the bundled model by default).

    `timings`, when given, gets the seconds from start until the libraries were imported (torch,
    the engine, the tokenizers, gRPC) and those spent loading the models (tokenizers, weights,
    compile, attention choice)."""
    if getattr(args, "cache_dir", None):
        point_caches(Path(args.cache_dir))
    import core_engine.engine  # noqa: F401 - torch and the engine: counted as imports, not as models
    from core_engine.settings import SidecarConfig
    from sidecar.registry import ModelSource, Registry

    imported = time.monotonic()
    settings = SidecarConfig.from_env()
    sources = [ModelSource.parse(m) for m in (args.models or _env_models())]
    registry = Registry.load(sources, device=args.device, dtype=args.dtype, attention=args.attention,
                             cuda_graphs=not args.no_cuda_graphs,
                             scheduler_config=_scheduler_config(args, settings),
                             tokenizer_workers=args.tokenizer_workers,
                             tokenizer_processes=args.tokenizer_processes,
                             prewarm=getattr(args, "prewarm", ""), settings=settings,
                             compile_in_background=getattr(args, "compile_in_background", False))
    if timings is not None:
        timings.update(imports=imported - _STARTED, models=time.monotonic() - imported)
    return registry


class _PgWorkerRunner:
    """The Postgres vectorizer worker (a background thread) as a start()/stop() extra of the sidecar."""

    def __init__(self, dsn: str, target: str, token: str | None) -> None:
        self.dsn, self.target, self.token = dsn, target, token
        self._worker = None

    async def start(self) -> None:
        from adapters.postgres.worker import BackgroundWorker

        self._worker = BackgroundWorker(self.dsn, self.target, token=self.token).start()

    async def stop(self) -> None:
        if self._worker is not None:
            await asyncio.to_thread(self._worker.stop)


def _check_free(host: str, port: int) -> None:
    """Fail in a second, not after loading the models, when the port is taken."""
    import socket

    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise SystemExit(f"fern: cannot resolve --host {host!r}: {error}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as error:
            raise SystemExit(f"fern: could not bind {host}:{port} ({error.strerror})") from None


def settle_heap() -> int:
    """Collect once, then freeze what is left out of the garbage collector; returns how many objects.

    What start-up leaves (torch, the models, gRPC) lives as long as the process, yet every full
    collection would walk all of it, a stall of the event loop and of every request in flight
    (docs/performance.md has the figures). Frozen, it is skipped; later collections walk only
    what serving created.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


# The engines' start-up parts (Engine.startup_seconds) as the start-up line names them.
_STARTUP_PARTS = {"attention": "attention backends", "weights": "weights", "compile": "compile",
                  "choose_attention": "attention choice", "prewarm": "graph pre-warm"}


def models_split(registry: Registry) -> str:
    """What loading the models waited for, summed over every engine (they load one after another):
    " (weights 0.5 s, compile 121.3 s, ...)", the parts of a tenth of a second or more ("attention
    backends" is importing them: FlashInfer, torch._dynamo); "" when none is."""
    totals = dict.fromkeys(_STARTUP_PARTS, 0.0)
    for served in registry:
        for engine in served.engines:
            for part in totals:
                totals[part] += getattr(engine, "startup_seconds", {}).get(part, 0.0)
    shown = [f"{_STARTUP_PARTS[part]} {seconds:.1f} s" for part, seconds in totals.items() if seconds >= 0.05]
    return f" ({', '.join(shown)})" if shown else ""


def set_switch_interval(settings: SidecarConfig) -> None:
    """The GIL switch interval `settings` asks for (FERN_GIL_SWITCH_MS); Python's own where it asks for none."""
    if settings.gil_switch_interval_s is not None:
        sys.setswitchinterval(settings.gil_switch_interval_s)


def door_security(args: argparse.Namespace) -> DoorSecurity:
    """TLS settings, tokens and the failed-auth limiter from `fern serve`'s flags, shared by every door."""
    from sidecar.security import DoorSecurity, ServerTls, TlsSettings, TokenSet

    tls = None
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            raise SystemExit("fern: TLS needs both --tls-cert and --tls-key")
        try:
            tls = ServerTls(TlsSettings.from_files(args.tls_cert, args.tls_key, args.tls_client_ca))
        except ValueError as error:
            raise SystemExit(f"fern: {error}") from None
    elif args.tls_client_ca:
        raise SystemExit("fern: --tls-client-ca needs --tls-cert and --tls-key")
    tokens = getattr(args, "tokens", None) or ([args.token] if args.token else [])
    metrics_tokens = args.metrics_token or ([_env("METRICS_TOKEN")] if _env("METRICS_TOKEN") else [])
    try:
        security = DoorSecurity(tls=tls, tokens=TokenSet(tokens, args.token_file),
                                metrics_tokens=TokenSet(metrics_tokens, args.metrics_token_file))
    except ValueError as error:
        raise SystemExit(f"fern: {error}") from None
    if args.token is None and security.tokens:
        args.token = security.tokens.first()  # the Postgres endpoint and the worker take one token
    return security


def _warn_exposure(args: argparse.Namespace, security: DoorSecurity) -> None:
    """Say so at start when a door is reachable beyond this host without TLS or a token (unless --insecure)."""
    from sidecar.security import MIN_TOKEN_CHARS, exposure_warnings

    if args.insecure:
        return
    has_tls, has_token = security.tls is not None, bool(security.tokens)
    listeners = [] if getattr(args, "no_tcp", False) else [("gRPC", args.host, has_tls, has_token)]
    if args.pg_port is not None:
        listeners.append(("the Postgres endpoint", args.pg_host or args.host, has_tls, has_token))
    if args.http_port is not None:
        listeners.append(("HTTP", args.http_host or args.host, has_tls, has_token))
    if args.metrics_port is not None:
        listeners.append(("/metrics", args.host, has_tls, bool(security.metrics_tokens)))
    for warning in exposure_warnings(listeners):
        log.warning("%s", warning)
    if getattr(args, "token_on_command_line", False):
        log.warning("--token on the command line is readable by every local user in /proc/%d/cmdline: "
                    "prefer --token-file or FERN_TOKEN", os.getpid())
    if short := security.tokens.short_tokens():
        log.warning("%d token(s) shorter than %d characters: use a long random one, e.g. "
                    "`openssl rand -hex 32`", short, MIN_TOKEN_CHARS)


def _unix_sockets(args: argparse.Namespace) -> dict:
    """The socket files `fern serve`'s flags ask for, by flag (uds, pg_socket_dir, http_uds), checked
    before the models load: a bad mode or group, or a path that is taken, fails in a second."""
    from sidecar import unixsocket

    if args.no_tcp and not args.uds:
        raise SystemExit("fern: --no-tcp needs --uds PATH (gRPC must listen somewhere)")
    if args.pg_socket_dir and args.pg_port is None:
        raise SystemExit("fern: --pg-socket-dir needs --pg-port (the socket is named DIR/.s.PGSQL.<pg-port>)")
    try:
        mode = unixsocket.parse_mode(args.uds_mode)
        sockets = {flag: unixsocket.UnixSocket(Path(path), mode, args.uds_group)
                   for flag, path in (("uds", args.uds), ("pg_socket_dir", args.pg_socket_dir),
                                      ("http_uds", args.http_uds)) if path}
        if "uds" in sockets and "http_uds" in sockets and sockets["uds"].path == sockets["http_uds"].path:
            raise ValueError(f"--uds and --http-uds name the same path, {sockets['uds'].path}: give each door its own")
        for flag in ("uds", "http_uds"):
            if flag in sockets:
                unixsocket.claim(sockets[flag].path)
        if "pg_socket_dir" in sockets:
            directory = sockets["pg_socket_dir"].path
            if not directory.is_dir():
                raise ValueError(f"--pg-socket-dir {directory}: not a directory")
            if args.pg_port:
                unixsocket.claim(directory / f".s.PGSQL.{args.pg_port}")
    except (ValueError, OSError) as error:
        raise SystemExit(f"fern: {error}") from None
    return sockets


async def run_sidecar(args: argparse.Namespace,
                      after_start: Callable[[str], object] | None = None) -> int:
    """Load the models, serve until SIGTERM/SIGINT (or until `after_start` returns False), drain."""
    from core_engine.settings import SidecarConfig
    from sidecar.server import Sidecar

    security = door_security(args)
    _warn_exposure(args, security)
    sockets = _unix_sockets(args)
    if args.no_tcp and (args.pg_worker_dsn or after_start) and _env("TLS_CA"):
        raise SystemExit("fern: with --no-tcp, the in-process worker and demos connect over --uds in "
                         "plaintext: unset FERN_TLS_CA")
    if security.tls is not None and not args.no_tcp and (args.pg_worker_dsn or after_start) and not _env("TLS_CA"):
        # The worker and the demos are clients of this sidecar: FernClient reads their TLS from the environment.
        raise SystemExit("fern: with --tls-cert, the in-process worker and demos connect over TLS: set "
                         "FERN_TLS_CA (and FERN_TLS_CLIENT_CERT/FERN_TLS_CLIENT_KEY with --tls-client-ca; "
                         "FERN_TLS_SERVER_NAME when the certificate does not name 127.0.0.1)")
    from sidecar.lexical import UnknownLanguage, check_language

    sparse_language = getattr(args, "sparse_language", "english")
    try:
        check_language(sparse_language)
    except UnknownLanguage as error:
        raise SystemExit(f"fern: --sparse-language: {error}") from None
    if args.pg_port is not None and not args.token:
        raise SystemExit("fern: --pg-port needs --token (it is the Postgres endpoint's password)")
    if args.pg_require_tls and security.tls is None:
        raise SystemExit("fern: --pg-require-tls needs --tls-cert and --tls-key")
    for flag, port in (("--port", args.port), ("--pg-port", args.pg_port), ("--metrics-port", args.metrics_port),
                       ("--http-port", args.http_port)):
        if port is not None and not 0 <= port <= 65535:
            raise SystemExit(f"fern: {flag} {port}: a port is 0 to 65535")
    if not args.no_tcp:
        _check_free(args.host, args.port)
    if args.pg_port:
        _check_free(args.pg_host or args.host, args.pg_port)
    if args.metrics_port:
        _check_free(args.host, args.metrics_port)
    if args.http_port:
        _check_free(args.http_host or args.host, args.http_port)
    timings: dict[str, float] = {}
    try:
        registry = await asyncio.to_thread(load_registry, args, timings)
    except (ValueError, OSError) as error:  # a bad --model, --device, or knob: say which
        raise SystemExit(f"fern: {error}") from None
    frozen = settle_heap()
    set_switch_interval(SidecarConfig.from_env())
    sidecar = Sidecar(registry, host=args.host, port=args.port, tokens=security.tokens,
                      tls=security.tls, limiter=security.limiter, max_inputs=args.max_request_inputs,
                      sparse_language=sparse_language, max_connection_age_s=args.max_connection_age or None,
                      unix_socket=sockets.get("uds"), tcp=not args.no_tcp)
    pgwire = None
    if args.pg_port is not None:
        from sidecar.pgwire import PgWireServer

        pgwire = PgWireServer(sidecar.gateway, args.pg_host or args.host, args.pg_port,
                              security.tokens.values(), ssl_context=security.ssl_context(),
                              require_tls=args.pg_require_tls, socket_dir=sockets.get("pg_socket_dir"),
                              certificate=security.tls.certificate_pem if security.tls else None)
        sidecar.extras.append(pgwire)
    http = None
    if args.http_port is not None or args.http_uds:
        from sidecar.http.server import HttpServer

        http = HttpServer(sidecar.gateway, args.http_host or args.host, args.http_port,
                          authorized=security.tokens.check_bearer if security.tokens else None,
                          limiter=security.limiter if security.tokens else None,
                          max_body_bytes=args.http_max_body_bytes, grace=args.grace,
                          ssl_context=security.ssl_context(), uds=sockets.get("http_uds"))
        sidecar.extras.append(http)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def reload_tokens() -> None:  # SIGHUP: token and certificate rotation without a restart
        security.reload()
        if pgwire is not None:
            pgwire.set_passwords(security.tokens.values())

    loop.add_signal_handler(signal.SIGHUP, reload_tokens)
    try:
        await sidecar.start()
    except OSError as error:
        await registry.drain()
        raise SystemExit(f"fern: {error}") from None
    if http is not None and http.url:
        print(f"fern: HTTP on {http.url}", file=sys.stderr, flush=True)
    if http is not None and http.uds is not None:
        print(f"fern: HTTP on unix:{http.uds.path}", file=sys.stderr, flush=True)
    metrics = None
    if args.metrics_port is not None:
        from sidecar.metrics import MetricsServer

        metrics = MetricsServer(registry, args.host, args.metrics_port, ssl_context=security.ssl_context(),
                                tokens=security.metrics_tokens,
                                limiter=security.limiter if security.tokens else None,
                                pg_limiter=pgwire.auth_limiter if pgwire is not None else None,
                                extras=[http.metrics] if http is not None else [])
        try:
            await metrics.start()
        except OSError as error:
            await sidecar.stop(args.grace)  # nothing is in flight yet: returns at once
            raise SystemExit(f"fern: metrics: {error}") from None
        print(f"fern: metrics on {metrics.url}", file=sys.stderr, flush=True)
    if args.pg_worker_dsn:
        worker = _PgWorkerRunner(args.pg_worker_dsn, sidecar.target, args.token)
        sidecar.extras.append(worker)
        await worker.start()
    names = ", ".join(s.name for s in sidecar.gateway.models())
    devices = ", ".join(sorted({str(e.device) for m in registry for e in m.engines}))
    # Where start-up went (the engine logs its own part of "models" in more detail), and what it did not wait for.
    compiling = [m.spec.name for m in registry if any(getattr(e, "compiling", False) for e in m.engines)]
    later = (f"; compiling {', '.join(compiling)} in the background, served uncompiled until then "
             "(metric fern_engine_compiled)") if compiling else ""
    print(f"fern: serving {names} on {sidecar.target} ({devices}; {time.monotonic() - _STARTED:.1f} s after "
          f"start: imports {timings['imports']:.1f} s, models {timings['models']:.1f} s{models_split(registry)}; "
          f"{frozen:,} start-up objects frozen out of the garbage collector{later})", file=sys.stderr, flush=True)
    for extra in sidecar.extras:
        if hasattr(extra, "port"):
            print(f"fern: Postgres endpoint on {extra.host}:{extra.port}", file=sys.stderr, flush=True)
    if pgwire is not None and pgwire.unix_socket is not None:
        print(f"fern: Postgres endpoint on unix:{pgwire.unix_socket.path} (libpq: host={pgwire.socket_dir.path} "
              f"port={pgwire.port})", file=sys.stderr, flush=True)
    if sidecar.unix_socket is not None:
        print(f"fern: gRPC on {sidecar.unix_socket.address}", file=sys.stderr, flush=True)
    status = 0
    if after_start is not None:
        job = asyncio.ensure_future(asyncio.to_thread(after_start, sidecar.target))
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({job, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if job.done():
            if job.exception() is not None:
                log.error("fern: %s failed; stopping the sidecar", getattr(after_start, "__name__", "job"),
                          exc_info=job.exception())
                status = 1
                stop.set()
            elif job.result() is False:
                stop.set()
    await stop.wait()
    print("fern: draining (calls in flight finish; new calls get UNAVAILABLE)", file=sys.stderr,
          flush=True)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.remove_signal_handler(sig)  # a second Ctrl-C kills at once
    await sidecar.stop(args.grace)
    if metrics is not None:  # stopped last: scrapes follow the drain to its end
        await metrics.stop()
    print("fern: stopped", file=sys.stderr, flush=True)
    return status
