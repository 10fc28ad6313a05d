"""What a vectorizer adds to a user's table: the vector column or chunk table, HNSW index, tsvector column."""

from __future__ import annotations

from typing import TYPE_CHECKING

import psycopg
from psycopg import sql

from adapters.postgres.catalog import Vectorizer
from adapters.postgres.errors import VectorizerError
from adapters.postgres.names import index_name
from adapters.postgres.template import Template, text_expression

if TYPE_CHECKING:
    from sidecar.client import ModelInfo

_OPCLASS = {"cosine": "vector_cosine_ops", "dot": "vector_ip_ops"}


def index_distance(info: ModelInfo) -> str:
    """The model's distance where pgvector has an operator class for it, else cosine."""
    return info.distance if info.distance in _OPCLASS else "cosine"


def table_columns(conn: psycopg.Connection, schema: str, table: str) -> dict[str, str]:
    """Column name -> SQL type (format_type) of schema.table, in column order."""
    rows = conn.execute(
        """SELECT a.attname, format_type(a.atttypid, a.atttypmod)
             FROM pg_attribute a
            WHERE a.attrelid = (SELECT c.oid FROM pg_class c JOIN pg_namespace n
                                    ON n.oid = c.relnamespace
                                 WHERE n.nspname = %s AND c.relname = %s)
              AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum""",
        (schema, table)).fetchall()
    return {name: typ for name, typ in rows}


def primary_key(conn: psycopg.Connection, schema: str, table: str) -> list[tuple[str, str]]:
    """(column, SQL type) of schema.table's primary key, in key order; empty when it has none."""
    rows = conn.execute(
        """SELECT a.attname, format_type(a.atttypid, a.atttypmod)
             FROM pg_index i
             JOIN pg_class c ON c.oid = i.indrelid
             JOIN pg_namespace n ON n.oid = c.relnamespace
             CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)
             JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = k.attnum
            WHERE n.nspname = %s AND c.relname = %s AND i.indisprimary
            ORDER BY k.ord""", (schema, table)).fetchall()
    return [(r[0], r[1]) for r in rows]


def _has_index_on(conn: psycopg.Connection, schema: str, table: str, column: str,
                  method: str) -> bool:
    row = conn.execute(
        """SELECT 1 FROM pg_index i
             JOIN pg_class t ON t.oid = i.indrelid
             JOIN pg_namespace n ON n.oid = t.relnamespace
             JOIN pg_class ic ON ic.oid = i.indexrelid
             JOIN pg_am am ON am.oid = ic.relam
             JOIN pg_attribute a ON a.attrelid = t.oid AND a.attnum = i.indkey[0]
            WHERE n.nspname = %s AND t.relname = %s AND a.attname = %s AND am.amname = %s""",
        (schema, table, column, method)).fetchone()
    return row is not None


def ensure_vector_column(conn: psycopg.Connection, table: sql.Identifier, schema: str,
                         name: str, column: str, dimensions: int, distance: str) -> None:
    """Add the vector column (or check the one there has the model's size) and its HNSW index."""
    columns = table_columns(conn, schema, name)
    if column in columns:
        if columns[column] != f"vector({dimensions})":
            raise VectorizerError(f"column {column!r} of {schema}.{name} is {columns[column]}, "
                                  f"but the model gives vector({dimensions})")
    else:
        conn.execute(sql.SQL("ALTER TABLE {} ADD COLUMN {} vector({})").format(
            table, sql.Identifier(column), sql.Literal(dimensions)))
    if not _has_index_on(conn, schema, name, column, "hnsw"):
        conn.execute(sql.SQL("CREATE INDEX {} ON {} USING hnsw ({} {})").format(
            sql.Identifier(index_name(name, column, "hnsw")), table, sql.Identifier(column),
            sql.SQL(_OPCLASS[distance])))


def create_chunk_table(conn: psycopg.Connection, v_schema: str, chunk_table: str,
                       keys: list[tuple[str, str]], target: str, dimensions: int,
                       distance: str) -> None:
    """The chunk table of a split vectorizer: the row key, chunk index and text, one vector a chunk."""
    ident = sql.Identifier(v_schema, chunk_table)
    key_defs = [sql.SQL("{} {} NOT NULL").format(sql.Identifier(k), sql.SQL(t)) for k, t in keys]
    conn.execute(sql.SQL("""CREATE TABLE IF NOT EXISTS {} ({}, chunk_index int NOT NULL,
                            chunk_text text NOT NULL, {} vector({}) NOT NULL,
                            PRIMARY KEY ({}, chunk_index))""").format(
        ident, sql.SQL(", ").join(key_defs), sql.Identifier(target), sql.Literal(dimensions),
        sql.SQL(", ").join(sql.Identifier(k) for k, _ in keys)))
    if not _has_index_on(conn, v_schema, chunk_table, target, "hnsw"):
        conn.execute(sql.SQL("CREATE INDEX {} ON {} USING hnsw ({} {})").format(
            sql.Identifier(index_name(chunk_table, target, "hnsw")), ident,
            sql.Identifier(target), sql.SQL(_OPCLASS[distance])))


def ensure_tsvector(conn: psycopg.Connection, v_table: sql.Identifier, schema: str, name: str,
                    tsv_column: str, template: Template, language: str) -> bool:
    """Add the generated tsvector column (unless there) and its GIN index; True when added."""
    columns = table_columns(conn, schema, name)
    created = tsv_column not in columns
    if created:
        conn.execute(sql.SQL("""ALTER TABLE {} ADD COLUMN {} tsvector
                                GENERATED ALWAYS AS (to_tsvector({}::regconfig, {})) STORED""").format(
            v_table, sql.Identifier(tsv_column), sql.Literal(language),
            text_expression(template)))
    elif columns[tsv_column] != "tsvector":
        raise VectorizerError(f"column {tsv_column!r} of {schema}.{name} exists and is "
                              f"{columns[tsv_column]}, not tsvector")
    if not _has_index_on(conn, schema, name, tsv_column, "gin"):
        conn.execute(sql.SQL("CREATE INDEX {} ON {} USING gin ({})").format(
            sql.Identifier(index_name(name, tsv_column, "gin")), v_table,
            sql.Identifier(tsv_column)))
    return created


def drop_target(conn: psycopg.Connection, v: Vectorizer) -> None:
    """Drop what `v` added: its vector (and sparse) column or chunk table, and the tsvector column or GIN index."""
    if v.tsv_column is not None:
        if v.tsv_created:
            conn.execute(sql.SQL("ALTER TABLE {} DROP COLUMN IF EXISTS {}").format(
                v.table, sql.Identifier(v.tsv_column)))
        else:
            conn.execute(sql.SQL("DROP INDEX IF EXISTS {}").format(sql.Identifier(
                v.table_schema, index_name(v.table_name, v.tsv_column, "gin"))))
    if v.chunking == "split":
        conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(v.chunks))
    else:
        conn.execute(sql.SQL("ALTER TABLE {} DROP COLUMN IF EXISTS {}").format(
            v.table, sql.Identifier(v.target_column)))
        if v.sparse_column is not None:
            conn.execute(sql.SQL("ALTER TABLE {} DROP COLUMN IF EXISTS {}").format(
                v.table, sql.Identifier(v.sparse_column)))
