"""The command-line flags every client verb uses to reach a sidecar (target, token, TLS), in one place.

    add_connection_args(parser)
    args = parser.parse_args()
    with FernClient(**client_kwargs(args)) as client: ...

This module imports nothing of gRPC, so building a parser leaves gRPC unloaded. Each flag
has an environment twin (FERN_TARGET, FERN_TOKEN, FERN_TOKEN_FILE, FERN_TLS, FERN_TLS_CA,
FERN_TLS_CLIENT_CERT, FERN_TLS_CLIENT_KEY, FERN_TLS_SERVER_NAME).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

DEFAULT_TARGET = "127.0.0.1:50051"


def _env(name: str) -> str | None:
    return os.environ.get(f"FERN_{name}") or None


def add_connection_args(p: argparse.ArgumentParser) -> None:
    """--target, --token / --token-file and the --tls-… flags, with their environment twins."""
    p.add_argument("--target", default=_env("TARGET") or DEFAULT_TARGET,
                   help="the running sidecar's address HOST:PORT or unix:PATH; several as a comma "
                        "list, or dns:///NAME:PORT, are balanced round robin (env FERN_TARGET; "
                        "default %(default)s)")
    p.add_argument("--token", default=_env("TOKEN"),
                   help="shared secret sent as 'authorization: Bearer …' (env FERN_TOKEN; a flag is "
                        "readable by local users in /proc/PID/cmdline: prefer the variable or a token file)")
    p.add_argument("--token-file", default=_env("TOKEN_FILE"),
                   help="read the token from this file's first token line (env FERN_TOKEN_FILE)")
    p.add_argument("--tls-ca", default=_env("TLS_CA"),
                   help="connect over TLS, trusting this CA (PEM) for the sidecar's certificate "
                        "(env FERN_TLS_CA)")
    p.add_argument("--tls", action="store_true",
                   default=(_env("TLS") or "0").lower() not in ("0", "false", "no"),
                   help="connect over TLS trusting the system's CAs (implied by any --tls-… flag; "
                        "env FERN_TLS=1)")
    p.add_argument("--tls-client-cert", default=_env("TLS_CLIENT_CERT"),
                   help="client certificate (PEM) for a sidecar that requires one (env "
                        "FERN_TLS_CLIENT_CERT)")
    p.add_argument("--tls-client-key", default=_env("TLS_CLIENT_KEY"),
                   help="the client certificate's key (PEM) (env FERN_TLS_CLIENT_KEY)")
    p.add_argument("--tls-server-name", default=_env("TLS_SERVER_NAME"),
                   help="the name the sidecar's certificate must carry, when it is not the target's "
                        "host, e.g. through a tunnel (env FERN_TLS_SERVER_NAME)")


def client_token(args: argparse.Namespace) -> str | None:
    """--token, else the first token of --token-file, else None."""
    from sidecar.security import read_token_file  # not at parse time: gRPC must load after its settings

    if args.token:
        return args.token
    if getattr(args, "token_file", None):
        try:
            tokens = read_token_file(Path(args.token_file))
        except ValueError as error:
            raise SystemExit(f"fern: {error}") from None
        if not tokens:
            raise SystemExit(f"fern: --token-file {args.token_file} holds no token")
        return tokens[0]
    return None


def client_kwargs(args: argparse.Namespace) -> dict:
    """FernClient / AsyncFernClient keyword arguments from the flags add_connection_args added."""
    return {"target": args.target, "token": client_token(args),
            "tls": True if args.tls else None, "tls_ca": args.tls_ca,
            "tls_client_cert": args.tls_client_cert, "tls_client_key": args.tls_client_key,
            "tls_server_name": args.tls_server_name}
