"""Query time: embed the query on the ONLINE lane and rank rows in one SQL statement.

Hybrid search fuses pgvector's nearest neighbours (HNSW) with a lexical list by reciprocal
rank fusion: score = sum over both lists of 1 / (rrf_k + rank). The lexical list is either
the sparse vectors (`lexical="sparse"`, the default where the vectorizer keeps them): rows
ranked by inner product (`<#>`) with the query's sparse vector, BM25 with IDF from the
vectorizer's document frequencies (see sparse.py) or a model's learned weights; or
PostgreSQL full text (`lexical="fulltext"`): GIN over the vectorizer's generated tsvector,
ranked by ts_rank_cd. The sparse list is an exact scan of the rows the `where` keeps, with
no index: pgvector's HNSW on sparsevec takes at most 1,000 non-zero elements a vector and
is approximate, and a lexical list should be exact.
With `rerank=N`, the best N rows of that ranking are rescored by a reranker (a cross-encoder)
on the sidecar, each row's template-rendered text against the query, in one Rerank call,
and the best k of them come back in the reranker's order.
The query keeps psycopg's `%s` placeholders (the caller's `where` uses them), so every
name in it has its `%` doubled first (`_placeholder_safe`): a table called `growth_%` is
never read as a placeholder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import psycopg
from psycopg import sql
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool

from adapters.postgres.sparse import query_vector_sql
from adapters.postgres.vectorizer import Vectorizer, VectorizerError, get_vectorizer

if TYPE_CHECKING:
    from sidecar.client import FernClient


# websearch_to_tsquery ANDs the words; for the recall side of a hybrid search any word
# should do (ts_rank_cd still ranks rows matching more words higher). Phrases ("a b" ->
# a <-> b) keep their meaning; a query with a negation ("-word") keeps its ANDs.
_TSQUERY_ALL = sql.SQL("websearch_to_tsquery(%s::regconfig, %s)")
_TSQUERY_ANY = sql.SQL(
    "(SELECT CASE WHEN strpos(w::text, '!') > 0 THEN w ELSE replace(w::text, ' & ', ' | ')::tsquery END"
    " FROM websearch_to_tsquery(%s::regconfig, %s) AS w)")


def _placeholder_safe(query: sql.Composable, conn: psycopg.Connection) -> sql.Composable:
    """`query` with `%` doubled inside every identifier and literal, so psycopg reads only
    the placeholders of its SQL parts as placeholders."""
    if isinstance(query, sql.Composed):
        return sql.Composed([_placeholder_safe(part, conn) for part in query])
    if isinstance(query, (sql.Identifier, sql.Literal)):
        return sql.SQL(query.as_string(conn).replace("%", "%%"))
    return query


@dataclass(frozen=True)
class SearchHit:
    """One result row (its columns, vector and tsvector left out) and how it ranked."""

    row: dict[str, Any]
    score: float  # RRF score when hybrid; else similarity (1 - cosine distance, or inner product)
    vector_rank: int | None
    text_rank: int | None
    distance: float | None
    rerank_score: float | None = None  # the reranker's score of the row's text, with `rerank=`


def _embed_query(client: FernClient | None, v: Vectorizer, text: str, prompt: str | None,
                 sparse: bool = False) -> tuple[np.ndarray, Any]:
    """The query's dense vector, and with `sparse` its sparse one (both from one Embed call)."""
    if client is None:
        from sidecar.client import FernClient

        # A client made here for one query is closed here, not left holding a gRPC channel.
        with FernClient() as own:
            return _embed_query(own, v, text, prompt, sparse)
    emb = client.embed([text], model=v.model, lane="online", prompt=prompt, sparse=sparse)
    return (np.asarray(emb.vectors[0], dtype=np.float32),
            emb.sparse[0] if sparse and emb.sparse else None)


def _output_columns(conn: psycopg.Connection, v: Vectorizer) -> list[str]:
    rows = conn.execute(
        """SELECT a.attname FROM pg_attribute a
            WHERE a.attrelid = (SELECT c.oid FROM pg_class c JOIN pg_namespace n
                                    ON n.oid = c.relnamespace
                                 WHERE n.nspname = %s AND c.relname = %s)
              AND a.attnum > 0 AND NOT a.attisdropped
              AND format_type(a.atttypid, NULL) NOT IN ('vector', 'tsvector', 'sparsevec')
            ORDER BY a.attnum""", (v.table_schema, v.table_name)).fetchall()
    return [r[0] for r in rows]


def search(conn: psycopg.Connection | ConnectionPool, table: str | tuple[str, str], text: str,
           k: int = 10, *, where: str | sql.Composable | None = None, params: Sequence[Any] = (),
           hybrid: bool | None = None, client: FernClient | None = None,
           target_column: str | None = None,
           prompt: str | None = "query", candidates: int | None = None,
           rrf_k: int = 1, text_match: str = "any", rerank: int | None = None,
           rerank_model: str = "", lexical: str | None = None) -> list[SearchHit]:
    """The `k` best rows of `table` for `text`.

    `where` is an SQL condition on the table (alias `t`), with `%s` placeholders filled
    from `params` (e.g. `where="t.lang = %s", params=["en"]`); it is the caller's SQL, as
    with psycopg. The query is embedded with `prompt` ("query": the model's query prompt
    where it has one). `hybrid` defaults to whether the vectorizer keeps a lexical side (a
    sparse column or a tsvector); when on, the best `candidates` (default 4k) of the dense
    list and of the lexical one are fused by RRF. `lexical` picks that list: "sparse" (the
    default where the vectorizer keeps sparse vectors: BM25, or learned weights) or
    "fulltext" (the tsvector). `rrf_k` 1 is Qdrant's fusion, 1 / (1 + rank): it lets each
    list's first places count, and ranks better than the textbook 60 on the retrieval-quality
    set, with either lexical list. One SQL statement.
    `conn` may be a psycopg_pool.ConnectionPool, from which one connection is borrowed.
    `text_match` "any" lets a row match the full-text side with any of the query's words
    (ranked by how many and how close), "all" needs every word (websearch syntax either way).
    `rerank` N (at least k): the best N rows are reranked on the sidecar by `rerank_model`
    ("": its first reranker) and the best k of them returned, best first, each with its
    `rerank_score` (sigmoid of the cross-encoder's logit, 0..1); a row whose text renders
    empty has none and comes last.
    """
    if text_match not in ("any", "all"):
        raise ValueError(f"text_match must be 'any' or 'all', got {text_match!r}")
    if lexical not in (None, "sparse", "fulltext"):
        raise ValueError(f"lexical must be 'sparse' or 'fulltext' (or None: sparse where the "
                         f"vectorizer keeps sparse vectors), got {lexical!r}")
    if isinstance(conn, ConnectionPool):
        # A web app's pool: borrow a connection for the one statement.
        with conn.connection() as borrowed:
            return search(borrowed, table, text, k, where=where, params=params, hybrid=hybrid,
                          client=client, target_column=target_column, prompt=prompt,
                          candidates=candidates, rrf_k=rrf_k, text_match=text_match,
                          rerank=rerank, rerank_model=rerank_model, lexical=lexical)
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    if rerank is not None:
        if rerank < k:
            raise ValueError(f"rerank must be at least k ({k}): it is how many of the best rows are reranked, "
                             f"got {rerank}")
        if client is None:
            from sidecar.client import FernClient

            # One client for the query's embedding and the rerank, closed here.
            with FernClient() as own:
                return search(conn, table, text, k, where=where, params=params, hybrid=hybrid, client=own,
                              target_column=target_column, prompt=prompt, candidates=candidates,
                              rrf_k=rrf_k, text_match=text_match, rerank=rerank, rerank_model=rerank_model,
                              lexical=lexical)
        limit = k
        k = rerank  # the SQL ranks the rows to rerank; the best `limit` of them are returned
    v = get_vectorizer(conn, table, target_column)
    if lexical == "sparse" and not v.sparse_column:
        raise VectorizerError(f"lexical='sparse' on {v.qualified_table}: its vectorizer keeps no "
                              f"sparse vectors (create it with sparse=True)")
    if lexical == "fulltext" and not v.tsv_column:
        raise VectorizerError(f"lexical='fulltext' on {v.qualified_table}: its vectorizer keeps no "
                              f"tsvector (create it with hybrid=True)")
    if lexical is not None and hybrid is False:
        raise ValueError(f"lexical={lexical!r} names the lexical list of a hybrid search, "
                         f"but hybrid=False")
    if lexical is None:
        lexical = "sparse" if v.sparse_column else "fulltext" if v.tsv_column else None
    if hybrid is None:
        hybrid = lexical is not None
    if hybrid and lexical is None:
        raise VectorizerError(f"hybrid search on {v.qualified_table} needs a vectorizer with a "
                              f"lexical side: sparse=True (sparse vectors) or hybrid=True (a tsvector)")
    candidates = candidates or max(4 * k, 40)
    from pgvector.psycopg import register_vector

    register_vector(conn)
    use_sparse = bool(hybrid and lexical == "sparse")
    vector, query_sparse = _embed_query(client, v, text, prompt, use_sparse)
    cond = sql.SQL("TRUE") if where is None else (
        where if isinstance(where, sql.Composable) else sql.SQL(where))
    out_cols = _output_columns(conn, v)
    dist = v.distance_operator()
    args: list[Any] = [vector]

    if v.chunking == "split":
        keys = sql.SQL(", ").join(sql.Identifier("c", k_) for k_ in v.key_columns)
        match = sql.SQL(" AND ").join(
            sql.SQL("t.{k} = s.{k}").format(k=sql.Identifier(k_)) for k_ in v.key_columns)
        vec_cte = sql.SQL("""
            SELECT t.ctid AS rid, s.d FROM (
                SELECT {keys}, min(c.d) AS d FROM (
                    SELECT {keys}, c.{col} {op} q.v AS d FROM {chunks} c, q
                     ORDER BY c.{col} {op} q.v LIMIT %s) c
                 GROUP BY {keys}) s
              JOIN {table} t ON {match}
             WHERE ({cond}) ORDER BY s.d LIMIT %s""").format(
            keys=keys, col=sql.Identifier(v.target_column), op=dist, chunks=v.chunks,
            table=v.table, match=match, cond=cond)
        vec_args = [candidates * 4, *params, candidates]
    else:
        vec_cte = sql.SQL("""
            SELECT t.ctid AS rid, t.{col} {op} q.v AS d FROM {table} t, q
             WHERE t.{col} IS NOT NULL AND ({cond})
             ORDER BY t.{col} {op} q.v LIMIT %s""").format(
            col=sql.Identifier(v.target_column), op=dist, table=v.table, cond=cond)
        vec_args = [*params, candidates]
    select_cols = sql.SQL(", ").join(sql.Identifier("t", c) for c in out_cols)
    if rerank is not None:
        select_cols = select_cols + sql.SQL(", {} AS {}").format(v.text_sql("t"), sql.Identifier(_RERANK_TEXT))

    if not hybrid:
        query = sql.SQL("""
            WITH q AS (SELECT %s::vector AS v),
                 vec AS ({vec_cte})
            SELECT vec.d, row_number() OVER (ORDER BY vec.d) AS vr, {cols}
              FROM vec JOIN {table} t ON t.ctid = vec.rid
             ORDER BY vec.d LIMIT %s""").format(vec_cte=vec_cte, cols=select_cols,
                                                 table=v.table)
        args += [*vec_args, k]
        with conn.cursor(row_factory=dict_row) as cur:
            rows = cur.execute(_placeholder_safe(query, conn), args).fetchall()
        hits = []
        for r in rows:
            d = float(r.pop("d"))
            rank = int(r.pop("vr"))
            score = 1.0 - d if v.distance == "cosine" else -d
            hits.append(SearchHit(r, score, rank, None, d))
        return hits if rerank is None else _reranked(client, text, hits, limit, rerank_model)

    if use_sparse:
        assert v.sparse_column is not None
        q_cte = sql.SQL("SELECT %s::vector AS v, qs.sv, qs.nnz FROM ({}) qs").format(
            query_vector_sql(v))
        indices = [] if query_sparse is None else [int(i) for i in query_sparse.indices]
        weights = [] if query_sparse is None else [float(w) for w in query_sparse.values]
        q_args: list[Any] = [vector, indices, weights] + ([] if v.sparse_learned else [v.id, v.id])
        lex_cte, lex_args = _sparse_list(v, cond, params, candidates)
    else:
        q_cte = sql.SQL("SELECT %s::vector AS v, {} AS tsq").format(
            _TSQUERY_ALL if text_match == "all" else _TSQUERY_ANY)
        q_args = [vector, v.language or "english", text]
        lex_cte = sql.SQL("""
            SELECT t.ctid AS rid, ts_rank_cd(t.{tsv}, q.tsq) AS rank
              FROM {table} t, q
             WHERE t.{tsv} @@ q.tsq AND ({cond})
             ORDER BY rank DESC LIMIT %s""").format(tsv=sql.Identifier(v.tsv_column),
                                                    table=v.table, cond=cond)
        lex_args = [*params, candidates]
    query = sql.SQL("""
        WITH q AS ({q_cte}),
             vec AS (SELECT rid, d, row_number() OVER (ORDER BY d) AS r FROM ({vec_cte}) x),
             fts AS (SELECT rid, row_number() OVER (ORDER BY rank DESC) AS r FROM ({lex_cte}) y),
             fused AS (
                SELECT coalesce(vec.rid, fts.rid) AS rid, vec.d, vec.r AS vr, fts.r AS fr,
                       coalesce(1.0 / (%s + vec.r), 0) + coalesce(1.0 / (%s + fts.r), 0) AS score
                  FROM vec FULL JOIN fts ON vec.rid = fts.rid)
        SELECT f.score, f.d, f.vr, f.fr, {cols}
          FROM fused f JOIN {table} t ON t.ctid = f.rid
         ORDER BY f.score DESC, f.vr NULLS LAST LIMIT %s""").format(
        q_cte=q_cte, vec_cte=vec_cte, lex_cte=lex_cte, table=v.table, cols=select_cols)
    args = [*q_args, *vec_args, *lex_args, rrf_k, rrf_k, k]
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(_placeholder_safe(query, conn), args).fetchall()
    hits = []
    for r in rows:
        score = float(r.pop("score"))
        d = r.pop("d")
        vr, fr = r.pop("vr"), r.pop("fr")
        hits.append(SearchHit(r, score, None if vr is None else int(vr),
                              None if fr is None else int(fr), None if d is None else float(d)))
    return hits if rerank is None else _reranked(client, text, hits, limit, rerank_model)


def _sparse_list(v: Vectorizer, cond: sql.Composable, params: Sequence[Any],
                 candidates: int) -> tuple[sql.Composed, list[Any]]:
    """The sparse side of a hybrid search: rows sharing a term with the query (`q.sv`),
    by inner product, best `candidates` first (`rank`: higher is better); in split mode a
    row ranks by its best chunk. An exact scan of the rows `cond` keeps."""
    assert v.sparse_column is not None
    col = sql.Identifier(v.sparse_column)
    if v.chunking == "split":
        keys = sql.SQL(", ").join(sql.Identifier("c", k_) for k_ in v.key_columns)
        match = sql.SQL(" AND ").join(
            sql.SQL("t.{k} = s.{k}").format(k=sql.Identifier(k_)) for k_ in v.key_columns)
        return sql.SQL("""
            SELECT t.ctid AS rid, s.rank FROM (
                SELECT {keys}, max(-(c.{col} <#> q.sv)) AS rank FROM {chunks} c, q
                 WHERE q.nnz > 0 AND c.{col} IS NOT NULL AND c.{col} <#> q.sv < 0
                 GROUP BY {keys}) s
              JOIN {table} t ON {match}
             WHERE ({cond}) ORDER BY s.rank DESC LIMIT %s""").format(
            keys=keys, col=col, chunks=v.chunks, table=v.table, match=match,
            cond=cond), [*params, candidates]
    return sql.SQL("""
        SELECT t.ctid AS rid, -(t.{col} <#> q.sv) AS rank FROM {table} t, q
         WHERE q.nnz > 0 AND t.{col} IS NOT NULL AND t.{col} <#> q.sv < 0 AND ({cond})
         ORDER BY t.{col} <#> q.sv LIMIT %s""").format(col=col, table=v.table,
                                                        cond=cond), [*params, candidates]


# The column the rows' rendered text comes back in for reranking (taken out of each row).
_RERANK_TEXT = "__fern_rerank_text"


def _reranked(client: FernClient, text: str, hits: list[SearchHit], k: int,
              model: str) -> list[SearchHit]:
    """The best `k` of `hits` by the reranker's score of each row's text against `text`: one Rerank call."""
    texts = [h.row.pop(_RERANK_TEXT) or "" for h in hits]
    scored = [i for i, t in enumerate(texts) if t.strip()]
    out: list[SearchHit] = []
    if scored:
        ranked = client.rerank(text, [texts[i] for i in scored], model=model, top_n=k, lane="online")
        for result in ranked.results:
            hit = hits[scored[result.index]]
            out.append(SearchHit(hit.row, hit.score, hit.vector_rank, hit.text_rank, hit.distance, result.score))
    # Rows with no text to read come after every scored one, in the first ranking's order.
    unscored = [hits[i] for i in range(len(hits)) if not texts[i].strip()]
    return (out + unscored)[:k]
