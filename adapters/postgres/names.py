"""Table and index names: reading a user's table name, finding the table, names PostgreSQL will not cut."""

from __future__ import annotations

import hashlib

import psycopg

from adapters.postgres.delimited import read_delimited
from adapters.postgres.errors import VectorizerError

_PG_NAME_MAX = 63


def split_table_name(table: str | tuple[str, str]) -> list[tuple[str | None, str]]:
    """The (schema, name) readings of `table`, most literal first.

    A tuple is exact. A string is taken verbatim (no case folding, quotes are part of the
    name) as a table in the search_path, else split at its first dot as schema.table.
    A string that starts with a double quote is read as SQL (`"My.Schema"."T"`).
    """
    if isinstance(table, tuple):
        schema, name = table
        return [(schema, name)]
    if table.startswith('"'):
        return [_split_quoted(table)]
    readings: list[tuple[str | None, str]] = [(None, table)]
    if "." in table:
        schema, name = table.split(".", 1)
        readings.append((schema, name))
    return readings


def _split_quoted(table: str) -> tuple[str | None, str]:
    parts: list[str] = []
    i = 0
    while i < len(table):
        if table[i] != '"':
            raise VectorizerError(f"table name {table!r}: expected a double quote at {i}")
        read = read_delimited(table, i + 1, '"')
        if read is None:
            raise VectorizerError(f"table name {table!r}: unclosed double quote")
        name, i = read
        parts.append(name)
        if i < len(table):
            if table[i] != "." or len(parts) > 1 or i + 1 == len(table):  # '"a".' names no table
                raise VectorizerError(f"table name {table!r}: expected \"schema\".\"table\"")
            i += 1
    return (None, parts[0]) if len(parts) == 1 else (parts[0], parts[1])


def resolve_table(conn: psycopg.Connection, table: str | tuple[str, str]) -> tuple[str, str]:
    """(schema, table) of an existing ordinary or partitioned table; search_path when unqualified."""
    for schema, name in split_table_name(table):
        row = conn.execute(
            """SELECT n.nspname, c.relname FROM pg_class c
                 JOIN pg_namespace n ON n.oid = c.relnamespace
                WHERE c.relname = %s AND c.relkind IN ('r', 'p')
                  AND (CASE WHEN %s::text IS NULL THEN pg_table_is_visible(c.oid)
                            ELSE n.nspname = %s END)""", (name, schema, schema)).fetchone()
        if row is not None:
            return row[0], row[1]
    raise VectorizerError(f"table {table!r} does not exist (or is not in the search_path)")


def index_name(*parts: str) -> str:
    """A readable index/table name that stays unique: PostgreSQL would silently cut one over
    63 bytes, and two long names cut alike (a table's HNSW and GIN indexes) would collide,
    so a long one is cut shorter and ends with a hash of the whole."""
    name = "_".join(parts)
    if len(name.encode()) <= _PG_NAME_MAX:
        return name
    digest = hashlib.md5(name.encode()).hexdigest()[:8]
    while len(name.encode()) > _PG_NAME_MAX - len(digest) - 1:
        name = name[:-1]
    return f"{name}_{digest}"
