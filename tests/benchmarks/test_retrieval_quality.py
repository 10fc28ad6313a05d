"""The retrieval-quality benchmark's path on a tiny slice: both databases, every system, the metrics by hand."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.retrieval_quality import (DATA, load_set, ndcg_at, postgres_runs, qdrant_runs, recall_at,
                                          rrf, score)


def test_metrics_by_hand():
    relevant = frozenset({"b"})
    assert ndcg_at(["a", "b", "c"], relevant) == pytest.approx(1 / math.log2(3))
    assert ndcg_at(["b"], relevant) == 1.0 and ndcg_at(["a"] * 10 + ["b"], relevant) == 0.0
    assert recall_at(["a", "b"], frozenset({"b", "z"})) == 0.5
    assert rrf(["a", "b"], ["b", "c"]) == ["b", "a", "c"]


def test_the_committed_set_is_whole_and_says_where_it_comes_from():
    data = json.loads(DATA.read_text("utf-8"))
    assert data["license"].startswith("PSF-2.0") and "CPython" in data["source"]
    ids = {p["id"] for p in data["passages"]}
    assert len(ids) == len(data["passages"]) >= 500
    assert len(data["queries"]) == 300
    assert all(set(q["relevant"]) <= ids and q["text"] for q in data["queries"])


@pytest.mark.slow
def test_a_slice_runs_through_qdrant_and_postgres(sidecar_target):
    data = load_set(queries=6, passages=40)
    assert len(data.passages) == 40 and all(q[2] <= {p for p, _ in data.passages} for q in data.queries)
    qdrant, postgres = qdrant_runs(sidecar_target, data, None), postgres_runs(sidecar_target, data, None)
    assert set(qdrant) == {"dense", "bm25", "hybrid"}
    assert set(postgres) == {"dense", "bm25", "fulltext", "hybrid", "hybrid_fulltext", "hybrid rrf_k=60",
                             "hybrid_bm25"}
    for runs in (qdrant, postgres):
        for rankings in runs.values():
            assert len(rankings) == len(data.queries)
            metrics = score(rankings, data)
            assert 0.0 <= metrics["ndcg@10"] <= metrics["recall@10"] <= 1.0
    # Qdrant's IDF modifier and the IDF-weighted sparsevec query rank by the same BM25 score
    # (two documents of equal score may swap places, so one query in six may differ).
    same = sum(a == b for a, b in zip(qdrant["bm25"], postgres["bm25"]))
    assert same >= len(data.queries) - 1, (qdrant["bm25"], postgres["bm25"])
    # On 40 passages, a summary finds its own docstring's body among the first ten.
    assert score(qdrant["dense"], data)["recall@10"] >= 0.5


@pytest.mark.slow
def test_the_rerank_rows_reorder_the_hybrid_candidates_by_the_sidecars_cross_encoder(sidecar_factory, tmp_path):
    from benchmarks.models import build_random_reranker
    from benchmarks.retrieval_quality import K, RERANK_DEPTH, RERANK_NAME, sidecar_reranker
    from sidecar.client import FernClient

    checkpoint = build_random_reranker("bert", tmp_path / "cross-encoder", seed=5)
    process = sidecar_factory("--model", "default", "--model", f"{RERANK_NAME}={checkpoint}")
    data = load_set(queries=3, passages=40)
    text = dict(data.passages)
    try:
        with FernClient(process.target, timeout=300) as client:
            runs = qdrant_runs(process.target, data, sidecar_reranker(client))
            for (_, query, _), hybrid, reranked in zip(data.queries, runs["hybrid"], runs["hybrid + rerank"]):
                assert len(reranked) == K < RERANK_DEPTH
                # The hybrid top K are among the RERANK_DEPTH candidates the cross-encoder scored, so its
                # best K of them and of the rows it returned are the rows it returned, in its order.
                union = list(dict.fromkeys(reranked + hybrid))
                order = client.rerank(query, [text[i] for i in union], model=RERANK_NAME).indices
                assert reranked == [union[i] for i in order[:K]]
    finally:
        process.stop()
