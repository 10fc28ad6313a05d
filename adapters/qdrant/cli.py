"""The `fern qdrant` verbs (`fern qdrant ingest`), registered by sidecar.cli."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any, TextIO


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
        help="embed a JSONL file through the sidecar's BATCH lane and upsert it into a collection",
        description=(
            "Stream JSON lines through the sidecar (EmbedStream, BATCH lane) and upsert them "
            "into a Qdrant collection with a dense and a sparse vector. Point ids are UUIDs "
            "derived from each record's id, so re-running after a failure completes the "
            "collection without duplicates."
        ),
    )
    ingest.add_argument("file", help="JSON-lines file, one record (object) a line; '-' reads stdin")
    ingest.add_argument("--collection", required=True, help="Qdrant collection name")
    ingest.add_argument("--text", default="text",
                        help="record field holding the text, or a template such as "
                             "'{title}\\n\\n{body}' (default: text)")
    ingest.add_argument("--id", dest="id_field", default="id",
                        help="record field holding the record's id (default: id)")
    ingest.add_argument("--payload", default=None,
                        help="comma-separated fields to store as payload (default: the whole record)")
    ingest.add_argument("--model", default=os.environ.get("FERN_MODEL", ""),
                        help="sidecar model name (env FERN_MODEL; default: the sidecar's default)")
    ingest.add_argument("--target", default=None,
                        help="sidecar address host:port (env FERN_TARGET)")
    ingest.add_argument("--qdrant", default=os.environ.get("FERN_QDRANT"),
                        help="Qdrant location: an http(s):// URL, ':memory:' or a local directory "
                             "(env FERN_QDRANT)")
    ingest.add_argument("--api-key", default=os.environ.get("QDRANT_API_KEY"),
                        help="Qdrant API key for a server URL (env QDRANT_API_KEY)")
    ingest.add_argument("--no-sparse", action="store_true",
                        help="store only the dense vector (no hybrid search)")
    ingest.add_argument("--quantization", choices=("int8", "binary"), default=None,
                        help="quantization config for a newly created collection")
    ingest.add_argument("--batch-size", type=int, default=64,
                        help="records per sidecar request and per upsert (default 64)")
    ingest.add_argument("--in-flight", type=int, default=8,
                        help="sidecar requests in flight at most (bounds memory; default 8)")
    ingest.set_defaults(func=run_ingest)
    return parser


def read_jsonl(stream: TextIO, source: str) -> Iterator[dict[str, Any]]:
    """Yield the JSON objects of a JSON-lines stream; errors name the source and line number."""
    for lineno, line in enumerate(stream, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{source}:{lineno}: not valid JSON ({err.msg})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{source}:{lineno}: expected a JSON object, got {type(record).__name__}")
        yield record


def run_ingest(args: argparse.Namespace) -> int:
    """Run `fern qdrant ingest` from parsed arguments; returns the exit status."""
    from sidecar.client import FernClient, FernError

    from adapters.qdrant.client import FernQdrantClient
    from adapters.qdrant.ingest import IngestError

    if not args.qdrant:
        print("fern qdrant ingest: give --qdrant (a URL, ':memory:' or a directory) "
              "or set FERN_QDRANT", file=sys.stderr)
        return 2
    fern = FernClient(args.target)
    client = FernQdrantClient(**_location_kwargs(args.qdrant, args.api_key), fern=fern)
    payload = [f.strip() for f in args.payload.split(",") if f.strip()] if args.payload else None
    try:
        client.setup_collection(args.collection, model=args.model, sparse=None if args.no_sparse else "sparse",
                                quantization=args.quantization)
        stdin = args.file == "-"
        # nullcontext: stdin is read, not closed.
        with nullcontext(sys.stdin) if stdin else Path(args.file).open(encoding="utf-8") as stream:
            records = read_jsonl(stream, "<stdin>" if stdin else args.file)
            summary = client.ingest(args.collection, records, text=args.text, id=args.id_field,
                                    payload=payload, model=args.model or None,
                                    batch_size=args.batch_size, max_in_flight=args.in_flight)
    except (IngestError, FernError, ValueError, OSError) as err:
        print(f"fern qdrant ingest: {err}", file=sys.stderr)
        return 1
    finally:
        client.close()
        fern.close()
    print(summary)
    return 0


def _location_kwargs(location: str, api_key: str | None) -> dict[str, Any]:
    """QdrantClient keyword arguments for a URL, ':memory:' or a local directory."""
    if location == ":memory:":
        return {"location": location}
    if location.startswith(("http://", "https://")):
        return {"url": location, "api_key": api_key}
    return {"path": location}
