"""The `fern` command, Fern's one composition root: serve, embed, models, demo, and the adapters' verbs.

Every flag has an environment twin (`FERN_…`, shown in `--help`) so containers can be
configured without a command line. `fern serve` itself is composed in `sidecar.serve`. Only
these two modules import the adapters (their verbs, the demo, the in-process worker); nothing
else in `sidecar/` does.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import logging
import os
import sys
from collections.abc import Awaitable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

from sidecar.flags import env as _env
from sidecar.flags import env_bool as _env_bool
from sidecar.flags import env_int as _env_int
from sidecar.flags import env_models as _env_models
from sidecar.extras import import_if_installed, missing_module_message
from sidecar.serve import SCHEDULER_KNOBS, load_registry, run_sidecar

DEFAULT_HOST = "127.0.0.1"
# The names of sidecar.encodings' table (a test holds them equal); the parser loads no numpy.
ENCODING_NAMES = ("float32", "float16", "int8", "binary")
DEFAULT_PORT = 50051
DEMO_HTTP_PORT = 8080

log = logging.getLogger("fern")


# ----------------------------------------------------------------------------- arguments

def _client_args(p: argparse.ArgumentParser) -> None:
    from sidecar.connect import add_connection_args

    add_connection_args(p)
    p.add_argument("--timeout", type=float, default=float(_env("TIMEOUT", "60")),
                   help="seconds to wait for an answer (env FERN_TIMEOUT; default %(default)s)")


def _model_args(p: argparse.ArgumentParser, flag: str = "--model") -> None:
    p.add_argument(flag, action="append", dest="models", metavar="[NAME=]DIR", default=None,
                   help="a model directory, optionally served as NAME (repeatable; the first is "
                        "the default model; env FERN_MODEL, comma-separated; default: the "
                        "bundled all-MiniLM-L6-v2)")
    p.add_argument("--device", default=_env("DEVICE", "auto"),
                   help="auto, cpu, cuda (one engine per visible GPU), cuda:N, or a comma list "
                        "(env FERN_DEVICE; default %(default)s)")
    p.add_argument("--dtype", default=_env("DTYPE", "auto"),
                   help="auto (bf16 on GPU, fp32 on CPU), bf16, fp16, fp32 (env FERN_DTYPE)")
    p.add_argument("--attention", default=_env("ATTENTION", "auto"),
                   help="attention backend: auto, varlen, flashinfer, cpu (env FERN_ATTENTION)")
    p.add_argument("--cache-dir", default=_env("CACHE_DIR"), metavar="DIR",
                   help="keep torch.compile's, Triton's and FlashInfer's compiled kernels under DIR (a volume "
                        "that outlives the machine makes the next start warm; env FERN_CACHE_DIR; default: "
                        "each library's own, TORCHINDUCTOR_CACHE_DIR and FLASHINFER_WORKSPACE_BASE win)")
    p.add_argument("--no-cuda-graphs", action="store_true", default=_env_bool("NO_CUDA_GRAPHS"),
                   help="run every step eagerly (env FERN_NO_CUDA_GRAPHS=1)")
    p.add_argument("--tokenizer-workers", type=int, default=_env_int("TOKENIZER_WORKERS", None),
                   help="tokenizer threads per model (env FERN_TOKENIZER_WORKERS; default: "
                        "2..8 by CPU count)")
    p.add_argument("--tokenizer-processes", type=int, default=_env_int("TOKENIZER_PROCESSES", None),
                   help="tokenizer worker processes for bulk requests, shared by the served models, 0 for none (env "
                        "FERN_TOKENIZER_PROCESSES; default: one per 4 cores from 8 cores up)")
    for flag, field in SCHEDULER_KNOBS.items():
        env = flag.upper().replace("-", "_")
        p.add_argument(f"--{flag}", dest=field, type=int, default=_env_int(env, None),
                       help=f"scheduler: {field.replace('_', ' ')} (env FERN_{env}; default "
                            "depends on the device)")


class _AppendToken(argparse.Action):
    """`--token` is repeatable: every value goes to `tokens`; `token` stays the first (one password)."""

    def __call__(self, parser, namespace, value, option_string=None) -> None:
        tokens = [*(getattr(namespace, "tokens", None) or ()), value]
        namespace.tokens = tokens
        namespace.token = tokens[0]
        namespace.token_on_command_line = True


def _serve_args(p: argparse.ArgumentParser) -> None:
    _model_args(p)
    p.add_argument("--host", default=_env("HOST", DEFAULT_HOST),
                   help="address to bind (env FERN_HOST; default %(default)s: local only)")
    p.add_argument("--port", type=int, default=_env_int("PORT", DEFAULT_PORT),
                   help="gRPC port, 0 for any free one (env FERN_PORT; default %(default)s)")
    p.add_argument("--uds", default=_env("UDS"), metavar="PATH",
                   help="gRPC also on this Unix socket, in plaintext (file permissions guard it; tokens "
                        "still apply); clients use target unix:PATH (env FERN_UDS)")
    p.add_argument("--uds-mode", default=_env("UDS_MODE", "0600"), metavar="MODE",
                   help="octal mode of every socket file (--uds, --pg-socket-dir, --http-uds) (env "
                        "FERN_UDS_MODE; default %(default)s: the sidecar's user only)")
    p.add_argument("--uds-group", default=_env("UDS_GROUP"), metavar="GROUP",
                   help="group of every socket file, e.g. the database's, with --uds-mode 0660 (env "
                        "FERN_UDS_GROUP)")
    p.add_argument("--no-tcp", action="store_true", default=_env_bool("NO_TCP"),
                   help="no TCP gRPC listener: gRPC only on --uds (env FERN_NO_TCP=1)")
    p.add_argument("--token", action=_AppendToken, default=_env("TOKEN"),
                   help="require 'authorization: Bearer TOKEN' on every call but health checks; "
                        "repeatable: any of them is accepted (rotation); the first is also the "
                        "Postgres endpoint's password (env FERN_TOKEN, one token; default: off). "
                        "A flag is readable by local users in /proc/PID/cmdline: prefer --token-file")
    p.add_argument("--token-file", default=_env("TOKEN_FILE"),
                   help="accept the tokens in this file too, one a line ('#' comments), re-read on "
                        "SIGHUP (env FERN_TOKEN_FILE)")
    p.add_argument("--tls-cert", default=_env("TLS_CERT"),
                   help="serve TLS on every door with this certificate chain (PEM; with --tls-key; "
                        "env FERN_TLS_CERT)")
    p.add_argument("--tls-key", default=_env("TLS_KEY"),
                   help="the certificate's private key (PEM; env FERN_TLS_KEY)")
    p.add_argument("--tls-client-ca", default=_env("TLS_CLIENT_CA"),
                   help="require client certificates signed by this CA (PEM): mutual TLS (env "
                        "FERN_TLS_CLIENT_CA)")
    p.add_argument("--metrics-token", action="append", default=None,
                   help="require 'Authorization: Bearer TOKEN' on /metrics (repeatable; env "
                        "FERN_METRICS_TOKEN; default: open)")
    p.add_argument("--metrics-token-file", default=_env("METRICS_TOKEN_FILE"),
                   help="/metrics tokens from a file, re-read on SIGHUP (env FERN_METRICS_TOKEN_FILE)")
    p.add_argument("--insecure", action="store_true", default=_env_bool("INSECURE"),
                   help="do not warn when a door listens beyond loopback without TLS or a token "
                        "(env FERN_INSECURE=1)")
    p.add_argument("--max-request-inputs", type=int, default=_env_int("MAX_REQUEST_INPUTS", None),
                   help="inputs one Embed call may carry (env FERN_MAX_REQUEST_INPUTS; "
                        "default 8192; bigger jobs belong on EmbedStream)")
    p.add_argument("--sparse-language", default=_env("SPARSE_LANGUAGE", "english"),
                   help="language of the BM25 sparse vectors: its stopwords and stemmer "
                        "(env FERN_SPARSE_LANGUAGE; default %(default)s; docs/sparse.md lists them)")
    p.add_argument("--grace", type=float, default=float(_env("GRACE", "30")),
                   help="seconds calls in flight get to finish on SIGTERM (env FERN_GRACE)")
    p.add_argument("--max-connection-age", type=float, default=float(_env("MAX_CONNECTION_AGE", "0")),
                   help="close each client connection after this many seconds (gracefully), so "
                        "clients of several sidecars re-resolve and rebalance (env "
                        "FERN_MAX_CONNECTION_AGE; default 0: never)")
    p.add_argument("--pg-port", type=int, default=_env_int("PG_PORT", None),
                   help="also answer the Postgres protocol (SELECT embed('…'), for dblink) on "
                        "this port; needs --token (env FERN_PG_PORT; default: off)")
    p.add_argument("--pg-require-tls", action="store_true", default=_env_bool("PG_REQUIRE_TLS"),
                   help="the Postgres endpoint refuses plaintext startups (needs --tls-cert; env "
                        "FERN_PG_REQUIRE_TLS=1)")
    p.add_argument("--pg-host", default=_env("PG_HOST", None),
                   help="address for the Postgres endpoint (env FERN_PG_HOST; default: --host)")
    p.add_argument("--pg-socket-dir", default=_env("PG_SOCKET_DIR"), metavar="DIR",
                   help="the Postgres endpoint also on the Unix socket DIR/.s.PGSQL.<pg-port>, for libpq's "
                        "host=DIR (env FERN_PG_SOCKET_DIR)")
    p.add_argument("--pg-worker-dsn", default=_env("PG_WORKER_DSN", None),
                   help="also run a Postgres vectorizer worker against this database (env "
                        "FERN_PG_WORKER_DSN; default: off)")
    p.add_argument("--http-port", type=int, default=_env_int("HTTP_PORT", None),
                   help="also serve the OpenAI (/v1/embeddings) and TEI (/embed) HTTP APIs on this "
                        "port, 0 for any free one (env FERN_HTTP_PORT; default: off; 8080 is usual)")
    p.add_argument("--http-host", default=_env("HTTP_HOST", None),
                   help="address for the HTTP APIs (env FERN_HTTP_HOST; default: --host)")
    p.add_argument("--http-uds", default=_env("HTTP_UDS"), metavar="PATH",
                   help="the HTTP APIs on this Unix socket too, in plaintext (alone, without --http-port: "
                        "only there) (env FERN_HTTP_UDS)")
    p.add_argument("--http-max-body-bytes", type=int, default=_env_int("HTTP_MAX_BODY_BYTES", 8 * 1024 * 1024),
                   help="largest HTTP request body, refused (413) before it is read whole (env "
                        "FERN_HTTP_MAX_BODY_BYTES; default %(default)s)")
    p.add_argument("--metrics-port", type=int, default=_env_int("METRICS_PORT", None),
                   help="also serve Prometheus metrics (GET /metrics) on this port of --host, 0 "
                        "for any free one (env FERN_METRICS_PORT; default: off)")
    p.add_argument("--loop", choices=("auto", "uvloop", "asyncio"), default=_env("LOOP", "auto"),
                   help="event loop: uvloop (auto: when installed; the faster per query) or asyncio's "
                        "(env FERN_LOOP)")
    p.add_argument("--log-level", default=_env("LOG_LEVEL", "INFO"),
                   help="logging level (env FERN_LOG_LEVEL; default %(default)s)")
    p.add_argument("--prewarm", default=_env("PREWARM", ""),
                   help="CUDA graphs to capture before serving, so that the first requests of these "
                        "shapes do not pay an eager step and a capture: 'queries' (one text at each "
                        "64-token bucket up to 512 tokens) and/or LENGTHxCOUNT items, comma-separated "
                        "(env FERN_PREWARM; default: none, every shape is captured on its second use)")
    p.add_argument("--compile-in-background", action="store_true", default=_env_bool("COMPILE_IN_BACKGROUND"),
                   help="on CUDA, report SERVING within seconds and serve from the uncompiled model while "
                        "torch.compile and FlashInfer's kernels are built on another thread, then switch to "
                        "them (env FERN_COMPILE_IN_BACKGROUND=1; metric fern_engine_compiled; default: SERVING "
                        "once compiled)")


def _run_loop(main: Awaitable[int], loop: str) -> int:
    """Run the server's coroutine on uvloop when asked or, for "auto", when it is installed."""
    if loop != "asyncio":
        try:
            import uvloop
        except ImportError:
            if loop == "uvloop":
                raise SystemExit("fern: --loop uvloop: uvloop is not installed (pip install uvloop)") from None
        else:
            return uvloop.run(main)
    return asyncio.run(main)


def _env_optional_bool(name: str) -> bool | None:
    value = (_env(name, "") or "").strip().lower()
    if not value:
        return None
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise SystemExit(f"fern: FERN_{name}={value!r} is not true or false")


def _embed_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", dest="model_name", default=_env("EMBED_MODEL", ""),
                   help="which served model, by name (env FERN_EMBED_MODEL; default: the "
                        "sidecar's default)")
    p.add_argument("--prompt", default=_env("PROMPT"),
                   help="prompt name, e.g. query or passage (env FERN_PROMPT)")
    p.add_argument("--lane", choices=("online", "batch"), default=_env("LANE", "online"),
                   help="scheduler lane (env FERN_LANE; default %(default)s)")
    p.add_argument("--dimensions", type=int, default=_env_int("DIMENSIONS", 0),
                   help="Matryoshka truncation, 0 = full (env FERN_DIMENSIONS)")
    p.add_argument("--encoding", choices=ENCODING_NAMES,  # sidecar.encodings.NAMES, without numpy
                   default=_env("ENCODING", "float32"), help="env FERN_ENCODING")
    norm = p.add_mutually_exclusive_group()
    norm.add_argument("--normalize", dest="normalize", action="store_true",
                      default=_env_optional_bool("NORMALIZE"),
                      help="L2-normalize (env FERN_NORMALIZE=true|false; default: the model's choice)")
    norm.add_argument("--no-normalize", dest="normalize", action="store_false")
    p.add_argument("--no-truncate", action="store_true", default=_env_bool("NO_TRUNCATE"),
                   help="reject inputs over the model's limit instead of cutting them "
                        "(env FERN_NO_TRUNCATE=1)")
    p.add_argument("--sparse", action="store_true", default=_env_bool("SPARSE"),
                   help="also print sparse lexical vectors (env FERN_SPARSE=1)")
    p.add_argument("--sparse-language", default=_env("SPARSE_LANGUAGE"),
                   help="with --local: language of the BM25 sparse vectors (env "
                        "FERN_SPARSE_LANGUAGE; default english); a running sidecar uses its own "
                        "`fern serve --sparse-language`")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fern", description="Fern: a GPU embedding sidecar for vector databases.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {installed_version()}")
    parser.add_argument("--debug", action="store_true", default=_env_bool("DEBUG"),
                        help="show the full traceback when a command fails, instead of one line; "
                             "may follow the verb too (env FERN_DEBUG=1)")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB")
    verbs.required = True

    p = verbs.add_parser("serve", help="run the sidecar (gRPC; optional Postgres endpoint and worker)")
    _serve_args(p)
    _log_format_arg(p)
    p.set_defaults(func=cmd_serve)

    p = verbs.add_parser(
        "embed", help="embed texts and print JSON",
        description="Embed texts and print one JSON object: the vectors, each text's token count, and "
                    "\"truncated\": per text, true when its token count reached the model's limit "
                    "(max_tokens), i.e. anything past the limit was cut off (a text exactly that long "
                    "is flagged too); a warning on stderr names those texts.")
    _embed_input_args(p)
    _client_args(p)
    _embed_options(p)
    p.add_argument("--local", action="store_true", default=_env_bool("LOCAL"),
                   help="run the engine in this process instead of calling a sidecar "
                        "(env FERN_LOCAL=1)")
    _model_args(p, "--model-dir")
    p.set_defaults(func=cmd_embed)

    p = verbs.add_parser("models", help="list the served models as JSON")
    _client_args(p)
    p.add_argument("--local", action="store_true", default=_env_bool("LOCAL"),
                   help="describe local model directories instead (env FERN_LOCAL=1)")
    p.add_argument("--model-dir", action="append", dest="models", metavar="[NAME=]DIR",
                   default=None, help="with --local: the model directories (env FERN_MODEL, "
                                      "comma-separated; default: the bundled one)")
    p.set_defaults(func=cmd_models)

    p = verbs.add_parser("demo", help="start the sidecar, run the Postgres and Qdrant demos, keep serving")
    _serve_args(p)
    # The demo opens the HTTP door too, at the port OpenAI and TEI clients are usually pointed at.
    p.set_defaults(http_port=_env_int("HTTP_PORT", DEMO_HTTP_PORT))
    _log_format_arg(p)
    p.add_argument("--exit", action="store_true", default=_env_bool("DEMO_EXIT"),
                   help="stop after the demos instead of serving until Ctrl-C (env FERN_DEMO_EXIT=1)")
    p.add_argument("--only", choices=("postgres", "qdrant"), action="append",
                   default=[d for d in (_env("DEMO_ONLY", "") or "").split(",") if d] or None,
                   help="run only these demos (repeatable; env FERN_DEMO_ONLY, comma-separated)")
    p.set_defaults(func=cmd_demo)

    for verb in OPTIONAL_VERBS:
        _register(verbs, verb)
    return parser


def _log_format_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-format", choices=("text", "json"), default=_env("LOG_FORMAT", "text"),
                   help="log lines as text or as one JSON object each (env FERN_LOG_FORMAT; "
                        "default %(default)s); --log-level debug adds one line per request")


def _embed_input_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("texts", nargs="*", metavar="TEXT",
                   help="texts to embed; - reads stdin (one text a line, or JSONL with --jsonl)")
    p.add_argument("--file", type=Path, default=None, metavar="FILE",
                   help="read the texts from FILE, one a line (or JSONL with --jsonl), after any TEXT")
    p.add_argument("--jsonl", action="store_true",
                   help="stdin and --file hold one JSON object a line with a \"text\" field "
                        "(blank lines skipped)")


@dataclass(frozen=True)
class OptionalVerb:
    """A verb that lives outside the sidecar package and may be missing from an install."""

    name: str
    module: str
    help: str
    missing: str  # what to tell a user who runs it where its module is absent


OPTIONAL_VERBS = (
    OptionalVerb("pg", "adapters.postgres.cli", "PostgreSQL + pgvector: install, vectorize, worker, status",
                 "the Postgres adapter is not installed: pip install 'fern-embed[postgres]'"),
    OptionalVerb("qdrant", "adapters.qdrant.cli", "Qdrant: ingest and search",
                 "the Qdrant adapter is not installed: pip install 'fern-embed[qdrant]'"),
    # The benchmark harness is a developer tool: it ships in the source tree, not in the wheel.
    OptionalVerb("bench", "benchmarks.cli", "run the benchmark suite (from a source checkout)",
                 "the benchmark harness ships with Fern's source, not with the installed package: "
                 "in a checkout, run `make bench` or `python -m sidecar.cli bench`"),
)

def _register(verbs: argparse._SubParsersAction, verb: OptionalVerb) -> None:
    """Let an adapter or the benchmarks add their verb; where the module (or a library it needs)
    is absent, a stand-in verb says what to install instead of the verb vanishing from --help."""
    try:
        found = import_if_installed(verb.module)
    except ModuleNotFoundError as error:
        found, missing = None, missing_module_message(error)
    else:
        missing = verb.missing
    if found is not None:
        found.register(verbs)
        return
    # No option prefix: whatever flags follow are taken as words, and the verb still says what is missing.
    p = verbs.add_parser(verb.name, help=f"{verb.help} [not installed]", add_help=False, prefix_chars="\0")
    p.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    p.set_defaults(func=lambda args: _fail(verb.name, missing))


def _fail(verb: str, message: str) -> int:
    print(f"fern {verb}: {message}", file=sys.stderr)
    return 1


def installed_version() -> str:
    """The version of the installed distribution; a checkout run without installing has none."""
    try:
        return importlib.metadata.version("fern-embed")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed: run from a source tree)"


# gRPC's EventEngine adds thread hand-offs to every call, so every `fern` process (serve, demo,
# pg worker, embed, models) turns off its client and listener. gRPC reads the setting once,
# when it is first imported; an explicit GRPC_EXPERIMENTS wins. Off in both processes halves a
# bare round trip (docs/performance.md); one setting for all.
GRPC_EXPERIMENTS = "-event_engine_client,-event_engine_listener"


def _grpc_settings() -> None:
    if "grpc" not in sys.modules:
        os.environ.setdefault("GRPC_EXPERIMENTS", GRPC_EXPERIMENTS)


def _setup_logging(args: argparse.Namespace) -> None:
    from sidecar.requestlog import configure_logging

    try:
        configure_logging(args.log_level, args.log_format)
    except ValueError as error:
        raise SystemExit(f"fern {args.verb}: {error}") from None


def cmd_serve(args: argparse.Namespace) -> int:
    _setup_logging(args)
    return _run_loop(run_sidecar(args), args.loop)


def cmd_demo(args: argparse.Namespace) -> int:
    from sidecar.demo import run_demos

    _setup_logging(args)

    def demos(target: str) -> bool:
        run_demos(target, token=args.token, only=args.only)
        if args.exit:
            return False
        print(f"fern: demo done; the sidecar keeps serving on {target} (Ctrl-C to stop)",
              file=sys.stderr, flush=True)
        return True

    return _run_loop(run_sidecar(args, after_start=demos), args.loop)


# ----------------------------------------------------------------------------- embed / models

def _embeddings_json(model: str, dimensions: int, encoding: str, token_counts, vectors,
                     sparse: list | None, truncated: list[bool]) -> dict:
    """What `fern embed` prints; `sparse` is a list of (indices, values) array pairs."""
    out = {"model": model, "dimensions": int(dimensions), "encoding": encoding,
           "token_counts": [int(c) for c in token_counts], "truncated": truncated,
           "vectors": vectors.tolist()}
    if sparse is not None:
        out["sparse"] = [{"indices": i.tolist(), "values": v.tolist()} for i, v in sparse]
    return out


def read_texts(args: argparse.Namespace, stdin: TextIO | None = None) -> list[str]:
    """The texts of `fern embed`: TEXT arguments, `-` for stdin, then --file, in that order.

    Stdin and files hold one text a line (a line's ending is not part of it), or with
    --jsonl one JSON object a line whose "text" field is the text.
    """
    texts: list[str] = []
    for text in args.texts:
        if text == "-":
            texts.extend(_parse_lines(_read_stdin(stdin), "stdin", args.jsonl))
        else:
            texts.append(text)
    if args.file is not None:
        try:
            data = args.file.read_bytes().decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"--file {str(args.file)!r} is not UTF-8 text ({error.reason} at byte "
                             f"{error.start})") from None
        except OSError as error:
            raise ValueError(f"--file {str(args.file)!r}: {error.strerror}") from None
        texts.extend(_parse_lines(data, f"--file {str(args.file)!r}", args.jsonl))
    if not texts:
        raise ValueError("no texts: give TEXT arguments, - to read stdin, or --file FILE")
    return texts


def _read_stdin(stdin: TextIO | None) -> str:
    if stdin is not None:
        return stdin.read()
    try:
        return sys.stdin.buffer.read().decode("utf-8")  # UTF-8 whatever the locale says
    except UnicodeDecodeError as error:
        raise ValueError(f"stdin is not UTF-8 text ({error.reason} at byte {error.start})") from None


def _parse_lines(data: str, source: str, jsonl: bool) -> list[str]:
    lines = data.split("\n")
    if lines and lines[-1] == "":  # the final newline ends the last line; it starts no text
        lines.pop()
    lines = [line.removesuffix("\r") for line in lines]
    if not jsonl:
        return lines
    texts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{source} line {number}: not JSON ({error.msg})") from None
        text = record.get("text") if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise ValueError(f"{source} line {number}: needs a \"text\" string field "
                             "(--jsonl reads one JSON object a line)")
        texts.append(text)
    return texts


def truncated_flags(token_counts: Sequence[int], max_tokens: int, truncate: bool) -> list[bool]:
    """Per text: did it reach the model's limit, so that anything past it was cut off?

    The sidecar reports token counts after truncation, so a text exactly `max_tokens` long
    is flagged as well. With truncation off an over-long text is refused, so none is flagged;
    `max_tokens` 0 (a model that states no limit) flags none either.
    """
    return [truncate and max_tokens > 0 and int(count) >= max_tokens for count in token_counts]


def _warn_truncated(model: str, max_tokens: int, truncated: list[bool]) -> None:
    hits = [i for i, cut in enumerate(truncated) if cut]
    if not hits:
        return
    shown = ", ".join(f"texts[{i}]" for i in hits[:10])
    more = f" and {len(hits) - 10} more" if len(hits) > 10 else ""
    print(f"fern embed: warning: {shown}{more} reached {model}'s limit of {max_tokens} tokens; what came "
          "after was not embedded (--no-truncate refuses such texts instead)", file=sys.stderr)


def _local_embed(args: argparse.Namespace, texts: list[str]) -> tuple[dict, int]:
    """Embed in this process; returns what `fern embed` prints and the model's max_tokens."""
    from sidecar.gateway import EmbedParams, Gateway
    from sidecar.lexical import DEFAULT_LANGUAGE
    from sidecar.scheduler import Lane

    async def run() -> tuple[dict, int]:
        registry = await asyncio.to_thread(load_registry, args)  # a bad --model-dir: main() says which
        await registry.start()
        try:
            gateway = Gateway(registry, sparse_language=args.sparse_language or DEFAULT_LANGUAGE)
            r = await gateway.embed(EmbedParams(
                texts=texts, model=args.model_name, lane=Lane[args.lane.upper()],
                prompt_name=args.prompt or "", normalize=args.normalize,
                truncate=not args.no_truncate, dimensions=args.dimensions,
                encoding=args.encoding, return_sparse=args.sparse))
            max_tokens = {s.name: s.max_tokens for s in gateway.models()}.get(r.model, 0)
        finally:
            await registry.drain()
            registry.close()
        truncated = truncated_flags(r.token_counts, max_tokens, not args.no_truncate)
        return _embeddings_json(r.model, r.dimensions, r.encoding, r.token_counts, r.vectors,
                                r.sparse, truncated), max_tokens

    return asyncio.run(run())


def cmd_embed(args: argparse.Namespace) -> int:
    from sidecar.client import FernClient, FernError
    from sidecar.connect import client_kwargs
    from sidecar.errors import EmbedError

    texts = read_texts(args)
    if args.sparse_language and not args.local:
        print("fern embed: --sparse-language needs --local: a running sidecar makes its sparse "
              "vectors in its own `fern serve --sparse-language`", file=sys.stderr)
        return 1
    if args.sparse_language:
        from sidecar.lexical import UnknownLanguage, check_language

        try:
            check_language(args.sparse_language)
        except UnknownLanguage as error:
            print(f"fern embed: --sparse-language: {error}", file=sys.stderr)
            return 1
    try:
        if args.local:
            out, max_tokens = _local_embed(args, texts)
        else:
            with FernClient(**client_kwargs(args), timeout=args.timeout) as client:
                e = client.embed(
                    texts, model=args.model_name, lane=args.lane, prompt=args.prompt,
                    normalize=args.normalize, truncate=not args.no_truncate,
                    dimensions=args.dimensions, encoding=args.encoding, sparse=args.sparse)
                max_tokens = {m.name: m.max_tokens for m in client.list_models()}.get(e.model, 0)
                sparse = None if e.sparse is None else [(s.indices, s.values) for s in e.sparse]
                truncated = truncated_flags(e.token_counts, max_tokens, not args.no_truncate)
                out = _embeddings_json(e.model, e.dimensions, e.encoding, e.token_counts,
                                       e.vectors, sparse, truncated)
    except (FernError, EmbedError) as error:
        print(f"fern embed: {error.code.name}: {error.message}", file=sys.stderr)
        return 1
    _warn_truncated(out["model"], max_tokens, out["truncated"])
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from sidecar.client import FernClient, FernError
    from sidecar.connect import client_kwargs

    if args.local:
        from core_engine.config import load_spec
        from core_engine.loader import default_model_dir
        from sidecar.registry import ModelSource

        out = []
        for text in args.models or _env_models() or ["default"]:
            source = ModelSource.parse(text)
            spec = load_spec(source.path or default_model_dir(), source.name)
            out.append({"name": spec.name, "dimensions": spec.dimensions,
                        "max_tokens": spec.max_tokens, "pooling": spec.pooling,
                        "prompts": spec.prompts, "default_prompt_name": spec.default_prompt_name or "",
                        "normalize": spec.normalize,
                        "matryoshka_dimensions": list(spec.matryoshka_dimensions),
                        "vocab_size": spec.vocab_size, "distance": spec.distance,
                        "native_int8": spec.native_int8, "kind": spec.kind, "path": str(spec.path)})
    else:
        try:
            with FernClient(**client_kwargs(args), timeout=args.timeout) as client:
                out = [asdict(m) for m in client.list_models()]
        except FernError as error:
            print(f"fern models: {error.code.name}: {error.message}", file=sys.stderr)
            return 1
    json.dump(out, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


def _verb_name(args: argparse.Namespace) -> str:
    """"embed", or "pg install" for an adapter's sub-verb: how an error line names the command."""
    sub = next((getattr(args, key) for key in vars(args)
                if key.endswith("_verb") and isinstance(getattr(args, key), str)), None)
    return f"{args.verb} {sub}" if sub else args.verb


def _one_line(error: BaseException) -> str:
    if isinstance(error, ModuleNotFoundError):
        return missing_module_message(error)
    text = " ".join(str(error).split()) or type(error).__name__
    # An OSError's or ValueError's message says what failed; other types' names say what kind of failure.
    return text if isinstance(error, (OSError, ValueError)) else f"{type(error).__name__}: {text}"


def _debug_first(argv: Sequence[str]) -> list[str]:
    """`fern pg install … --debug` as `fern --debug pg install …`: the flag is the command's, wherever
    it is typed (but not after `--`, where every word is an argument)."""
    argv = list(argv)
    end = argv.index("--") if "--" in argv else len(argv)
    if "--debug" not in argv[:end]:
        return argv
    return ["--debug", *[a for a in argv[:end] if a != "--debug"], *argv[end:]]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `fern` console script.

    A command that fails prints one line, `fern VERB: what went wrong`, and exits 1; with
    `--debug` (or FERN_DEBUG=1) the exception propagates with its traceback instead.
    """
    _grpc_settings()  # before anything imports grpc: the adapters' verbs may, as they register
    args = build_parser().parse_args(_debug_first(sys.argv[1:] if argv is None else argv))
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(f"fern {_verb_name(args)}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `fern embed … | head`: the reader left; nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as error:  # every failure a user can cause ends here as one line
        if args.debug:
            raise
        print(f"fern {_verb_name(args)}: {_one_line(error)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
