"""Sparse vectors in PostgreSQL: the sparsevec column, its document frequencies, the query vector.

A vectorizer with a sparse column stores, beside each dense vector, the sidecar's sparse
vector of the same text (one Embed call gives both): BM25 lexical terms (sidecar/lexical.py)
or, for a model with a learned sparse head (BGE-M3), its learned weights. Indices are the
sidecar's (0-based, below 10^9), so a `sparsevec(1000000000)` holds every one; in its text
form pgvector numbers them from 1.

BM25 needs each query term's inverse document frequency. `fern.sparse_df` counts, per
vectorizer and term, the stored sparse vectors holding the term, and `fern.sparse_docs`
how many are stored. Triggers on the table that holds the sparse column (the chunk table in
split mode; triggers.py installs them) keep both exact in the same transaction as every write
there: statement triggers over the transition tables on INSERT, UPDATE and DELETE (the old
vectors' terms out, the new ones' in; a row whose sparse vector an UPDATE left alone counts
nothing), and TRUNCATE.
Concurrent writers increment with INSERT ... ON CONFLICT DO UPDATE, after a
per-vectorizer transaction-level advisory lock, so two writers of overlapping terms queue
behind each other instead of deadlocking. At query time the sidecar's query vector (BM25's
query form: each distinct term once, weight 1) is weighted by Qdrant's IDF,
ln(1 + (N - df + 0.5) / (df + 0.5)), inside the search statement itself; the inner product
with a document's saturated term frequencies is then the document's BM25 score. Learned
sparse vectors need no IDF: the query is the model's weights as they are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import psycopg
from psycopg import sql

from adapters.postgres.errors import VectorizerError

if TYPE_CHECKING:
    from adapters.postgres.catalog import Vectorizer
    from sidecar.client import SparseVector as FernSparse

SPARSEVEC_DIM = 1_000_000_000
SPARSEVEC_TYPE = f"sparsevec({SPARSEVEC_DIM})"
# pg_advisory_xact_lock(DF_LOCK, vectorizer id) serializes the df updates of one vectorizer.
DF_LOCK = 0x6665726E  # "fern"
DF_KINDS = ("df_insert", "df_update", "df_delete", "df_truncate")


def to_pgvector(sv: FernSparse):
    """The sidecar's sparse vector as a pgvector SparseVector of SPARSEVEC_DIM dimensions."""
    from pgvector import SparseVector

    return SparseVector(dict(zip(sv.indices.tolist(), sv.values.tolist())), SPARSEVEC_DIM)


def ensure_sparse_column(conn: psycopg.Connection, table: sql.Identifier, schema: str, name: str,
                         column: str, columns: dict[str, str]) -> None:
    """Add the sparsevec column to schema.name (or check the one there is a sparsevec(10^9))."""
    if column in columns:
        if columns[column] != SPARSEVEC_TYPE:
            raise VectorizerError(f"column {column!r} of {schema}.{name} is {columns[column]}, "
                                  f"but sparse vectors need {SPARSEVEC_TYPE}")
        return
    conn.execute(sql.SQL("ALTER TABLE {} ADD COLUMN {} {}").format(
        table, sql.Identifier(column), sql.SQL(SPARSEVEC_TYPE)))


def _terms_of(rows: sql.Composable) -> sql.Composed:
    """(term, signed count) of the sparse vectors in `rows` (columns sign, sv as text)."""
    return sql.SQL("""SELECT split_part(e, ':', 1)::bigint - 1 AS term, sum(s.sign)::bigint AS n
                        FROM ({rows}) s,
                             string_to_table(btrim(split_part(s.sv, '/', 1), '{{}}'), ',') AS e
                       GROUP BY 1""").format(rows=rows)


def apply_delta(v_id: int, rows: sql.Composable) -> sql.Composed:
    """Statements that add the signed vectors of `rows` to v_id's df and document count."""
    vid = sql.Literal(v_id)
    return sql.SQL("""PERFORM pg_advisory_xact_lock({lock}, {vid});
INSERT INTO fern.sparse_df AS d (vectorizer_id, term, df)
SELECT {vid}, x.term, x.n FROM ({terms}) x WHERE x.n <> 0 ORDER BY x.term
    ON CONFLICT (vectorizer_id, term) DO UPDATE SET df = d.df + EXCLUDED.df;
INSERT INTO fern.sparse_docs AS c (vectorizer_id, docs)
SELECT {vid}, x.n FROM (SELECT coalesce(sum(s.sign), 0)::bigint AS n FROM ({rows}) s) x WHERE x.n <> 0
    ON CONFLICT (vectorizer_id) DO UPDATE SET docs = c.docs + EXCLUDED.docs;""").format(
        lock=sql.Literal(DF_LOCK), vid=vid, terms=_terms_of(rows), rows=rows)


def row_key(v: Vectorizer) -> tuple[str, ...]:
    """The primary key of the sparse column's table: the row key, and chunk_index in split mode."""
    return v.key_columns + (("chunk_index",) if v.chunking == "split" else ())


def sparse_table_name(v: Vectorizer) -> str:
    return v.chunk_table if v.chunking == "split" else v.table_name  # type: ignore[return-value]


def seed_df(conn: psycopg.Connection, v: Vectorizer) -> None:
    """Count v's document frequencies afresh from the sparse vectors stored now (BM25 only)."""
    assert v.sparse_column is not None
    if v.sparse_learned:
        return
    col = sql.Identifier(v.sparse_column)
    rows = sql.SQL("SELECT 1 AS sign, t.{c}::text AS sv FROM {t} t WHERE t.{c} IS NOT NULL").format(
        c=col, t=v.sparse_table)
    conn.execute("DELETE FROM fern.sparse_df WHERE vectorizer_id = %s", (v.id,))
    conn.execute("DELETE FROM fern.sparse_docs WHERE vectorizer_id = %s", (v.id,))
    conn.execute(sql.SQL("""INSERT INTO fern.sparse_df (vectorizer_id, term, df)
                            SELECT {vid}, x.term, x.n FROM ({terms}) x WHERE x.n <> 0""").format(
        vid=sql.Literal(v.id), terms=_terms_of(rows)))
    conn.execute(sql.SQL("""INSERT INTO fern.sparse_docs (vectorizer_id, docs)
                            SELECT {vid}, count(*) FROM ({rows}) s HAVING count(*) > 0""").format(
        vid=sql.Literal(v.id), rows=rows))


def query_vector_sql(v: Vectorizer) -> sql.Composed:
    """A one-row SELECT of the query's sparsevec `sv` and its term count `nnz`.

    Its placeholders: the query's indices (bigint[]) and weights (float8[]), and for BM25
    lexical vectors the vectorizer id twice; each lexical term is weighted by its IDF, and
    a term no stored vector holds is left out.
    """
    body = sql.SQL("""('{{' || coalesce(string_agg((u.i + 1)::text || ':' || ({w})::real::text, ','
                                                 ORDER BY u.i), '') || '}}/{dim}')::sparsevec""")
    if v.sparse_learned:
        return sql.SQL("SELECT {sv} AS sv, count(*) AS nnz FROM unnest(%s::bigint[], %s::float8[]) AS u(i, w) "
                       "WHERE u.w <> 0").format(sv=body.format(w=sql.SQL("u.w"), dim=sql.SQL(str(SPARSEVEC_DIM))))
    idf = sql.SQL("u.w * ln(1 + (s.docs - d.df + 0.5) / (d.df + 0.5))")
    return sql.SQL("""SELECT {sv} AS sv, count(*) AS nnz
                        FROM unnest(%s::bigint[], %s::float8[]) AS u(i, w)
                        JOIN fern.sparse_df d ON d.vectorizer_id = %s AND d.term = u.i AND d.df > 0
                        JOIN fern.sparse_docs s ON s.vectorizer_id = %s""").format(
        sv=body.format(w=idf, dim=sql.SQL(str(SPARSEVEC_DIM))))
