"""The trigger functions that enqueue a vectorizer's changed rows (and NOTIFY the workers), and the backfill.

INSERT enqueues; UPDATE only when a source or key column really changed; DELETE/TRUNCATE
where chunk rows must go. A vectorizer with a sparse column also gets the triggers that keep
its document frequencies exact (sparse.py). The functions are SECURITY DEFINER, executable by no one but their
owner, and refuse to run on any table but their vectorizer's.
"""

from __future__ import annotations

import psycopg
from psycopg import sql

from adapters.postgres.catalog import Vectorizer, list_vectorizers
from adapters.postgres.sparse import DF_KINDS, DF_LOCK, apply_delta, row_key, sparse_table_name

NOTIFY_CHANNEL = "fern_queue"


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


# The guard of the triggers on the table holding a vectorizer's sparse column (the chunk
# table in split mode; sparse.py).
_SPARSE_GUARD = sql.SQL("""IF NOT EXISTS (SELECT 1 FROM fern.vectorizers
                    WHERE id = {id} AND table_schema = TG_TABLE_SCHEMA
                      AND CASE WHEN chunking = 'split' THEN chunk_table ELSE table_name END
                          = TG_TABLE_NAME) THEN
    RAISE EXCEPTION 'fern: % fired on %.%, which does not hold the sparse vectors of vectorizer {id}',
        TG_NAME, quote_ident(TG_TABLE_SCHEMA), quote_ident(TG_TABLE_NAME)
        USING ERRCODE = 'insufficient_privilege';
END IF;""")


def _create_function(conn: psycopg.Connection, v_id: int, kind: str,
                     body: sql.Composable, sparse_table: str | None = None) -> sql.Identifier:
    """A SECURITY DEFINER trigger function, so any role that may write the table may enqueue.

    PostgreSQL checks EXECUTE when a trigger is created, not when it fires: revoking it from
    PUBLIC stops other roles attaching the function to their tables, while every writer of
    the vectorizer's table still fires it.
    """
    name = _function_name(v_id, kind)
    guard = _GUARD if sparse_table is None else _SPARSE_GUARD
    source = sql.SQL("BEGIN\n{}\n{}\nRETURN NULL;\nEND").format(
        guard.format(id=sql.Literal(v_id)), body).as_string(conn)
    conn.execute(sql.SQL("""CREATE OR REPLACE FUNCTION {}() RETURNS trigger LANGUAGE plpgsql
                            SECURITY DEFINER SET search_path = pg_catalog, pg_temp
                            AS {}""").format(name, sql.Literal(source)))
    conn.execute(sql.SQL("REVOKE ALL ON FUNCTION {}() FROM PUBLIC").format(name))
    return name


def install_triggers(conn: psycopg.Connection, v: Vectorizer) -> None:
    """Create `v`'s insert, update, (delete,) truncate trigger functions and attach them to its table."""
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
    install_df_triggers(conn, v)


def install_df_triggers(conn: psycopg.Connection, v: Vectorizer) -> None:
    """Attach the triggers that keep v's document frequencies exact to the sparse column's table."""
    if v.sparse_column is None or v.sparse_learned:
        return  # learned weights are queried as they are: no IDF, nothing to count
    col = sql.Identifier(v.sparse_column)
    table = v.sparse_table
    # These fire on the sparse column's table (the chunk table in split mode): the guard
    # checks that one.
    guard_table = sparse_table_name(v)

    def rows(alias: str, sign: int) -> sql.Composed:
        return sql.SQL("SELECT {s} AS sign, {a}.{c}::text AS sv FROM {t} {a} WHERE {a}.{c} IS NOT NULL").format(
            s=sql.Literal(sign), a=sql.Identifier(alias), c=col,
            t=sql.Identifier("fern_new" if sign > 0 else "fern_old"))

    fn = _create_function(conn, v.id, "df_insert", apply_delta(v.id, rows("n", 1)), guard_table)
    conn.execute(sql.SQL("""CREATE TRIGGER {} AFTER INSERT ON {} REFERENCING NEW TABLE AS fern_new
                            FOR EACH STATEMENT EXECUTE FUNCTION {}()""").format(
        _trigger_name(v.id, "df_insert"), table, fn))
    fn = _create_function(conn, v.id, "df_delete", apply_delta(v.id, rows("o", -1)), guard_table)
    conn.execute(sql.SQL("""CREATE TRIGGER {} AFTER DELETE ON {} REFERENCING OLD TABLE AS fern_old
                            FOR EACH STATEMENT EXECUTE FUNCTION {}()""").format(
        _trigger_name(v.id, "df_delete"), table, fn))
    # UPDATE: one statement trigger over both transition tables. The old and new rows are
    # paired by key; a pair whose sparse vector did not change adds nothing, so an UPDATE of
    # other columns writes no counts. (A key change pairs rows differently, and the sum of
    # new minus old vectors stays the same.)
    on = sql.SQL(" AND ").join(sql.SQL("o.{k} = n.{k}").format(k=sql.Identifier(k))
                               for k in row_key(v))
    pairs = sql.SQL("""SELECT o.{c} AS o_sv, n.{c} AS n_sv FROM fern_old o FULL JOIN fern_new n ON {on}
                        WHERE o.{c}::text IS DISTINCT FROM n.{c}::text""").format(c=col, on=on)
    changed = sql.SQL("""SELECT 1 AS sign, p.n_sv::text AS sv FROM ({pairs}) p WHERE p.n_sv IS NOT NULL
                         UNION ALL
                         SELECT -1, p.o_sv::text FROM ({pairs}) p WHERE p.o_sv IS NOT NULL""").format(pairs=pairs)
    fn = _create_function(conn, v.id, "df_update", apply_delta(v.id, changed), guard_table)
    conn.execute(sql.SQL("""CREATE TRIGGER {} AFTER UPDATE ON {}
                            REFERENCING OLD TABLE AS fern_old NEW TABLE AS fern_new
                            FOR EACH STATEMENT EXECUTE FUNCTION {}()""").format(
        _trigger_name(v.id, "df_update"), table, fn))
    reset = sql.SQL("""PERFORM pg_advisory_xact_lock({lock}, {vid});
DELETE FROM fern.sparse_df WHERE vectorizer_id = {vid};
DELETE FROM fern.sparse_docs WHERE vectorizer_id = {vid};""").format(
        lock=sql.Literal(DF_LOCK), vid=sql.Literal(v.id))
    fn = _create_function(conn, v.id, "df_truncate", reset, guard_table)
    conn.execute(sql.SQL("CREATE TRIGGER {} AFTER TRUNCATE ON {} FOR EACH STATEMENT "
                         "EXECUTE FUNCTION {}()").format(_trigger_name(v.id, "df_truncate"), table, fn))


def drop_df_triggers(conn: psycopg.Connection, v: Vectorizer) -> None:
    """Drop v's df triggers and their functions (those that exist; the table may be gone)."""
    exists = conn.execute("SELECT to_regclass(%s) IS NOT NULL",
                          (v.sparse_table.as_string(conn),)).fetchone()[0]
    for kind in DF_KINDS:
        if exists:
            conn.execute(sql.SQL("DROP TRIGGER IF EXISTS {} ON {}").format(
                _trigger_name(v.id, kind), v.sparse_table))
        conn.execute(sql.SQL("DROP FUNCTION IF EXISTS {}()").format(_function_name(v.id, kind)))


def drop_triggers(conn: psycopg.Connection, v: Vectorizer) -> None:
    """Drop every trigger and trigger function of `v` (those that exist)."""
    drop_df_triggers(conn, v)
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
                         AND t.tgrelid IN (
                             to_regclass(format('%I.%I', v.table_schema, v.table_name)),
                             to_regclass(CASE WHEN v.chunk_table IS NOT NULL THEN
                                 format('%I.%I', v.table_schema, v.chunk_table) END)))"""
        ).fetchall()
        for trigger, table in foreign:
            conn.execute(sql.SQL("DROP TRIGGER {} ON {}").format(sql.Identifier(trigger),
                                                                 sql.SQL(table)))
        for v in vectorizers:
            drop_triggers(conn, v)
            install_triggers(conn, v)
    return len(vectorizers)


def backfill(conn: psycopg.Connection, v: Vectorizer) -> int:
    """Enqueue every row of the table for `v`; returns how many."""
    cur = conn.execute(sql.SQL("INSERT INTO fern.queue (vectorizer_id, row_key) "
                               "SELECT {}, {} FROM {} t").format(
        sql.Literal(v.id), v.key_json_sql("t"), v.table))
    conn.execute("SELECT pg_notify(%s, %s)", (NOTIFY_CHANNEL, str(v.id)))
    return cur.rowcount
