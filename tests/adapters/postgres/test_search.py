"""Search: hybrid RRF finds both the lexical and the semantic match; filters; plain vector search."""

from __future__ import annotations

import pytest
from pg_helpers import run_worker

from adapters.postgres.search import search
from adapters.postgres.vectorizer import VectorizerError, create_vectorizer

# The lexical match shares only a rare code word with the query; the semantic match shares
# no word with it (after stop words) but means the same thing.
CORPUS = {
    "lexical": "Zorblax is the codename of the new line of ceramic garden gnomes.",
    "semantic": "My laptop will not turn on and the display stays dark after I press power.",
    "cat": "The cat sat quietly on the warm windowsill all afternoon.",
    "finance": "Quarterly revenue grew by ten percent thanks to strong exports.",
    "garden": "Tomatoes need plenty of sunlight and regular watering to ripen.",
    "recipe": "Whisk the eggs with sugar until pale, then fold in the flour.",
    "travel": "The night train from Vienna to Venice crosses the Alps.",
    "music": "The orchestra rehearsed the symphony's final movement twice.",
}
QUERY = "computer won't boot, black screen (zorblax)"


@pytest.fixture
def corpus(conn, fern, pg_db, pg_target):
    conn.execute("CREATE TABLE kb (name text PRIMARY KEY, body text, lang text DEFAULT 'en')")
    with conn.cursor() as cur:
        cur.executemany("INSERT INTO kb (name, body) VALUES (%s, %s)", list(CORPUS.items()))
    conn.execute("UPDATE kb SET lang = 'de' WHERE name = 'travel'")
    create_vectorizer(conn, "kb", ["body"], client=fern, hybrid=True)
    run_worker(pg_db, pg_target)
    return conn


def names(hits) -> list[str]:
    return [h.row["name"] for h in hits]


def test_hybrid_finds_the_lexical_and_the_semantic_match(corpus, fern):
    vector_only = search(corpus, "kb", QUERY, 3, hybrid=False, client=fern)
    assert names(vector_only)[0] == "semantic"
    hybrid = search(corpus, "kb", QUERY, 3, client=fern)
    assert set(names(hybrid)[:2]) == {"lexical", "semantic"}
    by_name = {h.row["name"]: h for h in hybrid}
    assert by_name["lexical"].text_rank == 1
    assert by_name["semantic"].text_rank is None  # full text alone cannot find it
    assert by_name["semantic"].vector_rank == 1
    # RRF: each hit's score is the sum of 1/(1 + rank) over the lists it is in.
    for h in hybrid:
        expect = sum(1 / (1 + r) for r in (h.vector_rank, h.text_rank) if r is not None)
        assert h.score == pytest.approx(expect)
    # Rows come back without the vector and tsvector columns.
    assert set(hybrid[0].row) == {"name", "body", "lang"}


def test_where_filter_applies_to_both_sides(corpus, fern):
    hits = search(corpus, "kb", "train through the mountains", 8, where="t.lang = %s",
                  params=["en"], client=fern)
    assert "travel" not in names(hits)
    hits = search(corpus, "kb", "train through the mountains", 1, where="t.lang = %s",
                  params=["de"], client=fern)
    assert names(hits) == ["travel"]


def test_plain_vector_search_orders_by_distance(corpus, fern):
    hits = search(corpus, "kb", "a kitten resting in the sun", 8, hybrid=False, client=fern)
    assert names(hits)[0] == "cat"
    d = [h.distance for h in hits]
    assert d == sorted(d) and len(hits) == 8
    assert all(h.score == pytest.approx(1 - h.distance) for h in hits)


def test_hybrid_needs_a_hybrid_vectorizer(conn, fern):
    conn.execute("CREATE TABLE plain (id int PRIMARY KEY, body text)")
    create_vectorizer(conn, "plain", ["body"], client=fern, sparse=False)
    with pytest.raises(VectorizerError, match="sparse=True .* or hybrid=True"):
        search(conn, "plain", "x", 3, hybrid=True, client=fern)
    assert search(conn, "plain", "x", 3, client=fern) == []  # no vectors yet: no rows


def test_search_through_a_connection_pool(corpus, fern, pg_db):
    from psycopg_pool import ConnectionPool

    with ConnectionPool(pg_db, min_size=1, max_size=2, open=True) as pool:
        hits = search(pool, "kb", "a kitten resting in the sun", 1, client=fern)
    assert names(hits) == ["cat"]
