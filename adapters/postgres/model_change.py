"""Zero-downtime model change: a shadow vectorizer fills a new column, then is swapped in for the old one."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import psycopg
from psycopg import sql

from adapters.postgres.catalog import (Vectorizer, get_vectorizer, insert_vectorizer, model_info,
                                       vectorizer_by_id)
from adapters.postgres.ddl import create_chunk_table, ensure_vector_column, index_distance, table_columns
from adapters.postgres.errors import VectorizerError
from adapters.postgres.names import index_name
from adapters.postgres.sparse import ensure_sparse_column
from adapters.postgres.triggers import (backfill, drop_df_triggers, drop_triggers, install_df_triggers,
                                        install_triggers)

if TYPE_CHECKING:
    from sidecar.client import FernClient


def alter_vectorizer(conn: psycopg.Connection, table: str | tuple[str, str], *, model: str,
                     client: FernClient | None = None, target_column: str | None = None,
                     prompt: str | None = None) -> Vectorizer:
    """Start a zero-downtime model change; returns the shadow vectorizer.

    The shadow fills a new column (or chunk table) with the new model in the background,
    kept fresh by its own triggers, while searches keep using the current one. When its
    queue is empty a worker swaps it in atomically (see `swap_if_ready`) and drops the old
    column and its index. A vectorizer with sparse vectors gets them afresh from the new
    model too (its shadow fills its own sparse column and document frequencies).
    """
    v = get_vectorizer(conn, table, target_column)
    info = model_info(client, model)
    distance = index_distance(info)
    with conn.transaction():
        conn.execute(sql.SQL("LOCK TABLE {} IN SHARE ROW EXCLUSIVE MODE").format(v.table))
        pending = conn.execute("SELECT id FROM fern.vectorizers WHERE replaces = %s",
                               (v.id,)).fetchone()
        if pending:
            raise VectorizerError(f"{v.qualified_table}.{v.target_column} is already changing "
                                  f"model (vectorizer {pending[0]})")
        new_column = index_name(v.target_column, "next")
        keys = list(zip(v.key_columns, v.key_types))
        if v.chunking == "split":
            assert v.chunk_table is not None
            chunk_table = index_name(v.chunk_table, "next")
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(
                sql.Identifier(v.table_schema, chunk_table)))
            create_chunk_table(conn, v.table_schema, chunk_table, keys, v.target_column,
                               info.dimensions, distance)
            target = v.target_column
            sparse_column = v.sparse_column
            if sparse_column is not None:
                ensure_sparse_column(conn, sql.Identifier(v.table_schema, chunk_table),
                                     v.table_schema, chunk_table, sparse_column,
                                     table_columns(conn, v.table_schema, chunk_table))
        else:
            chunk_table = None
            conn.execute(sql.SQL("ALTER TABLE {} DROP COLUMN IF EXISTS {}").format(
                v.table, sql.Identifier(new_column)))
            ensure_vector_column(conn, v.table, v.table_schema, v.table_name, new_column,
                                 info.dimensions, distance)
            target = new_column
            sparse_column = None
            if v.sparse_column is not None:
                sparse_column = index_name(new_column, "sparse")
                conn.execute(sql.SQL("ALTER TABLE {} DROP COLUMN IF EXISTS {}").format(
                    v.table, sql.Identifier(sparse_column)))
                ensure_sparse_column(conn, v.table, v.table_schema, v.table_name, sparse_column,
                                     table_columns(conn, v.table_schema, v.table_name))
        # The shadow is the current row with the new model, filling its own column, not hybrid.
        current = vectorizer_by_id(conn, v.id)
        if current is None:
            raise VectorizerError(f"the vectorizer on {v.qualified_table}.{v.target_column} "
                                  f"was dropped while its model change began")
        # Capped at the new model's limit; a truncating vectorizer's shadow records that limit.
        limit = (info.max_tokens if current.chunk_tokens is None
                 else min(current.chunk_tokens, info.max_tokens))
        shadow = insert_vectorizer(conn, replace(
            current, target_column=target, model=info.name, dimensions=info.dimensions,
            max_tokens=info.max_tokens, distance=distance,
            prompt=prompt if prompt is not None else v.prompt, chunk_table=chunk_table,
            chunk_tokens=limit, hybrid=False, tsv_column=None, language=None, replaces=v.id,
            tsv_created=False, parked_error=None, parked_at=None, sparse_column=sparse_column,
            sparse_learned=bool(sparse_column and info.learned_sparse)))
        install_triggers(conn, shadow)
        queued = backfill(conn, shadow)
    return replace(shadow, backfilled=queued)


def swap_if_ready(conn: psycopg.Connection, shadow: Vectorizer) -> bool:
    """Swap a finished shadow in for the vectorizer it replaces, in one transaction.

    Ready means the shadow's queue is empty, checked under an ACCESS EXCLUSIVE lock on the
    table so no write can slip in between. Searches see the old column before the commit
    and the new one (under the old name) after it. Returns True when swapped.
    """
    assert shadow.replaces is not None
    with conn.transaction():
        rows = conn.execute("SELECT id FROM fern.vectorizers WHERE id IN (%s, %s) FOR UPDATE",
                            (shadow.id, shadow.replaces)).fetchall()
        if len(rows) != 2:
            return False
        if conn.execute("SELECT 1 FROM fern.queue WHERE vectorizer_id = %s LIMIT 1",
                        (shadow.id,)).fetchone():
            return False
        old = vectorizer_by_id(conn, shadow.replaces)
        assert old is not None  # locked FOR UPDATE above
        conn.execute(sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(old.table))
        if conn.execute("SELECT 1 FROM fern.queue WHERE vectorizer_id = %s LIMIT 1",
                        (shadow.id,)).fetchone():
            return False
        drop_triggers(conn, shadow)
        # The old sparse vectors' df triggers go with them; the shadow's sparse vectors and
        # document frequencies become the vectorizer's.
        drop_df_triggers(conn, old)
        if old.sparse_column is not None:
            conn.execute("DELETE FROM fern.sparse_df WHERE vectorizer_id = %s", (old.id,))
            conn.execute("DELETE FROM fern.sparse_docs WHERE vectorizer_id = %s", (old.id,))
            conn.execute("UPDATE fern.sparse_df SET vectorizer_id = %s WHERE vectorizer_id = %s",
                         (old.id, shadow.id))
            conn.execute("UPDATE fern.sparse_docs SET vectorizer_id = %s WHERE vectorizer_id = %s",
                         (old.id, shadow.id))
        if old.chunking == "split":
            assert old.chunk_table is not None and shadow.chunk_table is not None
            conn.execute(sql.SQL("DROP TABLE {}").format(old.chunks))
            conn.execute(sql.SQL("ALTER TABLE {} RENAME TO {}").format(
                shadow.chunks, sql.Identifier(old.chunk_table)))
            conn.execute(sql.SQL("ALTER INDEX IF EXISTS {} RENAME TO {}").format(
                sql.Identifier(old.table_schema, index_name(shadow.chunk_table,
                                                            shadow.target_column, "hnsw")),
                sql.Identifier(index_name(old.chunk_table, old.target_column, "hnsw"))))
        else:
            conn.execute(sql.SQL("ALTER TABLE {} DROP COLUMN {}").format(
                old.table, sql.Identifier(old.target_column)))
            conn.execute(sql.SQL("ALTER TABLE {} RENAME COLUMN {} TO {}").format(
                old.table, sql.Identifier(shadow.target_column),
                sql.Identifier(old.target_column)))
            conn.execute(sql.SQL("ALTER INDEX IF EXISTS {} RENAME TO {}").format(
                sql.Identifier(old.table_schema, index_name(old.table_name,
                                                            shadow.target_column, "hnsw")),
                sql.Identifier(index_name(old.table_name, old.target_column, "hnsw"))))
            if old.sparse_column is not None and shadow.sparse_column is not None:
                conn.execute(sql.SQL("ALTER TABLE {} DROP COLUMN {}").format(
                    old.table, sql.Identifier(old.sparse_column)))
                conn.execute(sql.SQL("ALTER TABLE {} RENAME COLUMN {} TO {}").format(
                    old.table, sql.Identifier(shadow.sparse_column),
                    sql.Identifier(old.sparse_column)))
        # Everything the old vectorizer still had queued is covered by the shadow's vectors.
        conn.execute("DELETE FROM fern.queue WHERE vectorizer_id = %s", (old.id,))
        conn.execute("UPDATE fern.failed SET vectorizer_id = %s WHERE vectorizer_id = %s",
                     (old.id, shadow.id))
        conn.execute("""UPDATE fern.vectorizers o SET model = s.model, dimensions = s.dimensions,
                            max_tokens = s.max_tokens, distance = s.distance, prompt = s.prompt,
                            chunk_tokens = s.chunk_tokens, sparse_learned = s.sparse_learned,
                            generation = o.generation + 1
                          FROM fern.vectorizers s WHERE o.id = %s AND s.id = %s""",
                     (old.id, shadow.id))
        conn.execute("DELETE FROM fern.vectorizers WHERE id = %s", (shadow.id,))
        swapped = vectorizer_by_id(conn, old.id)
        assert swapped is not None
        install_df_triggers(conn, swapped)
    return True
