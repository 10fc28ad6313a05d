"""Vectorizers: attach a vector column to a table and keep it true to the row's text.

`create_vectorizer` adds the vector column (dimension from the sidecar's ListModels) and
an HNSW index, generates trigger functions that enqueue row keys in `fern.queue` and
NOTIFY the workers (INSERT; UPDATE only when a source column really changed;
DELETE/TRUNCATE where chunk rows must go), and enqueues every existing row (backfill).
An UPDATE of a key column enqueues the row under its new key; entries queued under the old
key find no row and are dropped by the worker. The trigger functions are SECURITY DEFINER,
executable by no one but their owner, and refuse to run on any table but their
vectorizer's, so a role that may attach triggers to a table of its own cannot fire them.
`alter_vectorizer(model=...)` starts a zero-downtime model change: a shadow vectorizer
fills a new column in the background; a worker swaps it in when it is complete.

Every name that comes from a user reaches SQL through `psycopg.sql.Identifier` (or
`Literal`), also inside the generated trigger functions' bodies.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Sequence

import psycopg
from psycopg import sql

from adapters.postgres.catalog import (Vectorizer, get_vectorizer, insert_vectorizer, list_vectorizers,
                                       model_info)
from adapters.postgres.ddl import (create_chunk_table, drop_target, ensure_tsvector, ensure_vector_column,
                                   index_distance, primary_key, table_columns)
from adapters.postgres.errors import VectorizerError
from adapters.postgres.installer import install, is_installed
from adapters.postgres.model_change import alter_vectorizer, swap_if_ready
from adapters.postgres.names import index_name, resolve_table, split_table_name
from adapters.postgres.sparse import ensure_sparse_column, seed_df
from adapters.postgres.template import parse_template, template_from_columns
from adapters.postgres.triggers import (NOTIFY_CHANNEL, backfill, drop_triggers, install_triggers,
                                        refresh_triggers)

if TYPE_CHECKING:
    from sidecar.client import FernClient

__all__ = ["NOTIFY_CHANNEL", "Vectorizer", "VectorizerError", "alter_vectorizer", "backfill",
           "create_vectorizer", "drop_vectorizer", "get_vectorizer", "list_vectorizers",
           "refresh_triggers", "resolve_table", "split_table_name", "swap_if_ready"]


def create_vectorizer(conn: psycopg.Connection, table: str | tuple[str, str],
                      source: str | Sequence[str], *, client: FernClient | None = None,
                      target_column: str = "embedding", model: str = "",
                      prompt: str | None = "passage", chunking: str = "truncate",
                      chunk_tokens: int | None = None, chunk_overlap: int = 32,
                      chunk_table: str | None = None, hybrid: bool = False,
                      language: str = "english", tsv_column: str | None = None,
                      sparse: bool | None = None, do_backfill: bool = True) -> Vectorizer:
    """Attach a vectorizer to `table` and enqueue every existing row.

    `source` is a template ("{title}\\n\\n{body}") when a string, else a list of column
    names joined by blank lines. `prompt` is the prompt name documents are embedded with
    ("passage": the model's passage/document prompt where it has one, else none).
    `chunking` is "truncate" (one vector per row, the text cut at the model's limit by the
    sidecar) or "split" (a chunk table `<table>_<target>_chunks` with one vector per chunk
    of `chunk_tokens` tokens overlapping by `chunk_overlap`; see chunking.py).
    The model's name, dimension and limit come from the sidecar (`client`, a FernClient).
    Runs in one transaction: either everything is in place, or nothing changed. It holds a
    SHARE ROW EXCLUSIVE lock on the table (reads go on, writes wait) while it adds the
    column and builds the HNSW index, which is instant: the column is still empty and
    vectors enter the index as the workers write them. `hybrid` adds a stored generated
    tsvector column, which rewrites the table under an exclusive lock: on a large busy
    table, add that column (and its GIN index, CONCURRENTLY) beforehand and pass its name
    as `tsv_column`.
    `sparse` adds a `sparsevec(1000000000)` column `<target>_sparse` (in split mode, to the
    chunk table) that the worker fills from the same Embed call as the dense vector: BM25
    lexical terms, or the model's learned sparse weights (BGE-M3); hybrid search fuses it
    with the dense list. The default (None) is on whenever the served model gives sparse
    vectors, which every embedding model Fern serves does (see sparse.py for the cost).
    """
    if chunking not in ("truncate", "split"):
        raise VectorizerError(f"chunking must be 'truncate' or 'split', got {chunking!r}")
    if isinstance(source, str):
        template = parse_template(source)
    else:
        template = template_from_columns(list(source))
    if sparse is not None and not isinstance(sparse, bool):
        raise VectorizerError(f"sparse must be True, False or None (on when the model gives "
                              f"sparse vectors), got {sparse!r}")
    info = model_info(client, model)
    if sparse is None:
        sparse = "sparse" in info.outputs
    elif sparse and "sparse" not in info.outputs:
        raise VectorizerError(f"sparse=True, but model {info.name!r} gives no sparse vectors "
                              f"(it returns {', '.join(info.outputs)})")
    sparse_column = index_name(target_column, "sparse") if sparse else None
    if chunking == "split":
        chunk_tokens = chunk_tokens or info.max_tokens
        if not 8 <= chunk_tokens <= info.max_tokens:
            raise VectorizerError(f"chunk_tokens must be between 8 and the model's limit "
                                  f"{info.max_tokens}, got {chunk_tokens}")
        if not 0 <= chunk_overlap <= chunk_tokens // 2:
            raise VectorizerError(f"chunk_overlap must be in [0, chunk_tokens/2], got {chunk_overlap}")
    distance = index_distance(info)
    if not is_installed(conn):
        install(conn)
    with conn.transaction():
        schema, name = resolve_table(conn, table)
        t_ident = sql.Identifier(schema, name)
        # Serializes with other DDL on the table and with concurrent create_vectorizer calls.
        conn.execute(sql.SQL("LOCK TABLE {} IN SHARE ROW EXCLUSIVE MODE").format(t_ident))
        columns = table_columns(conn, schema, name)
        missing = [c for c in template.columns if c not in columns]
        if missing:
            raise VectorizerError(f"table {schema}.{name} has no column {missing[0]!r} "
                                  f"(named by the source {template.source!r})")
        keys = primary_key(conn, schema, name)
        if not keys:
            raise VectorizerError(f"table {schema}.{name} needs a primary key: the queue "
                                  f"refers to rows by it")
        if target_column in template.columns or any(target_column == k for k, _ in keys):
            raise VectorizerError(f"target column {target_column!r} is also a source or key column")
        if sparse_column is not None and (sparse_column in template.columns
                                          or any(sparse_column == k for k, _ in keys)):
            raise VectorizerError(f"sparse column {sparse_column!r} (the target column "
                                  f"{target_column!r} + '_sparse') is also a source or key column")
        exists = conn.execute("""SELECT 1 FROM fern.vectorizers WHERE table_schema = %s
                                 AND table_name = %s AND target_column = %s""",
                              (schema, name, target_column)).fetchone()
        if exists:
            raise VectorizerError(f"{schema}.{name}.{target_column} already has a vectorizer; "
                                  f"use alter_vectorizer to change its model")
        if chunking == "split":
            chunk_table = chunk_table or index_name(name, target_column, "chunks")
            create_chunk_table(conn, schema, chunk_table, keys, target_column,
                               info.dimensions, distance)
            if sparse_column is not None:
                ensure_sparse_column(conn, sql.Identifier(schema, chunk_table), schema,
                                     chunk_table, sparse_column,
                                     table_columns(conn, schema, chunk_table))
        else:
            chunk_table = None
            ensure_vector_column(conn, t_ident, schema, name, target_column, info.dimensions,
                                 distance)
            if sparse_column is not None:
                ensure_sparse_column(conn, t_ident, schema, name, sparse_column, columns)
        if hybrid:
            tsv_column = tsv_column or f"{target_column}_tsv"
            tsv_created = ensure_tsvector(conn, t_ident, schema, name, tsv_column, template,
                                          language)
        else:
            tsv_column, tsv_created = None, False
        v = insert_vectorizer(conn, Vectorizer(
            id=0, table_schema=schema, table_name=name, target_column=target_column,
            key_columns=tuple(k for k, _ in keys), key_types=tuple(t for _, t in keys),
            source_columns=tuple(template.columns), template=template.source, model=info.name,
            dimensions=info.dimensions, max_tokens=info.max_tokens, distance=distance,
            prompt=prompt, chunking=chunking, chunk_table=chunk_table,
            chunk_tokens=chunk_tokens if chunking == "split" else None,
            chunk_overlap=chunk_overlap if chunking == "split" else None, hybrid=hybrid,
            tsv_column=tsv_column, language=language if hybrid else None, generation=0,
            replaces=None, tsv_created=tsv_created, sparse_column=sparse_column,
            sparse_learned=bool(sparse and info.learned_sparse)))
        install_triggers(conn, v)
        if sparse_column is not None:
            # A sparse column that was already there may hold vectors: count them.
            seed_df(conn, v)
        queued = backfill(conn, v) if do_backfill else 0
    return replace(v, backfilled=queued)


def drop_vectorizer(conn: psycopg.Connection, table: str | tuple[str, str],
                    target_column: str | None = None, *, drop_column: bool = False) -> None:
    """Remove a vectorizer's triggers, queue and failed items (and its shadow, if any).

    The vector column (or chunk table) stays unless `drop_column`, which also drops the
    hybrid tsvector column Fern added (its GIN index goes with it) or, when the column was
    the caller's own, only the GIN index Fern built on it.
    """
    v = get_vectorizer(conn, table, target_column)
    with conn.transaction():
        for other in list_vectorizers(conn):
            if other.replaces == v.id:
                drop_triggers(conn, other)
                drop_target(conn, other)
        drop_triggers(conn, v)
        conn.execute("DELETE FROM fern.vectorizers WHERE id = %s", (v.id,))
        if drop_column:
            drop_target(conn, v)
