"""`fern qdrant ingest` from a JSONL file into an on-disk local collection, and the Qdrant demo."""

from __future__ import annotations

import json

from adapters.qdrant import demo
from adapters.qdrant.client import FernQdrantClient
from adapters.qdrant.ingest import point_id
from sidecar.cli import main


def test_fern_qdrant_ingest_jsonl(sidecar_target, tmp_path, capsys):
    source = tmp_path / "docs.jsonl"
    rows = [{"doc": f"d{i}", "title": f"T{i}", "body": f"body text number {i}"} for i in range(25)]
    source.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    store = tmp_path / "qdrant"
    argv = ["qdrant", "ingest", str(source), "--collection", "docs", "--qdrant", str(store),
            "--target", sidecar_target, "--text", "{title}: {body}", "--id", "doc",
            "--payload", "title", "--batch-size", "10"]
    assert main(argv) == 0
    assert "ingested 25 rows into 'docs'" in capsys.readouterr().out
    assert main(argv) == 0  # again: same points, no duplicates

    client = FernQdrantClient(path=str(store), fern=sidecar_target)
    assert client.count("docs").count == 25
    point = client.retrieve("docs", [point_id("d7")])[0]
    assert point.payload == {"title": "T7"}
    assert client.search("docs", "T7: body text number 7", k=1)[0].id == point_id("d7")
    client.close()


def test_fern_qdrant_ingest_names_bad_lines(sidecar_target, tmp_path, capsys):
    source = tmp_path / "bad.jsonl"
    source.write_text('{"id": 1, "text": "fine"}\n{"id": 2, "text": oops}\n')
    argv = ["qdrant", "ingest", str(source), "--collection", "docs", "--qdrant", ":memory:",
            "--target", sidecar_target]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert f"{source}:2: not valid JSON" in err


def test_demo_prints_hybrid_results(sidecar_target, capsys):
    demo.run(sidecar_target)
    out = capsys.readouterr().out
    assert "ingested 9 rows into 'fern-demo'" in out
    assert "search 'automobile repair'" in out
    hybrid = next(line for line in out.splitlines() if line.strip().startswith("hybrid:"))
    assert hybrid.split(":", 1)[1].split(",")[0].strip().startswith("gala")
    assert "filter topic=cars: mechanic, dealer" in out
