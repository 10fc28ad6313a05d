"""Sparse vectors in PostgreSQL: the worker fills the sparsevec column from the same Embed call,
the document frequencies stay exact under every write, and hybrid search fuses dense with BM25."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from pg_helpers import run_worker

from adapters.postgres.search import search
from adapters.postgres.vectorizer import VectorizerError, create_vectorizer, drop_vectorizer

DOCS = {
    1: "Zorblax is the codename of the new line of ceramic garden gnomes.",
    2: "My laptop will not turn on and the display stays dark after I press power.",
    3: "The cat sat quietly on the warm windowsill all afternoon.",
    4: "Quarterly revenue grew by ten percent thanks to strong exports.",
    5: "Tomatoes need plenty of sunlight and regular watering to ripen in the garden.",
    6: "Whisk the eggs with sugar until pale, then fold in the flour.",
    7: "The night train from Vienna to Venice crosses the Alps.",
    8: "The orchestra rehearsed the symphony's final movement twice in the garden hall.",
}


def stored(conn, table: str = "docs", column: str = "embedding_sparse") -> dict:
    """{key: {term: value}} of the sparse vectors stored now (0-based terms, as the sidecar's)."""
    rows = conn.execute(f"SELECT id, {column} FROM {table} WHERE {column} IS NOT NULL").fetchall()
    out: dict = {}
    for key, sv in rows:
        out.setdefault(key, []).append({int(i): float(w) for i, w in zip(sv.indices(), sv.values())})
    return out


def df_table(conn, v_id: int) -> tuple[dict[int, int], int]:
    """fern.sparse_df (terms with df > 0) and fern.sparse_docs of a vectorizer."""
    df = {t: n for t, n in conn.execute(
        "SELECT term, df FROM fern.sparse_df WHERE vectorizer_id = %s AND df <> 0", (v_id,))}
    row = conn.execute("SELECT docs FROM fern.sparse_docs WHERE vectorizer_id = %s", (v_id,)).fetchone()
    return df, (row[0] if row else 0)


def recomputed(vectors: dict) -> tuple[dict[int, int], int]:
    """Document frequencies counted in Python from the stored vectors."""
    df: Counter[int] = Counter()
    n = 0
    for per_key in vectors.values():
        for vec in per_key:
            df.update(vec.keys())
            n += 1
    return dict(df), n


def assert_df_exact(conn, v_id: int, **kw) -> None:
    vectors = stored(conn, **kw)
    assert df_table(conn, v_id) == recomputed(vectors)


@pytest.fixture
def docs(conn, fern, pg_db, pg_target):
    conn.execute("CREATE TABLE docs (id int PRIMARY KEY, body text, lang text DEFAULT 'en')")
    with conn.cursor() as cur:
        cur.executemany("INSERT INTO docs (id, body) VALUES (%s, %s)", list(DOCS.items()))
    v = create_vectorizer(conn, "docs", ["body"], client=fern)
    run_worker(pg_db, pg_target)
    return v


def test_the_worker_fills_the_sparse_column_with_the_sidecars_passage_vectors(conn, fern, docs):
    assert (docs.sparse_column, docs.sparse_learned) == ("embedding_sparse", False)
    assert conn.execute("SELECT format_type(atttypid, atttypmod) FROM pg_attribute WHERE "
                        "attrelid = 'docs'::regclass AND attname = 'embedding_sparse'"
                        ).fetchone()[0] == "sparsevec(1000000000)"
    vectors = stored(conn)
    assert sorted(vectors) == sorted(DOCS)
    ref = fern.embed(list(DOCS.values()), prompt="passage", sparse=True)
    for key, sv in zip(DOCS, ref.sparse):
        (got,) = vectors[key]
        assert sorted(got) == sv.indices.tolist()
        np.testing.assert_allclose([got[i] for i in sorted(got)], sv.values, rtol=1e-6)
    assert_df_exact(conn, docs.id)
    assert df_table(conn, docs.id)[1] == len(DOCS)


def test_document_frequencies_stay_exact_under_inserts_updates_and_deletes(conn, docs, pg_db, pg_target):
    conn.execute("UPDATE docs SET body = 'garden gnomes and garden tools for the garden' WHERE id = 3")
    conn.execute("UPDATE docs SET body = '' WHERE id = 4")  # blank: no vectors at all
    conn.execute("UPDATE docs SET lang = 'de' WHERE id = 5")  # no text change: nothing to do
    conn.execute("DELETE FROM docs WHERE id IN (6, 7)")
    conn.execute("INSERT INTO docs (id, body) VALUES (9, 'a brand new text about zorblax trains'),"
                 " (10, 'the the the')")  # only stopwords: an empty sparse vector, still a document
    conn.execute("UPDATE docs SET id = 11 WHERE id = 8")  # a new key, the same vector
    assert_df_exact(conn, docs.id)  # deletes count at once, in the deleting transaction
    run_worker(pg_db, pg_target)
    vectors = stored(conn)
    assert sorted(vectors) == [1, 2, 3, 5, 9, 10, 11]
    assert vectors[10] == [{}]
    assert_df_exact(conn, docs.id)
    df, n = df_table(conn, docs.id)
    assert n == 7
    # The rewritten row now holds "garden" too: rows 1, 3, 5, 11.
    garden = [t for t, c in recomputed({k: vectors[k] for k in (3,)})[0].items()]
    assert any(df[t] == 4 for t in garden)
    conn.execute("TRUNCATE docs")
    assert df_table(conn, docs.id) == ({}, 0)


def test_chunk_tables_keep_sparse_vectors_and_their_frequencies(conn, fern, pg_db, pg_target):
    conn.execute("CREATE TABLE long (id int PRIMARY KEY, body text)")
    words = " ".join(f"word{i} garden" for i in range(60))
    conn.execute("INSERT INTO long VALUES (1, %s), (2, 'a short garden note'), (3, 'zorblax')", (words,))
    v = create_vectorizer(conn, "long", ["body"], client=fern, chunking="split", chunk_tokens=32,
                          chunk_overlap=4)
    run_worker(pg_db, pg_target)
    chunks = conn.execute("SELECT count(*) FROM long_embedding_chunks WHERE embedding_sparse IS NOT NULL"
                          ).fetchone()[0]
    assert chunks > 3
    kw = {"table": "long_embedding_chunks"}
    assert_df_exact(conn, v.id, **kw)
    conn.execute("DELETE FROM long WHERE id = 1")
    conn.execute("UPDATE long SET body = 'zorblax garden' WHERE id = 2")
    run_worker(pg_db, pg_target)
    assert sorted(stored(conn, **kw)) == [2, 3]
    assert_df_exact(conn, v.id, **kw)
    hits = search(conn, "long", "zorblax", 2, client=fern)
    assert {h.row["id"] for h in hits if h.text_rank is not None} == {2, 3}


def bm25_reference(conn, fern, query: str) -> list[int]:
    """Keys ranked by BM25 computed in Python: stored document vectors, df counted here, Qdrant's IDF."""
    vectors = {k: v[0] for k, v in stored(conn).items()}
    df, n = recomputed({k: [v] for k, v in vectors.items()})
    q = fern.embed([query], prompt="query", sparse=True).sparse[0]
    weights = {int(t): math.log(1 + (n - df[int(t)] + 0.5) / (df[int(t)] + 0.5)) for t in q.indices
               if int(t) in df}
    scores = {k: sum(w * vec.get(t, 0.0) for t, w in weights.items()) for k, vec in vectors.items()}
    return [k for k, s in sorted(scores.items(), key=lambda kv: -kv[1]) if s > 0]


def test_hybrid_fuses_dense_with_bm25(conn, fern, docs):
    query = "computer won't boot, black screen (zorblax)"
    hits = search(conn, "docs", query, 8, client=fern)  # hybrid by default: it keeps sparse vectors
    by_id = {h.row["id"]: h for h in hits}
    assert set(list(by_id)[:2]) == {1, 2}
    assert by_id[1].text_rank == 1  # the rare word, found by BM25
    assert by_id[2].vector_rank == 1 and by_id[2].text_rank is None
    for h in hits:
        expect = sum(1 / (1 + r) for r in (h.vector_rank, h.text_rank) if r is not None)
        assert h.score == pytest.approx(expect)
    assert "embedding_sparse" not in hits[0].row
    # The sparse list is BM25 itself.
    query = "garden gnomes in the garden"
    lexical = sorted((h for h in search(conn, "docs", query, 8, client=fern) if h.text_rank),
                     key=lambda h: h.text_rank)
    assert [h.row["id"] for h in lexical] == bm25_reference(conn, fern, query)


def test_where_filters_the_sparse_side_too(conn, fern, docs):
    conn.execute("UPDATE docs SET lang = 'de' WHERE id = 1")
    hits = search(conn, "docs", "zorblax", 8, where="t.lang = %s", params=["en"], client=fern)
    assert 1 not in {h.row["id"] for h in hits}
    assert all(h.text_rank is None for h in hits)


def test_a_vectorizer_with_both_lexical_sides_picks_either(conn, fern, pg_db, pg_target):
    conn.execute("CREATE TABLE both_sides (id int PRIMARY KEY, body text)")
    with conn.cursor() as cur:
        cur.executemany("INSERT INTO both_sides VALUES (%s, %s)", list(DOCS.items()))
    v = create_vectorizer(conn, "both_sides", ["body"], client=fern, hybrid=True)
    assert v.sparse_column and v.tsv_column
    run_worker(pg_db, pg_target)
    for lexical in ("sparse", "fulltext", None):
        hits = search(conn, "both_sides", "zorblax gnomes", 3, client=fern, lexical=lexical)
        assert hits[0].row["id"] == 1 and hits[0].text_rank == 1
        assert set(hits[0].row) == {"id", "body"}


def test_without_sparse_vectors_a_vectorizer_is_as_before(conn, fern, pg_db, pg_target):
    conn.execute("CREATE TABLE plain (id int PRIMARY KEY, body text)")
    conn.execute("INSERT INTO plain VALUES (1, 'zorblax gnomes'), (2, 'a cat on a mat')")
    v = create_vectorizer(conn, "plain", ["body"], client=fern, sparse=False, hybrid=True)
    assert v.sparse_column is None
    run_worker(pg_db, pg_target)
    cols = {r[0] for r in conn.execute("SELECT attname FROM pg_attribute WHERE attrelid = 'plain'::regclass "
                                       "AND attnum > 0")}
    assert "embedding_sparse" not in cols
    assert conn.execute("SELECT count(*) FROM fern.sparse_df").fetchone()[0] == 0
    hits = search(conn, "plain", "zorblax", 2, client=fern)  # full text, as before
    assert hits[0].row["id"] == 1 and hits[0].text_rank == 1
    with pytest.raises(VectorizerError, match="lexical='sparse'.*sparse=True"):
        search(conn, "plain", "zorblax", 2, client=fern, lexical="sparse")


def test_bad_options_name_the_input(conn, fern, docs):
    conn.execute("CREATE TABLE other (id int PRIMARY KEY, body text, embedding_sparse text)")
    with pytest.raises(VectorizerError, match="sparse must be True, False or None.*'yes'"):
        create_vectorizer(conn, "other", ["body"], client=fern, sparse="yes")
    with pytest.raises(VectorizerError, match="'embedding_sparse' of public.other is text"):
        create_vectorizer(conn, "other", ["body"], client=fern)
    with pytest.raises(VectorizerError, match="sparse column 'embedding_sparse'.*source or key"):
        create_vectorizer(conn, "other", ["body", "embedding_sparse"], client=fern)
    with pytest.raises(ValueError, match="lexical must be 'sparse' or 'fulltext'.*'bm25'"):
        search(conn, "docs", "x", 3, client=fern, lexical="bm25")
    with pytest.raises(VectorizerError, match="lexical='fulltext'.*hybrid=True"):
        search(conn, "docs", "x", 3, client=fern, lexical="fulltext")
    with pytest.raises(ValueError, match="hybrid=False"):
        search(conn, "docs", "x", 3, client=fern, lexical="sparse", hybrid=False)


def test_drop_column_drops_the_sparse_column_and_its_frequencies(conn, docs):
    drop_vectorizer(conn, "docs", drop_column=True)
    cols = {r[0] for r in conn.execute("SELECT attname FROM pg_attribute WHERE attrelid = 'docs'::regclass "
                                       "AND attnum > 0 AND NOT attisdropped")}
    assert cols == {"id", "body", "lang"}
    assert conn.execute("SELECT count(*) FROM fern.sparse_df").fetchone()[0] == 0
    assert conn.execute("SELECT count(*) FROM pg_proc WHERE proname ~ '^vectorizer_'").fetchone()[0] == 0


@pytest.fixture(scope="module")
def m3_target(sidecar_factory, tmp_path_factory):
    from tests.bge_m3_checkpoint import build_bge_m3

    checkpoint = build_bge_m3(tmp_path_factory.mktemp("m3-pg") / "bge-m3", seed=37)
    process = sidecar_factory("--model", f"bge-m3={checkpoint.path}", "--model", "default")
    yield process.target
    process.stop()


def test_learned_sparse_weights_are_stored_and_queried_as_they_are(conn, pg_db, m3_target):
    from sidecar.client import FernClient

    with FernClient(m3_target, timeout=120) as m3:
        conn.execute("CREATE TABLE docs (id int PRIMARY KEY, body text)")
        with conn.cursor() as cur:
            cur.executemany("INSERT INTO docs VALUES (%s, %s)", list(DOCS.items()))
        v = create_vectorizer(conn, "docs", ["body"], client=m3, model="bge-m3")
        assert (v.sparse_column, v.sparse_learned) == ("embedding_sparse", True)
        run_worker(pg_db, m3_target)
        vectors = {k: vec[0] for k, vec in stored(conn).items()}
        ref = m3.embed(list(DOCS.values()), model="bge-m3", prompt="passage", sparse=True)
        for key, sv in zip(DOCS, ref.sparse):
            assert sorted(vectors[key]) == sv.indices.tolist()
            np.testing.assert_allclose([vectors[key][i] for i in sorted(vectors[key])], sv.values, rtol=1e-6)
        # Learned weights need no IDF: nothing is counted.
        assert df_table(conn, v.id) == ({}, 0)
        query = "garden gnomes in the garden"
        q = m3.embed([query], model="bge-m3", prompt="query", sparse=True).sparse[0]
        weights = dict(zip(q.indices.tolist(), q.values.tolist()))
        scores = {k: sum(w * vec.get(t, 0.0) for t, w in weights.items()) for k, vec in vectors.items()}
        expect = [k for k, s_ in sorted(scores.items(), key=lambda kv: -kv[1]) if s_ > 0]
        assert expect  # the random model's weights share tokens with the query
        hits = search(conn, "docs", query, 8, client=m3)
        lexical = sorted((h for h in hits if h.text_rank), key=lambda h: h.text_rank)
        assert [h.row["id"] for h in lexical] == expect[:len(lexical)] and len(lexical) == min(8, len(expect))


@pytest.mark.slow
def test_a_model_change_brings_its_own_sparse_vectors_and_frequencies(conn, pg_db, sidecar_factory):
    from adapters.postgres.vectorizer import alter_vectorizer, get_vectorizer
    from sidecar.client import FernClient

    side = sidecar_factory("--model", "mini-a=default", "--model", "mini-b=default")
    with FernClient(side.target, timeout=120) as client:
        conn.execute("CREATE TABLE docs (id int PRIMARY KEY, body text)")
        with conn.cursor() as cur:
            cur.executemany("INSERT INTO docs VALUES (%s, %s)", list(DOCS.items()))
        v = create_vectorizer(conn, "docs", ["body"], client=client, model="mini-a")
        run_worker(pg_db, side.target)
        shadow = alter_vectorizer(conn, "docs", model="mini-b", client=client)
        assert shadow.sparse_column == "embedding_next_sparse"
        conn.execute("UPDATE docs SET body = 'zorblax trains' WHERE id = 3")
        conn.execute("DELETE FROM docs WHERE id = 4")
        run_worker(pg_db, side.target)
        after = get_vectorizer(conn, "docs")
        assert (after.id, after.model, after.sparse_column) == (v.id, "mini-b", "embedding_sparse")
        cols = {r[0] for r in conn.execute("SELECT attname FROM pg_attribute WHERE attrelid = 'docs'::regclass "
                                           "AND attnum > 0 AND NOT attisdropped")}
        assert cols == {"id", "body", "embedding", "embedding_sparse"}
        assert_df_exact(conn, v.id)
        assert conn.execute("SELECT count(*) FROM fern.sparse_df WHERE vectorizer_id <> %s",
                            (v.id,)).fetchone()[0] == 0
        # The swapped-in column's triggers count on.
        conn.execute("DELETE FROM docs WHERE id = 1")
        conn.execute("INSERT INTO docs VALUES (20, 'ceramic gnomes again')")
        run_worker(pg_db, side.target)
        assert sorted(stored(conn)) == [2, 3, 5, 6, 7, 8, 20]
        assert_df_exact(conn, v.id)
        hits = search(conn, "docs", "zorblax", 3, client=client)
        assert hits[0].row["id"] == 3 and hits[0].text_rank == 1


def test_concurrent_workers_keep_the_frequencies_exact(conn, fern, pg_db, pg_target):
    import threading

    from adapters.postgres.worker import Worker, WorkerConfig

    conn.execute("CREATE TABLE many (id int PRIMARY KEY, body text)")
    words = ["garden", "gnome", "train", "river", "city", "music", "laptop", "screen", "cat", "bread"]
    conn.execute("""INSERT INTO many
                    SELECT g, (%s::text[])[1 + g %% 10] || ' ' || (%s::text[])[1 + (g / 10) %% 10]
                              || ' note ' || g
                      FROM generate_series(1, 400) g""", (words, words))
    v = create_vectorizer(conn, "many", ["body"], client=fern)
    workers = [Worker(WorkerConfig(dsn=pg_db, target=pg_target, batch_size=8)) for _ in range(3)]
    threads = [threading.Thread(target=w.run, kwargs={"until_empty": True, "timeout": 300}) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for w in workers:
        w.close()
    assert sum(w.stats.vectorizers_parked for w in workers) == 0
    assert sum(w.stats.rows_written for w in workers) == 400
    assert_df_exact(conn, v.id, table="many")
    assert df_table(conn, v.id)[1] == 400


def test_fern_pg_vectorize_keeps_sparse_vectors_unless_told_not_to(conn, pg_db, pg_target):
    from cli_helpers import assert_one_line_error, fern_pg

    conn.execute("CREATE TABLE a (id int PRIMARY KEY, body text)")
    conn.execute("CREATE TABLE b (id int PRIMARY KEY, body text)")
    common = ("--dsn", pg_db, "--target", pg_target, "-c", "body")
    out = fern_pg("vectorize", "a", *common)
    assert out.returncode == 0, out.stderr
    out = fern_pg("vectorize", "b", *common, "--no-sparse")
    assert out.returncode == 0, out.stderr
    assert dict(conn.execute("SELECT table_name, sparse_column FROM fern.vectorizers").fetchall()) == {
        "a": "embedding_sparse", "b": None}
    out = fern_pg("vectorize", "b", *common, "--target-column", "e2", env={"FERN_PG_NO_SPARSE": "maybe"})
    assert_one_line_error(out, "FERN_PG_NO_SPARSE", "maybe")


def test_the_sparse_migration_leaves_existing_vectorizers_as_they_were(pg_db):
    import psycopg

    from adapters.postgres.installer import install
    from adapters.postgres.migrate import apply_migrations, bundled_migrations
    from adapters.postgres.vectorizer import get_vectorizer

    with psycopg.connect(pg_db, autocommit=True) as c:
        assert apply_migrations(c, [m for m in bundled_migrations() if m.version < 3]) == [
            "0001_schema", "0002_guards_and_parking"]
        c.execute("CREATE TABLE old (id int PRIMARY KEY, body text)")
        c.execute("""INSERT INTO fern.vectorizers (table_schema, table_name, target_column, key_columns,
                         key_types, source_columns, template, model, dimensions, max_tokens, hybrid,
                         tsv_column, language)
                     VALUES ('public', 'old', 'embedding', '{id}', '{integer}', '{body}', '{body}', 'm',
                             384, 256, true, 'embedding_tsv', 'english')""")
        assert install(c) == ["0003_sparse"]
        v = get_vectorizer(c, "old")
        assert (v.sparse_column, v.sparse_learned, v.tsv_column) == (None, False, "embedding_tsv")
