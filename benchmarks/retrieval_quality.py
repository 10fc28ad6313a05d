"""Retrieval quality of dense, BM25-sparse and hybrid search, in Qdrant and in PostgreSQL, on a labelled set.

The set is benchmarks/data/stdlib_docstrings.json (tools/build_retrieval_set.py): each query
is a one-line docstring summary from CPython's standard library and its one relevant
passage is the same docstring's body; every other body is a distractor. Passages are
embedded through a real `fern serve` (the bundled all-MiniLM-L6-v2) and written by the
adapters themselves; queries go through the adapters' own search paths:

Qdrant (qdrant-client local mode, FernQdrantClient):
- dense: `search(hybrid=False)`, the dense vector alone;
- bm25: the sparse vector alone (`query_points(using="sparse")`): Fern's BM25 document
  vectors under Qdrant's IDF modifier, queried with BM25's query form;
- hybrid: `search()`, dense + sparse prefetches fused by Qdrant's RRF.

PostgreSQL (embedded PostgreSQL 18 + pgvector, the adapter's vectorizer and worker):
- dense: `search(hybrid=False)`, pgvector HNSW;
- bm25: Fern's BM25 document vectors in a `sparsevec(1000000000)` column, ranked by inner
  product with a query vector whose weights are Qdrant's IDF, ln(1 + (N - df + 0.5) /
  (df + 0.5)), counted over the stored vectors: the BM25 score itself;
- fulltext: PostgreSQL's own full-text side (tsvector, ts_rank_cd);
- hybrid: `search(hybrid=True)`, the adapter's default hybrid: dense + the vectorizer's own
  BM25 sparse vectors (filled by the worker, IDF from its document-frequency table), RRF in
  one statement;
- hybrid rrf_k=60: the same with RRF's textbook constant instead of Qdrant's 1;
- hybrid_fulltext: `search(hybrid=True, lexical="fulltext")`, dense + full-text RRF;
- hybrid_bm25: dense and bm25, each DEPTH deep, fused as Qdrant's RRF fuses them
  (1 / (1 + rank)): the Qdrant hybrid's vectors and fusion, in PostgreSQL.

`--rerank-model DIR` adds "+ rerank" rows: the hybrid top RERANK_DEPTH re-ordered by a
cross-encoder the sidecar serves from DIR (as model "rerank"), through its Rerank call: the
adapters' own `search(..., rerank_text=...)` (Qdrant) and `search(..., rerank=N)` (PostgreSQL)
for "hybrid + rerank", `FernClient.rerank` for "hybrid_bm25 + rerank". No cross-encoder
weights ship with Fern, so these rows run only with a checkpoint given.

Each row reports nDCG@10 and recall@10 (one relevant passage a query, so nDCG@10 is the
mean of 1 / log2(1 + rank) over queries whose passage ranks in the top 10).

Usage: python -m benchmarks.retrieval_quality [--queries N] [--passages N] [--only qdrant|postgres]
       [--device cpu] [--target HOST:PORT] [--rerank-model DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from sidecar.client import FernClient

DATA = Path(__file__).resolve().parent / "data" / "stdlib_docstrings.json"
K = 10
DEPTH = 40  # candidates each side of a fusion: the adapters' default for k = 10
QDRANT_RRF_K = 1  # qdrant-client's RRF: 1 / (pos + 2) for 0-based pos, i.e. 1 / (1 + rank)
RERANK_DEPTH = 30
SPARSEVEC_DIM = 1_000_000_000
# The adapter's hybrid again with another RRF constant than its default (Qdrant's, 1).
EXTRA_RRF_K = (60,)


@dataclass(frozen=True)
class RetrievalSet:
    """Passages (id, text), and queries (id, text, ids of the relevant passages)."""

    name: str
    passages: list[tuple[str, str]]
    queries: list[tuple[str, str, frozenset[str]]]


def load_set(path: Path = DATA, queries: int | None = None, passages: int | None = None) -> RetrievalSet:
    """The set at `path`; `queries` keeps the first N queries, `passages` cuts the corpus to N
    passages (the kept queries' relevant ones always among them)."""
    data = json.loads(path.read_text("utf-8"))
    qs = [(q["id"], q["text"], frozenset(q["relevant"])) for q in data["queries"]][:queries]
    ps = [(p["id"], p["text"]) for p in data["passages"]]
    if passages is not None:
        needed = set().union(*(q[2] for q in qs))
        ps = [p for p in ps if p[0] in needed] + [p for p in ps if p[0] not in needed]
        ps = ps[:max(passages, len(needed))]
    return RetrievalSet(data["name"], ps, qs)


def ndcg_at(ranked: list[str], relevant: frozenset[str], k: int = K) -> float:
    """Binary-relevance nDCG@k."""
    dcg = sum(1.0 / math.log2(i + 2) for i, pid in enumerate(ranked[:k]) if pid in relevant)
    ideal = sum(1.0 / math.log2(i + 2) for i in range(min(len(relevant), k)))
    return dcg / ideal if ideal else 0.0


def recall_at(ranked: list[str], relevant: frozenset[str], k: int = K) -> float:
    return len(set(ranked[:k]) & relevant) / len(relevant) if relevant else 0.0


def score(rankings: list[list[str]], data: RetrievalSet) -> dict[str, float]:
    """Mean nDCG@10 and recall@10 of one system's rankings (one list a query, in query order)."""
    n = len(data.queries)
    return {"ndcg@10": round(sum(ndcg_at(r, q[2]) for r, q in zip(rankings, data.queries)) / n, 4),
            "recall@10": round(sum(recall_at(r, q[2]) for r, q in zip(rankings, data.queries)) / n, 4)}


def rrf(*rankings: list[str], k: int = QDRANT_RRF_K) -> list[str]:
    """Reciprocal rank fusion of ranked id lists: sum of 1 / (k + rank), best first."""
    fused: Counter[str] = Counter()
    for ranking in rankings:
        for rank, pid in enumerate(ranking, start=1):
            fused[pid] += 1.0 / (k + rank)
    return [pid for pid, _ in sorted(fused.items(), key=lambda item: (-item[1], item[0]))]


def idf(df: int, n: int) -> float:
    """Qdrant's IDF for a term in `df` of `n` documents."""
    return math.log(1.0 + (n - df + 0.5) / (df + 0.5))


# (query, passages) -> the passages' positions, best first.
Reranker = Callable[[str, list[str]], list[int]]


def reranked(data: RetrievalSet, candidates: list[list[str]], rerank: Reranker) -> list[list[str]]:
    """Each query's first RERANK_DEPTH candidates re-ordered by the cross-encoder."""
    text = dict(data.passages)
    out = []
    for (_, query, _), ids in zip(data.queries, candidates):
        ids = ids[:RERANK_DEPTH]
        out.append([ids[i] for i in rerank(query, [text[i] for i in ids])] if ids else [])
    return out


def qdrant_runs(target: str, data: RetrievalSet, rerank: Reranker | None) -> dict[str, list[list[str]]]:
    from adapters.qdrant.client import FernQdrantClient
    from adapters.qdrant.documents import qdrant_sparse

    client = FernQdrantClient(":memory:", fern=target)
    try:
        client.setup_collection("docs")
        rows = [{"id": n, "pid": pid, "text": text} for n, (pid, text) in enumerate(data.passages)]
        # The text travels in the payload only for the cross-encoder to read.
        client.ingest("docs", rows, text="text", id="id", payload=["pid", "text"] if rerank else ["pid"],
                      progress=False)
        runs: dict[str, list[list[str]]] = {"dense": [], "bm25": [], "hybrid": []}
        if rerank:
            runs["hybrid + rerank"] = []
        for _, query, _ in data.queries:
            runs["dense"].append([p.payload["pid"] for p in client.search("docs", query, K, hybrid=False)])
            emb = client.fern.embed([query], lane="online", prompt="query", sparse=True)
            hits = client.query_points("docs", query=qdrant_sparse(emb.sparse[0]), using="sparse",
                                       limit=K, with_payload=["pid"]).points
            runs["bm25"].append([p.payload["pid"] for p in hits])
            runs["hybrid"].append([p.payload["pid"] for p in client.search("docs", query, K, with_payload=["pid"])])
            if rerank:
                runs["hybrid + rerank"].append([p.payload["pid"] for p in client.search(
                    "docs", query, K, rerank_text="text", rerank_top=RERANK_DEPTH, rerank_model=RERANK_NAME,
                    with_payload=["pid"])])
        return runs
    finally:
        client.close()


def postgres_runs(target: str, data: RetrievalSet, rerank: Reranker | None) -> dict[str, list[list[str]]]:
    import psycopg
    from pgvector import SparseVector
    from pgvector.psycopg import register_vector
    from psycopg import sql

    from adapters.postgres.embedded import EmbeddedPostgres
    from adapters.postgres.installer import install
    from adapters.postgres.search import _TSQUERY_ANY, search
    from adapters.postgres.vectorizer import create_vectorizer
    from adapters.postgres.worker import Worker, WorkerConfig
    from sidecar.client import FernClient

    with EmbeddedPostgres() as pg, FernClient(target, timeout=600) as fern, \
            psycopg.connect(pg.dsn, autocommit=True) as conn:
        install(conn)
        conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        register_vector(conn)
        conn.execute(f"CREATE TABLE docs (id text PRIMARY KEY, body text, bm25 sparsevec({SPARSEVEC_DIM}))")
        with conn.cursor() as cur:
            cur.executemany("INSERT INTO docs (id, body) VALUES (%s, %s)", data.passages)
        v = create_vectorizer(conn, "docs", ["body"], client=fern, hybrid=True)
        worker = Worker(WorkerConfig(pg.dsn, target))
        try:
            worker.run(until_empty=True, timeout=1800)
        finally:
            worker.close()
        # The BM25 document vectors, from the same sidecar, into the sparsevec column.
        df: Counter[int] = Counter()
        texts = [text for _, text in data.passages]
        for start in range(0, len(texts), 256):
            emb = fern.embed(texts[start:start + 256], lane="batch", prompt="passage", sparse=True)
            rows = []
            for (pid, _), sv in zip(data.passages[start:start + 256], emb.sparse):
                df.update(sv.indices.tolist())
                rows.append((SparseVector(dict(zip(sv.indices.tolist(), sv.values.tolist())), SPARSEVEC_DIM), pid))
            with conn.cursor() as cur:
                cur.executemany("UPDATE docs SET bm25 = %s WHERE id = %s", rows)
        n = len(texts)
        fts = sql.SQL("""SELECT id FROM docs, {tsq} AS q(tsq) WHERE {tsv} @@ q.tsq
                          ORDER BY ts_rank_cd({tsv}, q.tsq) DESC, id LIMIT %s""").format(
            tsq=_TSQUERY_ANY, tsv=sql.Identifier(v.tsv_column))
        runs: dict[str, list[list[str]]] = {"dense": [], "bm25": [], "fulltext": [], "hybrid": [],
                                            "hybrid_fulltext": [], "hybrid_bm25": []}
        for rrf_k in EXTRA_RRF_K:
            runs[f"hybrid rrf_k={rrf_k}"] = []
        if rerank:
            runs["hybrid + rerank"] = []
        for _, query, _ in data.queries:
            dense = [h.row["id"] for h in search(conn, "docs", query, DEPTH, hybrid=False, client=fern)]
            runs["dense"].append(dense[:K])
            q = fern.embed([query], lane="online", prompt="query", sparse=True).sparse[0]
            weights = {int(i): idf(df[int(i)], n) for i in q.indices if df[int(i)]}
            bm25: list[str] = []
            if weights:
                bm25 = [r[0] for r in conn.execute(
                    "SELECT id FROM docs ORDER BY bm25 <#> %s, id LIMIT %s",
                    (SparseVector(weights, SPARSEVEC_DIM), DEPTH)).fetchall()]
            runs["bm25"].append(bm25[:K])
            runs["fulltext"].append([r[0] for r in conn.execute(fts, ("english", query, K)).fetchall()])
            runs["hybrid"].append([h.row["id"] for h in search(conn, "docs", query, K, hybrid=True,
                                                               client=fern)])
            runs["hybrid_fulltext"].append([h.row["id"] for h in search(
                conn, "docs", query, K, hybrid=True, lexical="fulltext", client=fern)])
            for rrf_k in EXTRA_RRF_K:
                runs[f"hybrid rrf_k={rrf_k}"].append([h.row["id"] for h in search(
                    conn, "docs", query, K, hybrid=True, client=fern, rrf_k=rrf_k)])
            # RERANK_DEPTH deep when "hybrid_bm25 + rerank" reorders it; scored on its first K either way.
            runs["hybrid_bm25"].append(rrf(dense, bm25)[:RERANK_DEPTH if rerank else K])
            if rerank:
                runs["hybrid + rerank"].append([h.row["id"] for h in search(
                    conn, "docs", query, K, hybrid=True, client=fern, rerank=RERANK_DEPTH,
                    rerank_model=RERANK_NAME)])
        if rerank:
            runs["hybrid_bm25 + rerank"] = reranked(data, runs["hybrid_bm25"], rerank)
        return runs


RERANK_NAME = "rerank"


def sidecar_reranker(client: FernClient) -> Reranker:
    """The sidecar's Rerank call with the cross-encoder it serves as RERANK_NAME."""
    if RERANK_NAME not in {m.name for m in client.list_models()}:
        raise SystemExit(f"retrieval_quality: the sidecar serves no model named {RERANK_NAME!r}")
    return lambda query, passages: client.rerank(query, passages, model=RERANK_NAME).indices


def run(data: RetrievalSet, target: str, only: str | None = None,
        rerank: Reranker | None = None) -> dict[str, dict[str, dict[str, float]]]:
    """{database: {system: {"ndcg@10", "recall@10"}}} for the set."""
    results: dict[str, dict[str, dict[str, float]]] = {}
    for database, runs_of in (("qdrant", qdrant_runs), ("postgres", postgres_runs)):
        if only and only != database:
            continue
        results[database] = {system: score(rankings, data)
                             for system, rankings in runs_of(target, data, rerank).items()}
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--queries", type=int, default=None, help="the first N queries (default all)")
    parser.add_argument("--passages", type=int, default=None, help="cut the corpus to N passages")
    parser.add_argument("--only", choices=("qdrant", "postgres"), default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--target", default=None, help="use a running sidecar at HOST:PORT")
    parser.add_argument("--rerank-model", type=Path, default=None,
                        help="a cross-encoder checkpoint, served as \"rerank\" beside the bundled "
                             "embedder (with --target: that sidecar serves it under that name)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu/retrieval_quality.json"))
    args = parser.parse_args(argv)

    from benchmarks.pg_common import write_result
    from benchmarks.server import start_sidecar
    from sidecar.client import FernClient

    data = load_set(args.data, args.queries, args.passages)
    side = None
    if args.target is None:
        extra = []
        if args.rerank_model:
            extra = ["--model", "default", "--model", f"{RERANK_NAME}={args.rerank_model}"]
        side = start_sidecar(None, device=args.device, extra=extra,
                             log_dir=Path(tempfile.mkdtemp(prefix="fern-quality-")), name="quality")
    target = args.target or side.target
    try:
        with FernClient(target, timeout=600) as client:
            rerank = sidecar_reranker(client) if args.rerank_model else None
            results = run(data, target, args.only, rerank)
    finally:
        if side is not None:
            side.stop()
    source = json.loads(args.data.read_text("utf-8"))
    write_result("retrieval_quality", argv, {
        "set": {"name": data.name, "source": source["source"], "license": source["license"],
                "relevance": source["relevance"], "queries": len(data.queries),
                "passages": len(data.passages)},
        "model": "all-MiniLM-L6-v2 (bundled), sparse: Fern BM25 (english)",
        "results": results}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
