"""The `fern qdrant` verbs (`fern qdrant ingest`), registered by sidecar.cli.

Every flag has a `FERN_…` environment twin, shown in `--help`. Mistakes a user can make
(a file that is not there, a line that is not JSON, a field that is missing, a sidecar
or a Qdrant that does not answer, a wrong token) end in one line on stderr that names
the input and the fix, and a non-zero exit status.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from sidecar.connect import add_connection_args, client_kwargs

PROG = "fern qdrant ingest"
DEFAULT_TIMEOUT_S = 60.0


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"FERN_{name}", default)


def register(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    """Add the `qdrant` verb (with its `ingest` sub-verb) to the `fern` command and return it."""
    parser = subparsers.add_parser(
        "qdrant",
        help="Qdrant adapter: bulk ingest through the sidecar",
        description="Qdrant adapter verbs. Vectors come from the Fern sidecar at --target.",
    )
    verbs = parser.add_subparsers(dest="qdrant_verb", required=True, metavar="VERB")
    ingest = verbs.add_parser(
        "ingest",
        help="embed JSON lines through the sidecar's BATCH lane and upsert them into a collection",
        description=(
            "Stream JSON lines (a file, or stdin) through the sidecar (EmbedStream, BATCH lane) "
            "and upsert them into a Qdrant collection with a dense and a sparse vector. Point "
            "ids are UUIDs derived from each record's id, so re-running after a failure "
            "completes the collection without duplicates."
        ),
    )
    ingest.add_argument("file", nargs="?", default="-",
                        help="JSON-lines file, one record (object) a line (default, or '-': stdin)")
    ingest.add_argument("--collection", default=_env("QDRANT_COLLECTION"),
                        help="Qdrant collection name (env FERN_QDRANT_COLLECTION; required); "
                             "created for the model if it does not exist")
    ingest.add_argument("--qdrant", default=_env("QDRANT"),
                        help="Qdrant location: an http(s):// URL, ':memory:' or a local directory "
                             "(env FERN_QDRANT; required)")
    ingest.add_argument("--api-key", default=_env("QDRANT_API_KEY", os.environ.get("QDRANT_API_KEY")),
                        help="Qdrant API key for a server URL (env FERN_QDRANT_API_KEY, "
                             "else QDRANT_API_KEY)")
    ingest.add_argument("--text", default=_env("QDRANT_TEXT", "text"),
                        help="record field holding the text, or a template such as "
                             "'{title}: {body}' (env FERN_QDRANT_TEXT; default: text)")
    ingest.add_argument("--id", dest="id_field", default=_env("QDRANT_ID", "id"),
                        help="record field holding the record's id (env FERN_QDRANT_ID; default: id)")
    ingest.add_argument("--payload", default=_env("QDRANT_PAYLOAD"),
                        help="comma-separated fields to store as payload (env FERN_QDRANT_PAYLOAD; "
                             "default: the whole record)")
    ingest.add_argument("--model", dest="model_name", default=_env("EMBED_MODEL", ""),
                        help="which served model, by name (env FERN_EMBED_MODEL; default: the "
                             "sidecar's default, or the collection's)")
    ingest.add_argument("--prompt", default=_env("PROMPT"),
                        help="prompt name for the records, e.g. passage (env FERN_PROMPT; "
                             "default: none)")
    add_connection_args(ingest)
    ingest.add_argument("--timeout", default=_env("TIMEOUT", str(DEFAULT_TIMEOUT_S)),
                        help="seconds to wait for the sidecar's first answer; the ingest "
                             f"itself has no deadline (env FERN_TIMEOUT; default {DEFAULT_TIMEOUT_S:g})")
    ingest.add_argument("--no-sparse", action="store_true", default=_env_bool("QDRANT_NO_SPARSE"),
                        help="store only the dense vector, no hybrid search "
                             "(env FERN_QDRANT_NO_SPARSE=1)")
    ingest.add_argument("--quantization", default=_env("QDRANT_QUANTIZATION"),
                        help="int8 or binary: quantization config for a newly created collection "
                             "(env FERN_QDRANT_QUANTIZATION; default: none)")
    ingest.add_argument("--batch-size", default=_env("QDRANT_BATCH_SIZE", "64"),
                        help="records per sidecar request and per upsert "
                             "(env FERN_QDRANT_BATCH_SIZE; default 64)")
    ingest.add_argument("--in-flight", default=_env("QDRANT_IN_FLIGHT", "8"),
                        help="sidecar requests in flight at most, bounds memory "
                             "(env FERN_QDRANT_IN_FLIGHT; default 8)")
    ingest.set_defaults(func=run_ingest)
    return parser


def _env_bool(name: str) -> bool:
    return (_env(name, "") or "").strip().lower() in ("1", "true", "yes", "on")


class CliError(Exception):
    """A mistake or an outage the user can fix: printed as one line, exit status `status`."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(" ".join(message.split()))
        self.status = status


class RecordError(ValueError):
    """A JSON line that cannot be ingested; the message starts with `source:line`."""


@dataclass(frozen=True)
class Line:
    """One record of a JSON-lines stream and where it came from ("docs.jsonl:12")."""

    where: str
    record: dict[str, Any]


def read_jsonl(stream: IO[bytes], source: str) -> Iterator[Line]:
    """Yield the JSON objects of a binary JSON-lines stream; errors name the source and line number."""
    for number, raw in enumerate(stream, start=1):
        where = f"{source}:{number}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise RecordError(f"{where}: not UTF-8 text (byte {err.start + 1}: {err.reason})") from None
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise RecordError(f"{where}: not valid JSON ({err.msg}, column {err.colno})") from None
        if not isinstance(record, dict):
            raise RecordError(f"{where}: expected a JSON object, got {type(record).__name__}")
        yield Line(where, record)


def run_ingest(args: argparse.Namespace) -> int:
    """Run `fern qdrant ingest` from parsed arguments; returns the exit status."""
    try:
        print(_ingest(args))
    except CliError as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return err.status
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; run the same command again to complete the collection "
              f"(point ids derive from record ids: nothing is duplicated)", file=sys.stderr)
        return 130
    return 0


def _ingest(args: argparse.Namespace) -> Any:
    from sidecar.client import FernClient

    from adapters.qdrant.ingest import IngestError

    settings = _settings(args)
    with _open_input(args.file) as (stream, source):
        fern = FernClient(**client_kwargs(args))
        try:
            _check_sidecar(fern, args.model_name, settings.timeout)
            client = _open_qdrant(args.qdrant, args.api_key, fern)
            try:
                _setup(client, args)
                records = read_jsonl(stream, source)
                try:
                    return client.ingest(
                        args.collection, records, text=_text(args.text), id=_id(args.id_field),
                        payload=_payload(settings.payload), model=args.model_name or None,
                        prompt=args.prompt, batch_size=settings.batch_size,
                        max_in_flight=settings.in_flight)
                except IngestError as err:
                    raise _ingest_error(err, args, fern.target) from None
            finally:
                client.close()
        finally:
            fern.close()


@dataclass(frozen=True)
class _Settings:
    """The checked numeric and list settings of one run."""

    batch_size: int
    in_flight: int
    timeout: float
    payload: list[str] | None


def _settings(args: argparse.Namespace) -> _Settings:
    if not args.collection:
        raise CliError("give --collection NAME (or set FERN_QDRANT_COLLECTION)", status=2)
    if not args.qdrant:
        raise CliError("give --qdrant (an http(s):// URL, ':memory:' or a directory), "
                       "or set FERN_QDRANT", status=2)
    if args.quantization not in (None, "", "int8", "binary"):
        raise CliError(f"--quantization (env FERN_QDRANT_QUANTIZATION) must be int8 or binary, "
                       f"got {args.quantization!r}", status=2)
    payload = None
    if args.payload:
        payload = [f.strip() for f in args.payload.split(",") if f.strip()]
    return _Settings(
        batch_size=_positive(args.batch_size, "--batch-size", "FERN_QDRANT_BATCH_SIZE", int),
        in_flight=_positive(args.in_flight, "--in-flight", "FERN_QDRANT_IN_FLIGHT", int),
        timeout=_positive(args.timeout, "--timeout", "FERN_TIMEOUT", float),
        payload=payload)


def _positive(value: Any, flag: str, env: str, kind: Callable[[str], Any]) -> Any:
    try:
        number = kind(value)
    except (TypeError, ValueError):
        number = None
    if number is None or number <= 0:
        raise CliError(f"{flag} (env {env}) must be a positive {kind.__name__}, got {value!r}",
                       status=2)
    return number


@contextmanager
def _open_input(file: str) -> Iterator[tuple[IO[bytes], str]]:
    """The input as a binary stream and its name; a missing or unreadable file is a CliError."""
    if file == "-":
        yield sys.stdin.buffer, "<stdin>"  # read, not closed
        return
    try:
        stream = Path(file).open("rb")
    except OSError as err:
        raise CliError(f"cannot read {file}: {err.strerror or err}; give a JSON-lines file, "
                       f"or '-' (the default) to read stdin") from None
    with stream:
        yield stream, file


def _check_sidecar(fern: Any, model: str, timeout: float) -> None:
    """Ask the sidecar for `model`; an unreachable sidecar, a bad token or model is a CliError."""
    from sidecar.client import FernError

    try:
        fern.model(model, timeout=timeout)
    except FernError as err:
        raise CliError(_sidecar_problem(err, fern.target)) from None


def _sidecar_problem(err: Any, target: str) -> str:
    import grpc  # here, not at the top: building `fern`'s parser must not load gRPC

    code = err.code
    if code == grpc.StatusCode.UNAVAILABLE:
        return (f"no sidecar answers at {target} ({err.message}): start one with `fern serve`, "
                f"or point --target (env FERN_TARGET) at it")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return (f"the sidecar at {target} did not answer in time: check that it is up, or raise "
                f"--timeout (env FERN_TIMEOUT)")
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return (f"the sidecar at {target} refused the call ({code.name}: {err.message}): pass its "
                f"token with --token (env FERN_TOKEN)")
    if code == grpc.StatusCode.NOT_FOUND:
        return f"{err.message}: pass a served model name with --model (env FERN_EMBED_MODEL)"
    return f"the sidecar at {target} answered {code.name}: {err.message}"


def _open_qdrant(location: str, api_key: str | None, fern: Any) -> Any:
    """A FernQdrantClient for `location` that has answered once; otherwise a CliError naming it."""
    from adapters.qdrant.client import FernQdrantClient

    kwargs = _location_kwargs(location, api_key)
    # qdrant-client warns when it cannot read the server's version; for a server that does
    # not answer the probe below says so in one line, so its warnings wait for that probe.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            client = FernQdrantClient(**kwargs, fern=fern)
        except (RuntimeError, OSError, ValueError) as err:
            raise CliError(f"cannot open Qdrant at {location}: {err}; pass --qdrant "
                           f"(env FERN_QDRANT) a URL, ':memory:' or a directory") from None
    try:
        client.get_collections()
    except Exception as err:  # any failure of the first call: reported as the location's problem
        client.close()
        raise CliError(_qdrant_problem(err, location)) from None
    for warning in caught:
        print(f"{PROG}: warning: {' '.join(str(warning.message).split())}", file=sys.stderr)
    return client


def _qdrant_problem(err: Exception, location: str) -> str:
    from qdrant_client.http.exceptions import ResponseHandlingException, UnexpectedResponse

    if isinstance(err, UnexpectedResponse) and err.status_code in (401, 403):
        return (f"Qdrant at {location} refused the API key ({err.status_code} "
                f"{err.reason_phrase}): pass --api-key (env FERN_QDRANT_API_KEY)")
    if isinstance(err, UnexpectedResponse):
        return f"Qdrant at {location} answered {err.status_code} {err.reason_phrase}"
    if isinstance(err, ResponseHandlingException):
        cause = err.source if getattr(err, "source", None) is not None else err
        return (f"Qdrant at {location} does not answer ({cause or type(cause).__name__}): start "
                f"Qdrant there, or pass --qdrant (env FERN_QDRANT) a reachable URL, a directory "
                f"or ':memory:'")
    return f"Qdrant at {location} failed: {type(err).__name__}: {err}"


def _setup(client: Any, args: argparse.Namespace) -> None:
    from sidecar.client import FernError

    try:
        client.setup_collection(args.collection, model=args.model_name,
                                sparse=None if args.no_sparse else "sparse",
                                quantization=args.quantization or None)
    except ValueError as err:  # an existing collection of another shape
        raise CliError(f"{err}; choose another --collection (env FERN_QDRANT_COLLECTION)") from None
    except FernError as err:
        raise CliError(_sidecar_problem(err, client.fern.target)) from None
    except Exception as err:  # Qdrant refused to create or describe the collection
        raise CliError(_qdrant_problem(err, args.qdrant)) from None


def _ingest_error(err: Any, args: argparse.Namespace, target: str) -> CliError:
    """The one line for an ingest that stopped: the bad line itself, or how far it got."""
    cause = err.__cause__
    if isinstance(cause, RecordError):
        done = (f" ({err.rows_upserted:,} records are in {args.collection!r}; fix the "
                f"line and run the same command again: nothing is duplicated)"
                if err.rows_upserted else "")
        return CliError(f"{cause}{done}")
    return CliError(str(err))


def _accessor(get: Callable[[Any], Any], what: str, flag: str) -> Callable[[Line], Any]:
    """`get` applied to a Line's record; a missing field is a RecordError naming the line and flag."""
    def access(line: Line) -> Any:
        try:
            return get(line.record)
        except (KeyError, AttributeError) as err:
            raise RecordError(f"{line.where}: no field {err} for the record's {what}: name the "
                              f"field with {flag}") from None
        except (IndexError, ValueError) as err:
            raise RecordError(f"{line.where}: cannot build the record's {what} ({err}): check "
                              f"{flag}") from None
    return access


def _text(spec: str) -> Callable[[Line], str]:
    from adapters.qdrant.ingest import text_getter

    get = _accessor(text_getter(spec), "text", "--text (env FERN_QDRANT_TEXT)")

    def text(line: Line) -> str:
        value = get(line)
        if not isinstance(value, str):
            raise RecordError(f"{line.where}: the text is {type(value).__name__}, not a string: "
                              f"name a text field with --text (env FERN_QDRANT_TEXT)")
        return value
    return text


def _id(spec: str) -> Callable[[Line], Any]:
    from adapters.qdrant.ingest import id_getter

    get = _accessor(id_getter(spec), "id", "--id (env FERN_QDRANT_ID)")

    def record_id(line: Line) -> Any:
        value = get(line)
        if value is None:
            raise RecordError(f"{line.where}: the id is null; every record needs an id "
                              f"(name its field with --id, env FERN_QDRANT_ID)")
        return value
    return record_id


def _payload(fields: list[str] | None) -> Callable[[Line], dict[str, Any]]:
    from adapters.qdrant.ingest import payload_getter

    return _accessor(payload_getter(fields), "payload", "--payload (env FERN_QDRANT_PAYLOAD)")


def _location_kwargs(location: str, api_key: str | None) -> dict[str, Any]:
    """QdrantClient keyword arguments for a URL, ':memory:' or a local directory."""
    if location == ":memory:":
        return {"location": location}
    if location.startswith(("http://", "https://")):
        return {"url": location, "api_key": api_key}
    return {"path": location}
