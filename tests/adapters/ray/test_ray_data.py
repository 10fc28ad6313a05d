"""Ray Data: a text column embedded through running sidecars (tasks) and by engine actors, each
equal row by row to FernClient's gRPC vectors, then written to PostgreSQL and to Qdrant."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import numpy as np
import pytest

# ray.data, not ray: a folder named ray on sys.path (this one) would pass for a namespace package.
pytest.importorskip("ray.data")
import pandas as pd  # noqa: E402
import pyarrow as pa  # noqa: E402
import ray  # noqa: E402
from qdrant_client import models  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "postgres"))
from pg_fixtures import pg_db, pg_dsn, pg_server  # noqa: E402,F401

from adapters.qdrant.client import FernQdrantClient  # noqa: E402
from adapters.qdrant.collection import DENSE  # noqa: E402
from adapters.ray import BatchError, FernEmbedder, SidecarEmbedder, embed_through  # noqa: E402
from adapters.ray import sidecars  # noqa: E402
from adapters.ray.batches import texts_of, with_vectors  # noqa: E402
from sidecar.client import FernClient, FernError  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
ROWS = 5000
_WORDS = ("river", "lamp", "orbit", "cedar", "piano", "harbor", "quartz", "meadow", "signal", "lantern")
# Short and all different, so a text's nearest neighbour in a vector store is itself.
TEXTS = [f"{_WORDS[i % 10]} {_WORDS[i // 10 % 10]} {_WORDS[i // 100 % 10]} note {i}" for i in range(ROWS)]
BATCH_ROWS = 500


def assert_same_vectors(got: np.ndarray, want: np.ndarray) -> None:
    """Row by row cosine >= 0.99999 (the same model and code, batched differently)."""
    assert got.shape == want.shape and got.dtype == np.float32
    cosines = np.sum(got * want, axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    worst = int(np.argmin(cosines))
    assert cosines[worst] >= 0.99999, f"row {worst}: cosine {cosines[worst]:.7f}"


def by_id(ds: "ray.data.Dataset") -> np.ndarray:
    """The dataset's `embedding` column as [ROWS, dims], in id order."""
    frame = ds.select_columns(["id", "embedding"]).to_pandas().sort_values("id")
    assert frame["id"].tolist() == list(range(ROWS))
    return np.stack(frame["embedding"].to_numpy()).astype(np.float32, copy=False)


# What Ray raises when a start-up piece misses its fixed wait: the raylet (30 s) or the GCS
# server's port file (RAY_gcs_server_port_wait_time_s, 30 s by default).
_START_TIMEOUTS = ("timed out during startup", "Timed out waiting for file")


def _start_ray(attempts: int = 3) -> None:
    """`ray.init` for a local instance, again when one of its processes missed Ray's start-up wait.

    On a loaded 2-core host a start's raylet can fail to come up at all (no raylet log, the GCS
    waiting for a node), or the GCS server can miss its port-file wait, where the next start takes
    2-12 s; any other error is raised.
    """
    for attempt in range(1, attempts + 1):
        try:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
            return
        except Exception as exc:  # Ray raises a bare Exception or a RuntimeError for these
            if attempt == attempts or not any(t in str(exc) for t in _START_TIMEOUTS):
                raise
            ray.shutdown()


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """A local Ray whose workers import this checkout (PYTHONPATH) and report no usage stats."""
    with pytest.MonkeyPatch.context() as patch:
        path = os.environ.get("PYTHONPATH", "")
        patch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ROOT), path) if p))
        patch.setenv("RAY_USAGE_STATS_ENABLED", "0")
        patch.setenv("RAY_gcs_server_port_wait_time_s", "90")
        _start_ray()
        ray.data.DataContext.get_current().enable_progress_bars = False
        try:
            yield
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def two_sidecars(sidecar_target: str, sidecar_factory) -> Iterator[str]:
    """Two running sidecars as one comma-list target, which the client balances."""
    second = sidecar_factory()
    yield f"{sidecar_target},{second.target}"
    second.stop()


@pytest.fixture(scope="module")
def reference(sidecar_target: str) -> np.ndarray:
    """FernClient's gRPC vectors of TEXTS, the sidecar as every other caller sees it."""
    with FernClient(sidecar_target, timeout=300) as client:
        return np.concatenate([client.embed(TEXTS[i:i + 1000], lane="batch").vectors
                               for i in range(0, ROWS, 1000)])


@pytest.fixture(scope="module")
def texts(local_ray: None) -> "ray.data.Dataset":
    return ray.data.from_items([{"id": i, "text": t} for i, t in enumerate(TEXTS)],
                               override_num_blocks=10)


@pytest.fixture(scope="module")
def through_sidecars(texts: "ray.data.Dataset", two_sidecars: str) -> "ray.data.Dataset":
    return texts.map_batches(embed_through(two_sidecars, column="text"), batch_size=BATCH_ROWS).materialize()


@pytest.fixture(scope="module")
def through_actors(texts: "ray.data.Dataset") -> "ray.data.Dataset":
    return texts.map_batches(FernEmbedder, fn_constructor_kwargs={"device": "cpu"}, concurrency=2,
                             num_cpus=1, batch_size=BATCH_ROWS).materialize()


def test_sidecar_tasks_equal_grpc_vectors(through_sidecars, reference: np.ndarray) -> None:
    assert_same_vectors(by_id(through_sidecars), reference)


def test_engine_actor_pool_equals_grpc_vectors(through_actors, reference: np.ndarray) -> None:
    assert_same_vectors(by_id(through_actors), reference)


@pytest.mark.parametrize("batch_format", ["pandas", "pyarrow"])
def test_every_batch_format_gets_the_same_vectors(texts, sidecar_target: str, reference: np.ndarray,
                                                  batch_format: str) -> None:
    out = texts.limit(300).map_batches(embed_through(sidecar_target), batch_format=batch_format,
                                       batch_size=100).to_pandas().sort_values("id")
    assert_same_vectors(np.stack(out["embedding"].to_numpy()), reference[out["id"].to_numpy()])


def test_sidecar_embedder_as_an_actor_class(texts, sidecar_target: str, reference: np.ndarray) -> None:
    out = texts.limit(200).map_batches(SidecarEmbedder, fn_constructor_kwargs={"target": sidecar_target},
                                       concurrency=1, batch_size=100).to_pandas().sort_values("id")
    assert_same_vectors(np.stack(out["embedding"].to_numpy()), reference[out["id"].to_numpy()])


def test_written_into_postgres(through_sidecars, reference: np.ndarray, pg_db: str) -> None:
    import psycopg
    from pgvector.psycopg import register_vector

    with psycopg.connect(pg_db, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        conn.execute("CREATE TABLE docs (id bigint PRIMARY KEY, body text NOT NULL, embedding vector(384))")

    def connect() -> psycopg.Connection:
        conn = psycopg.connect(pg_db)
        register_vector(conn)
        return conn

    through_sidecars.select_columns(["id", "text", "embedding"]).write_sql(
        "INSERT INTO docs (id, body, embedding) VALUES (%s, %s, %s)", connect)

    with psycopg.connect(pg_db) as conn:
        register_vector(conn)
        rows = conn.execute("SELECT id, body, embedding FROM docs ORDER BY id").fetchall()
        assert [r[0] for r in rows] == list(range(ROWS)) and [r[1] for r in rows] == TEXTS
        assert_same_vectors(np.stack([r[2].to_numpy() for r in rows]).astype(np.float32), reference)
        nearest = conn.execute("SELECT id FROM docs ORDER BY embedding <=> %s LIMIT 1",
                               (reference[1234],)).fetchone()
        assert nearest == (1234,)


def test_written_into_qdrant(through_actors, reference: np.ndarray, sidecar_target: str) -> None:
    qdrant = FernQdrantClient(":memory:", fern=sidecar_target)
    try:
        qdrant.setup_collection("docs", sparse=None)
        for batch in through_actors.iter_batches(batch_size=1000, batch_format="numpy"):
            qdrant.upsert("docs", models.Batch(
                ids=batch["id"].tolist(), vectors={DENSE: batch["embedding"].tolist()},
                payloads=[{"text": t} for t in batch["text"]]))
        assert qdrant.count("docs").count == ROWS
        stored = qdrant.retrieve("docs", [0, 4321], with_vectors=True)
        assert_same_vectors(np.array([p.vector[DENSE] for p in sorted(stored, key=lambda p: p.id)],
                                     dtype=np.float32), reference[[0, 4321]])
        hits = qdrant.search("docs", TEXTS[4321], k=1, hybrid=False)
        assert hits[0].id == 4321 and hits[0].payload["text"] == TEXTS[4321]
    finally:
        qdrant.close()


def test_a_missing_column_is_named(texts, sidecar_target: str) -> None:
    with pytest.raises(Exception, match=r"column 'body' is not in the batch \(its columns: 'id', 'text'\)"):
        texts.limit(10).map_batches(embed_through(sidecar_target, column="body")).materialize()


@pytest.mark.parametrize("make", [
    lambda: {"text": np.array(["a", None, "c"], dtype=object)},
    lambda: pd.DataFrame({"text": ["a", None, "c"]}),
    lambda: pa.table({"text": ["a", None, "c"]}),
], ids=["numpy", "pandas", "pyarrow"])
def test_a_missing_value_is_named_by_column_and_row(make) -> None:
    with pytest.raises(BatchError, match=r"column 'text', row 1 of the batch: expected a string, "
                                         r"got a missing value") as caught:
        texts_of(make(), "text")
    assert (caught.value.column, caught.value.row) == ("text", 1)


def test_a_value_of_another_type_is_named_with_its_type() -> None:
    with pytest.raises(BatchError, match=r"column 'text', row 2 of the batch: expected a string, got int 7"):
        texts_of({"text": np.array(["a", "b", 7], dtype=object)}, "text")


def test_a_text_the_sidecar_refuses_is_named_by_column_and_row(sidecar_target: str) -> None:
    embed = embed_through(sidecar_target, request_texts=2)
    with pytest.raises(BatchError, match=r"column 'text', row 3 of the batch: empty text"):
        embed({"text": np.array(["a", "b", "c", " ", "e"], dtype=object)})
    embed.close()


def test_vectors_keep_the_batch_format() -> None:
    vectors = np.arange(6, dtype=np.float32).reshape(3, 2)
    assert with_vectors({"text": np.array(["a", "b", "c"])}, "embedding", vectors)["embedding"] is vectors
    frame = with_vectors(pd.DataFrame({"text": ["a", "b", "c"]}), "embedding", vectors)
    assert np.array_equal(np.stack(frame["embedding"].to_numpy()), vectors)
    table = with_vectors(pa.table({"text": ["a", "b", "c"]}), "embedding", vectors)
    assert table.column_names == ["text", "embedding"]
    assert np.array_equal(table.column("embedding").chunk(0).to_numpy(), vectors)


@pytest.fixture(scope="module")
def embedder() -> Iterator[FernEmbedder]:
    """The actor's class in this process, with options a caller would set."""
    engine = FernEmbedder(device="cpu", dimensions=128, normalize=True)
    yield engine
    engine.close()


def test_options_reach_the_engine_and_the_sidecar_alike(embedder: FernEmbedder, sidecar_target: str) -> None:
    with FernClient(sidecar_target) as client:
        want = client.embed(TEXTS[:64], dimensions=128, normalize=True).vectors
    through = embed_through(sidecar_target, dimensions=128, normalize=True, request_texts=10)
    assert_same_vectors(through.embed(TEXTS[:64]), want)
    assert_same_vectors(embedder.embed(TEXTS[:64]), want)
    assert through.embed([]).shape == embedder.embed([]).shape == (0, 128)
    through.close()


def test_a_text_the_engine_refuses_is_named_by_column_and_row(embedder: FernEmbedder) -> None:
    with pytest.raises(BatchError, match=r"column 'text', row 2 of the batch: empty text"):
        embedder(pd.DataFrame({"text": ["a", "b", ""]}))
    with pytest.raises(BatchError, match=r"column 'text' is not in the batch \(its columns: 'body'\)"):
        embedder(pa.table({"body": ["a"]}))


class RefusingClient:
    """A FernClient stand-in whose first `refusals` calls fail with `code`, then answer zeros."""

    def __init__(self, code: grpc.StatusCode, refusals: int) -> None:
        self.code, self.refusals, self.calls = code, refusals, 0

    def __call__(self, target: str, **kwargs) -> "RefusingClient":
        return self

    def embed(self, texts: list[str], **options) -> SimpleNamespace:
        self.calls += 1
        if self.calls <= self.refusals:
            raise FernError(self.code, "the BATCH lane's queue is full")
        return SimpleNamespace(vectors=np.zeros((len(texts), 4), dtype=np.float32))

    def close(self) -> None:
        pass


@pytest.mark.parametrize("code", [grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE])
def test_a_full_or_restarting_sidecar_is_asked_again(monkeypatch: pytest.MonkeyPatch, code) -> None:
    fake = RefusingClient(code, refusals=3)
    monkeypatch.setattr(sidecars, "FernClient", fake)
    assert embed_through("127.0.0.1:1").embed(["a", "b"]).shape == (2, 4)
    assert fake.calls == 4


def test_asking_again_ends_at_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sidecars, "FernClient", RefusingClient(grpc.StatusCode.RESOURCE_EXHAUSTED, 10**6))
    with pytest.raises(FernError, match="RESOURCE_EXHAUSTED"):
        embed_through("127.0.0.1:1", timeout=0.3).embed(["a"])


def test_a_refusal_of_the_request_is_not_asked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = RefusingClient(grpc.StatusCode.NOT_FOUND, refusals=1)
    monkeypatch.setattr(sidecars, "FernClient", fake)
    with pytest.raises(FernError, match="NOT_FOUND"):
        embed_through("127.0.0.1:1").embed(["a"])
    assert fake.calls == 1


def test_a_bad_option_fails_where_the_pipeline_is_built() -> None:
    with pytest.raises(ValueError, match="lane must be one of"):
        embed_through("127.0.0.1:1", lane="bulk")
