"""`python -m benchmarks.rerank --smoke`: the reranking benchmark's whole path on the CPU, tiny sizes."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import rerank


def test_smoke_run_writes_the_figures_with_its_command(tmp_path: Path) -> None:
    out = tmp_path / "rerank.json"
    argv = ["--smoke", "--model-dir", str(tmp_path / "models"), "--out", str(out)]
    assert rerank.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["command"] == "python -m benchmarks.rerank " + " ".join(argv)
    assert (result["arch"], result["device"], result["dtype"]) == ("xlm-roberta", "cpu", "float32")
    assert result["workload"]["documents_per_query"] == 6 and result["workload"]["queries"] == 2
    assert result["fern"]["pairs_per_s"] > 0 and result["sentence_transformers"]["pairs_per_s"] > 0
    # Both sides read the same pairs: in fp32 their logits agree far inside the logits' own spread.
    agreement = result["agreement"]
    assert agreement["logit_range"] > 0
    assert agreement["max_abs_logit_difference"] <= 1e-3 * agreement["max_abs_logit"]
    assert agreement["top3_overlap_mean"] == 1.0
