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

import hashlib
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import TYPE_CHECKING, Sequence

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from adapters.postgres.delimited import read_delimited
from adapters.postgres.installer import install, is_installed
from adapters.postgres.template import (Template, parse_template, template_from_columns,
                                        text_expression)

if TYPE_CHECKING:
    from sidecar.client import FernClient, ModelInfo

NOTIFY_CHANNEL = "fern_queue"
_OPCLASS = {"cosine": "vector_cosine_ops", "dot": "vector_ip_ops"}
_DISTANCE_OP = {"cosine": "<=>", "dot": "<#>"}
_PG_NAME_MAX = 63


class VectorizerError(ValueError):
    """A vectorizer that cannot be created or changed as asked; the message names the input."""


@dataclass(frozen=True)
class Vectorizer:
    """One row of fern.vectorizers."""

    id: int
    table_schema: str
    table_name: str
    target_column: str
    key_columns: tuple[str, ...]
    key_types: tuple[str, ...]
    source_columns: tuple[str, ...]
    template: str
    model: str
    dimensions: int
    max_tokens: int
    distance: str
    prompt: str | None
    chunking: str
    chunk_table: str | None
    chunk_tokens: int | None
    chunk_overlap: int | None
    hybrid: bool
    tsv_column: str | None
    language: str | None
    generation: int
    replaces: int | None
    tsv_created: bool = False
    # Set while the vectorizer's SQL fails and workers skip it (see worker.py).
    parked_error: str | None = field(default=None, compare=False)
    parked_at: datetime | None = field(default=None, compare=False)
    backfilled: int = field(default=0, compare=False)

    @property
    def table(self) -> sql.Identifier:
        return sql.Identifier(self.table_schema, self.table_name)

    @property
    def qualified_table(self) -> str:
        return f"{self.table_schema}.{self.table_name}"

    @property
    def chunks(self) -> sql.Identifier:
        assert self.chunk_table is not None
        return sql.Identifier(self.table_schema, self.chunk_table)

    @property
    def parsed_template(self) -> Template:
        return parse_template(self.template)

    def text_sql(self, alias: str | None = None) -> sql.Composed:
        """The row's text as an SQL expression over `alias` (the template, rendered)."""
        return text_expression(self.parsed_template, alias)

    def key_json_sql(self, alias: str) -> sql.Composed:
        """jsonb_build_array(alias.k1, ...): how a row key is stored in fern.queue."""
        return sql.SQL("jsonb_build_array({})").format(
            sql.SQL(", ").join(sql.Identifier(alias, k) for k in self.key_columns))

    def key_match_sql(self, alias: str, json_expr: sql.Composable) -> sql.Composed:
        """alias.k1 = (json->>0)::type1 AND ...: a row matched by its queued key."""
        return sql.SQL(" AND ").join(
            sql.SQL("{} = ({} ->> {})::{}").format(sql.Identifier(alias, k), json_expr,
                                                   sql.Literal(n), sql.SQL(t))
            for n, (k, t) in enumerate(zip(self.key_columns, self.key_types)))

    def distance_operator(self) -> sql.SQL:
        return sql.SQL(_DISTANCE_OP[self.distance])


_COLUMNS = [f.name for f in Vectorizer.__dataclass_fields__.values() if f.name != "backfilled"]


def _from_row(row: dict) -> Vectorizer:
    values = {k: row[k] for k in _COLUMNS}
    for k in ("key_columns", "key_types", "source_columns"):
        values[k] = tuple(values[k])
    return Vectorizer(**values)


def list_vectorizers(conn: psycopg.Connection) -> list[Vectorizer]:
    """Every vectorizer, shadows of model changes included, in id order."""
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute("SELECT * FROM fern.vectorizers ORDER BY id")
        return [_from_row(r) for r in cur.fetchall()]


def get_vectorizer(conn: psycopg.Connection, table: str | tuple[str, str],
                   target_column: str | None = None) -> Vectorizer:
    """The (non-shadow) vectorizer on `table` (and `target_column` when the table has several)."""
    schema, name = resolve_table(conn, table)
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute("""SELECT * FROM fern.vectorizers
                        WHERE table_schema = %s AND table_name = %s AND replaces IS NULL
                          AND (%s::text IS NULL OR target_column = %s) ORDER BY id""",
                    (schema, name, target_column, target_column))
        rows = cur.fetchall()
    if not rows:
        raise VectorizerError(f"table {schema}.{name} has no vectorizer"
                              + (f" on column {target_column!r}" if target_column else ""))
    if len(rows) > 1:
        raise VectorizerError(f"table {schema}.{name} has {len(rows)} vectorizers; "
                              f"name the target column ({', '.join(r['target_column'] for r in rows)})")
    return _from_row(rows[0])


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


def _table_columns(conn: psycopg.Connection, schema: str, table: str) -> dict[str, str]:
    rows = conn.execute(
        """SELECT a.attname, format_type(a.atttypid, a.atttypmod)
             FROM pg_attribute a
            WHERE a.attrelid = (SELECT c.oid FROM pg_class c JOIN pg_namespace n
                                    ON n.oid = c.relnamespace
                                 WHERE n.nspname = %s AND c.relname = %s)
              AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum""",
        (schema, table)).fetchall()
    return {name: typ for name, typ in rows}


def _primary_key(conn: psycopg.Connection, schema: str, table: str) -> list[tuple[str, str]]:
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


def _index_name(*parts: str) -> str:
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


def _ensure_vector_column(conn: psycopg.Connection, table: sql.Identifier, schema: str,
                          name: str, column: str, dimensions: int, distance: str) -> None:
    columns = _table_columns(conn, schema, name)
    if column in columns:
        if columns[column] != f"vector({dimensions})":
            raise VectorizerError(f"column {column!r} of {schema}.{name} is {columns[column]}, "
                                  f"but the model gives vector({dimensions})")
    else:
        conn.execute(sql.SQL("ALTER TABLE {} ADD COLUMN {} vector({})").format(
            table, sql.Identifier(column), sql.Literal(dimensions)))
    if not _has_index_on(conn, schema, name, column, "hnsw"):
        conn.execute(sql.SQL("CREATE INDEX {} ON {} USING hnsw ({} {})").format(
            sql.Identifier(_index_name(name, column, "hnsw")), table, sql.Identifier(column),
            sql.SQL(_OPCLASS[distance])))


def _function_name(v_id: int, kind: str) -> sql.Identifier:
    return sql.Identifier("fern", f"vectorizer_{v_id}_{kind}")


def _trigger_name(v_id: int, kind: str) -> sql.Identifier:
    return sql.Identifier(f"fern_vectorizer_{v_id}_{kind}")


# First statement of every trigger function: it acts for one vectorizer, so it runs only on
# that vectorizer's table (the catalog says which), whoever attached it elsewhere.
_GUARD = sql.SQL("""IF NOT EXISTS (SELECT 1 FROM fern.vectorizers
                    WHERE id = {id} AND table_schema = TG_TABLE_SCHEMA
                      AND table_name = TG_TABLE_NAME) THEN
    RAISE EXCEPTION 'fern: % fired on %.%, which is not the table of vectorizer {id}',
        TG_NAME, quote_ident(TG_TABLE_SCHEMA), quote_ident(TG_TABLE_NAME)
        USING ERRCODE = 'insufficient_privilege';
END IF;""")


def _create_function(conn: psycopg.Connection, v_id: int, kind: str,
                     body: sql.Composable) -> sql.Identifier:
    """A SECURITY DEFINER trigger function, so any role that may write the table may enqueue.

    PostgreSQL checks EXECUTE when a trigger is created, not when it fires: revoking it from
    PUBLIC stops other roles attaching the function to their tables, while every writer of
    the vectorizer's table still fires it.
    """
    name = _function_name(v_id, kind)
    source = sql.SQL("BEGIN\n{}\n{}\nRETURN NULL;\nEND").format(
        _GUARD.format(id=sql.Literal(v_id)), body).as_string(conn)
    conn.execute(sql.SQL("""CREATE OR REPLACE FUNCTION {}() RETURNS trigger LANGUAGE plpgsql
                            SECURITY DEFINER SET search_path = pg_catalog, pg_temp
                            AS {}""").format(name, sql.Literal(source)))
    conn.execute(sql.SQL("REVOKE ALL ON FUNCTION {}() FROM PUBLIC").format(name))
    return name


def _install_triggers(conn: psycopg.Connection, v: Vectorizer) -> None:
    notify = sql.SQL("PERFORM pg_notify({}, {});").format(sql.Literal(NOTIFY_CHANNEL),
                                                          sql.Literal(str(v.id)))
    enqueue_new = sql.SQL(
        "INSERT INTO fern.queue (vectorizer_id, row_key) SELECT {}, {} FROM fern_new n;"
    ).format(sql.Literal(v.id), v.key_json_sql("n"))
    fn = _create_function(conn, v.id, "insert", enqueue_new + sql.SQL("\n") + notify)
    conn.execute(sql.SQL("""CREATE TRIGGER {} AFTER INSERT ON {} REFERENCING NEW TABLE AS fern_new
                            FOR EACH STATEMENT EXECUTE FUNCTION {}()""").format(
        _trigger_name(v.id, "insert"), v.table, fn))

    changed = [sql.SQL("OLD.{c} IS DISTINCT FROM NEW.{c}").format(c=sql.Identifier(c))
               for c in v.source_columns]
    # A key change moves the row to another key: it is queued under the new one (what was
    # queued under the old key finds no row and is dropped), so a row re-keyed before its
    # embedding was written still gets one. Old entries are not deleted here: in
    # `SET id = id + 1` another row may already hold the old key.
    key_changed = sql.SQL(" OR ").join(
        sql.SQL("OLD.{c} IS DISTINCT FROM NEW.{c}").format(c=sql.Identifier(k))
        for k in v.key_columns)
    changed.append(key_changed)
    update_cols = list(v.source_columns) + [k for k in v.key_columns
                                            if k not in v.source_columns]
    body = sql.SQL("INSERT INTO fern.queue (vectorizer_id, row_key) VALUES ({}, {});").format(
        sql.Literal(v.id), sql.SQL("jsonb_build_array({})").format(
            sql.SQL(", ").join(sql.SQL("NEW.{}").format(sql.Identifier(k))
                               for k in v.key_columns)))
    if v.chunking == "split":
        # The old key's chunks must go with it.
        body = sql.SQL("IF {kc} THEN DELETE FROM {chunks} c WHERE {match}; END IF;\n").format(
            kc=key_changed, chunks=v.chunks, match=sql.SQL(" AND ").join(
                sql.SQL("c.{k} = OLD.{k}").format(k=sql.Identifier(k)) for k in v.key_columns)
        ) + body
    fn = _create_function(conn, v.id, "update", body + sql.SQL("\n") + notify)
    conn.execute(sql.SQL("""CREATE TRIGGER {} AFTER UPDATE OF {} ON {} FOR EACH ROW
                            WHEN ({}) EXECUTE FUNCTION {}()""").format(
        _trigger_name(v.id, "update"), sql.SQL(", ").join(map(sql.Identifier, update_cols)),
        v.table, sql.SQL(" OR ").join(changed), fn))

    truncate_body = sql.SQL("DELETE FROM fern.queue WHERE vectorizer_id = {};").format(
        sql.Literal(v.id))
    if v.chunking == "split":
        truncate_body += sql.SQL("\nTRUNCATE {};").format(v.chunks)
        delete_body = sql.SQL("DELETE FROM {} c USING fern_old o WHERE {};").format(
            v.chunks, sql.SQL(" AND ").join(
                sql.SQL("c.{k} = o.{k}").format(k=sql.Identifier(k)) for k in v.key_columns))
        fn = _create_function(conn, v.id, "delete", delete_body)
        conn.execute(sql.SQL("""CREATE TRIGGER {} AFTER DELETE ON {} REFERENCING OLD TABLE AS fern_old
                                FOR EACH STATEMENT EXECUTE FUNCTION {}()""").format(
            _trigger_name(v.id, "delete"), v.table, fn))
    fn = _create_function(conn, v.id, "truncate", truncate_body)
    conn.execute(sql.SQL("CREATE TRIGGER {} AFTER TRUNCATE ON {} FOR EACH STATEMENT "
                         "EXECUTE FUNCTION {}()").format(_trigger_name(v.id, "truncate"),
                                                         v.table, fn))


def _drop_triggers(conn: psycopg.Connection, v: Vectorizer) -> None:
    for kind in ("insert", "update", "delete", "truncate"):
        conn.execute(sql.SQL("DROP TRIGGER IF EXISTS {} ON {}").format(
            _trigger_name(v.id, kind), v.table))
        conn.execute(sql.SQL("DROP FUNCTION IF EXISTS {}()").format(_function_name(v.id, kind)))


def refresh_triggers(conn: psycopg.Connection) -> int:
    """Regenerate every vectorizer's triggers and functions with this version's protocol.

    Run by the installer after a migration that changes what the triggers do. Triggers that
    use a Fern trigger function on a table other than its vectorizer's (attached while the
    functions were executable by PUBLIC) are dropped. Returns how many vectorizers.
    """
    vectorizers = list_vectorizers(conn)
    with conn.transaction():
        foreign = conn.execute(
            """SELECT t.tgname, t.tgrelid::regclass::text FROM pg_trigger t
                 JOIN pg_proc p ON p.oid = t.tgfoid
                WHERE p.pronamespace = 'fern'::regnamespace
                  AND p.proname ~ '^vectorizer_[0-9]+_'
                  AND NOT EXISTS (
                      SELECT 1 FROM fern.vectorizers v
                       WHERE p.proname ~ ('^vectorizer_' || v.id || '_')
                         AND t.tgrelid = to_regclass(format('%I.%I', v.table_schema,
                                                            v.table_name)))""").fetchall()
        for trigger, table in foreign:
            conn.execute(sql.SQL("DROP TRIGGER {} ON {}").format(sql.Identifier(trigger),
                                                                 sql.SQL(table)))
        for v in vectorizers:
            _drop_triggers(conn, v)
            _install_triggers(conn, v)
    return len(vectorizers)


def _create_chunk_table(conn: psycopg.Connection, v_schema: str, chunk_table: str,
                        keys: list[tuple[str, str]], target: str, dimensions: int,
                        distance: str) -> None:
    ident = sql.Identifier(v_schema, chunk_table)
    key_defs = [sql.SQL("{} {} NOT NULL").format(sql.Identifier(k), sql.SQL(t)) for k, t in keys]
    conn.execute(sql.SQL("""CREATE TABLE IF NOT EXISTS {} ({}, chunk_index int NOT NULL,
                            chunk_text text NOT NULL, {} vector({}) NOT NULL,
                            PRIMARY KEY ({}, chunk_index))""").format(
        ident, sql.SQL(", ").join(key_defs), sql.Identifier(target), sql.Literal(dimensions),
        sql.SQL(", ").join(sql.Identifier(k) for k, _ in keys)))
    if not _has_index_on(conn, v_schema, chunk_table, target, "hnsw"):
        conn.execute(sql.SQL("CREATE INDEX {} ON {} USING hnsw ({} {})").format(
            sql.Identifier(_index_name(chunk_table, target, "hnsw")), ident,
            sql.Identifier(target), sql.SQL(_OPCLASS[distance])))


def _ensure_tsvector(conn: psycopg.Connection, v_table: sql.Identifier, schema: str, name: str,
                     tsv_column: str, template: Template, language: str) -> bool:
    """Add the generated tsvector column (unless there) and its GIN index; True when added."""
    columns = _table_columns(conn, schema, name)
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
            sql.Identifier(_index_name(name, tsv_column, "gin")), v_table,
            sql.Identifier(tsv_column)))
    return created


def _model_info(client: FernClient | None, model: str) -> ModelInfo:
    if client is not None:
        return client.model(model)
    from sidecar.client import FernClient

    # A client made here for one call is closed here, not left holding a gRPC channel.
    with FernClient() as own:
        return own.model(model)


def _index_distance(info: ModelInfo) -> str:
    """The model's distance where pgvector has an operator class for it, else cosine."""
    return info.distance if info.distance in _OPCLASS else "cosine"


def backfill(conn: psycopg.Connection, v: Vectorizer) -> int:
    """Enqueue every row of the table for `v`; returns how many."""
    cur = conn.execute(sql.SQL("INSERT INTO fern.queue (vectorizer_id, row_key) "
                               "SELECT {}, {} FROM {} t").format(
        sql.Literal(v.id), v.key_json_sql("t"), v.table))
    conn.execute("SELECT pg_notify(%s, %s)", (NOTIFY_CHANNEL, str(v.id)))
    return cur.rowcount


def create_vectorizer(conn: psycopg.Connection, table: str | tuple[str, str],
                      source: str | Sequence[str], *, client: FernClient | None = None,
                      target_column: str = "embedding", model: str = "",
                      prompt: str | None = "passage", chunking: str = "truncate",
                      chunk_tokens: int | None = None, chunk_overlap: int = 32,
                      chunk_table: str | None = None, hybrid: bool = False,
                      language: str = "english", tsv_column: str | None = None,
                      do_backfill: bool = True) -> Vectorizer:
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
    """
    if chunking not in ("truncate", "split"):
        raise VectorizerError(f"chunking must be 'truncate' or 'split', got {chunking!r}")
    if isinstance(source, str):
        template = parse_template(source)
    else:
        template = template_from_columns(list(source))
    info = _model_info(client, model)
    if chunking == "split":
        chunk_tokens = chunk_tokens or info.max_tokens
        if not 8 <= chunk_tokens <= info.max_tokens:
            raise VectorizerError(f"chunk_tokens must be between 8 and the model's limit "
                                  f"{info.max_tokens}, got {chunk_tokens}")
        if not 0 <= chunk_overlap <= chunk_tokens // 2:
            raise VectorizerError(f"chunk_overlap must be in [0, chunk_tokens/2], got {chunk_overlap}")
    distance = _index_distance(info)
    if not is_installed(conn):
        install(conn)
    with conn.transaction():
        schema, name = resolve_table(conn, table)
        t_ident = sql.Identifier(schema, name)
        # Serializes with other DDL on the table and with concurrent create_vectorizer calls.
        conn.execute(sql.SQL("LOCK TABLE {} IN SHARE ROW EXCLUSIVE MODE").format(t_ident))
        columns = _table_columns(conn, schema, name)
        missing = [c for c in template.columns if c not in columns]
        if missing:
            raise VectorizerError(f"table {schema}.{name} has no column {missing[0]!r} "
                                  f"(named by the source {template.source!r})")
        keys = _primary_key(conn, schema, name)
        if not keys:
            raise VectorizerError(f"table {schema}.{name} needs a primary key: the queue "
                                  f"refers to rows by it")
        if target_column in template.columns or any(target_column == k for k, _ in keys):
            raise VectorizerError(f"target column {target_column!r} is also a source or key column")
        exists = conn.execute("""SELECT 1 FROM fern.vectorizers WHERE table_schema = %s
                                 AND table_name = %s AND target_column = %s""",
                              (schema, name, target_column)).fetchone()
        if exists:
            raise VectorizerError(f"{schema}.{name}.{target_column} already has a vectorizer; "
                                  f"use alter_vectorizer to change its model")
        if chunking == "split":
            chunk_table = chunk_table or _index_name(name, target_column, "chunks")
            _create_chunk_table(conn, schema, chunk_table, keys, target_column,
                                info.dimensions, distance)
        else:
            chunk_table = None
            _ensure_vector_column(conn, t_ident, schema, name, target_column, info.dimensions,
                                  distance)
        if hybrid:
            tsv_column = tsv_column or f"{target_column}_tsv"
            tsv_created = _ensure_tsvector(conn, t_ident, schema, name, tsv_column, template,
                                           language)
        else:
            tsv_column, tsv_created = None, False
        with conn.cursor(row_factory=dict_row) as cur:
            cur.execute(
                """INSERT INTO fern.vectorizers (table_schema, table_name, target_column,
                       key_columns, key_types, source_columns, template, model, dimensions,
                       max_tokens, distance, prompt, chunking, chunk_table, chunk_tokens,
                       chunk_overlap, hybrid, tsv_column, language, tsv_created)
                   VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s,
                           %s, %s, %s, %s) RETURNING *""",
                (schema, name, target_column, [k for k, _ in keys], [t for _, t in keys],
                 template.columns, template.source, info.name, info.dimensions,
                 info.max_tokens, distance, prompt, chunking, chunk_table,
                 chunk_tokens if chunking == "split" else None,
                 chunk_overlap if chunking == "split" else None, hybrid, tsv_column,
                 language if hybrid else None, tsv_created))
            v = _from_row(cur.fetchone())
        _install_triggers(conn, v)
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
                _drop_triggers(conn, other)
                _drop_target(conn, other)
        _drop_triggers(conn, v)
        conn.execute("DELETE FROM fern.vectorizers WHERE id = %s", (v.id,))
        if drop_column:
            _drop_target(conn, v)


def _drop_target(conn: psycopg.Connection, v: Vectorizer) -> None:
    if v.tsv_column is not None:
        if v.tsv_created:
            conn.execute(sql.SQL("ALTER TABLE {} DROP COLUMN IF EXISTS {}").format(
                v.table, sql.Identifier(v.tsv_column)))
        else:
            conn.execute(sql.SQL("DROP INDEX IF EXISTS {}").format(sql.Identifier(
                v.table_schema, _index_name(v.table_name, v.tsv_column, "gin"))))
    if v.chunking == "split":
        conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(v.chunks))
    else:
        conn.execute(sql.SQL("ALTER TABLE {} DROP COLUMN IF EXISTS {}").format(
            v.table, sql.Identifier(v.target_column)))


def alter_vectorizer(conn: psycopg.Connection, table: str | tuple[str, str], *, model: str,
                     client: FernClient | None = None, target_column: str | None = None,
                     prompt: str | None = None) -> Vectorizer:
    """Start a zero-downtime model change; returns the shadow vectorizer.

    The shadow fills a new column (or chunk table) with the new model in the background,
    kept fresh by its own triggers, while searches keep using the current one. When its
    queue is empty a worker swaps it in atomically (see `swap_if_ready`) and drops the old
    column and its index.
    """
    v = get_vectorizer(conn, table, target_column)
    info = _model_info(client, model)
    distance = _index_distance(info)
    with conn.transaction():
        conn.execute(sql.SQL("LOCK TABLE {} IN SHARE ROW EXCLUSIVE MODE").format(v.table))
        pending = conn.execute("SELECT id FROM fern.vectorizers WHERE replaces = %s",
                               (v.id,)).fetchone()
        if pending:
            raise VectorizerError(f"{v.qualified_table}.{v.target_column} is already changing "
                                  f"model (vectorizer {pending[0]})")
        new_column = _index_name(v.target_column, "next")
        keys = list(zip(v.key_columns, v.key_types))
        if v.chunking == "split":
            assert v.chunk_table is not None
            chunk_table = _index_name(v.chunk_table, "next")
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(
                sql.Identifier(v.table_schema, chunk_table)))
            _create_chunk_table(conn, v.table_schema, chunk_table, keys, v.target_column,
                                info.dimensions, distance)
            target = v.target_column
        else:
            chunk_table = None
            conn.execute(sql.SQL("ALTER TABLE {} DROP COLUMN IF EXISTS {}").format(
                v.table, sql.Identifier(new_column)))
            _ensure_vector_column(conn, v.table, v.table_schema, v.table_name, new_column,
                                  info.dimensions, distance)
            target = new_column
        with conn.cursor(row_factory=dict_row) as cur:
            cur.execute(
                """INSERT INTO fern.vectorizers (table_schema, table_name, target_column,
                       key_columns, key_types, source_columns, template, model, dimensions,
                       max_tokens, distance, prompt, chunking, chunk_table, chunk_tokens,
                       chunk_overlap, hybrid, tsv_column, language, replaces)
                   SELECT table_schema, table_name, %s, key_columns, key_types, source_columns,
                          template, %s, %s, %s, %s, %s, chunking, %s,
                          least(chunk_tokens, %s), chunk_overlap, false, NULL, NULL, id
                     FROM fern.vectorizers WHERE id = %s RETURNING *""",
                (target, info.name, info.dimensions, info.max_tokens, distance,
                 prompt if prompt is not None else v.prompt, chunk_table, info.max_tokens,
                 v.id))
            shadow = _from_row(cur.fetchone())
        _install_triggers(conn, shadow)
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
        old = _from_row(conn.cursor(row_factory=dict_row).execute(
            "SELECT * FROM fern.vectorizers WHERE id = %s", (shadow.replaces,)).fetchone())
        conn.execute(sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(old.table))
        if conn.execute("SELECT 1 FROM fern.queue WHERE vectorizer_id = %s LIMIT 1",
                        (shadow.id,)).fetchone():
            return False
        _drop_triggers(conn, shadow)
        if old.chunking == "split":
            assert old.chunk_table is not None and shadow.chunk_table is not None
            conn.execute(sql.SQL("DROP TABLE {}").format(old.chunks))
            conn.execute(sql.SQL("ALTER TABLE {} RENAME TO {}").format(
                shadow.chunks, sql.Identifier(old.chunk_table)))
            conn.execute(sql.SQL("ALTER INDEX IF EXISTS {} RENAME TO {}").format(
                sql.Identifier(old.table_schema, _index_name(shadow.chunk_table,
                                                             shadow.target_column, "hnsw")),
                sql.Identifier(_index_name(old.chunk_table, old.target_column, "hnsw"))))
        else:
            conn.execute(sql.SQL("ALTER TABLE {} DROP COLUMN {}").format(
                old.table, sql.Identifier(old.target_column)))
            conn.execute(sql.SQL("ALTER TABLE {} RENAME COLUMN {} TO {}").format(
                old.table, sql.Identifier(shadow.target_column),
                sql.Identifier(old.target_column)))
            conn.execute(sql.SQL("ALTER INDEX IF EXISTS {} RENAME TO {}").format(
                sql.Identifier(old.table_schema, _index_name(old.table_name,
                                                             shadow.target_column, "hnsw")),
                sql.Identifier(_index_name(old.table_name, old.target_column, "hnsw"))))
        # Everything the old vectorizer still had queued is covered by the shadow's vectors.
        conn.execute("DELETE FROM fern.queue WHERE vectorizer_id = %s", (old.id,))
        conn.execute("UPDATE fern.failed SET vectorizer_id = %s WHERE vectorizer_id = %s",
                     (old.id, shadow.id))
        conn.execute("""UPDATE fern.vectorizers o SET model = s.model, dimensions = s.dimensions,
                            max_tokens = s.max_tokens, distance = s.distance, prompt = s.prompt,
                            chunk_tokens = s.chunk_tokens, generation = o.generation + 1
                          FROM fern.vectorizers s WHERE o.id = %s AND s.id = %s""",
                     (old.id, shadow.id))
        conn.execute("DELETE FROM fern.vectorizers WHERE id = %s", (shadow.id,))
    return True
