"""`python -m benchmarks.rerank --smoke`: the reranking benchmark's whole path on the CPU, tiny sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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
    # The served side: the same scores through `fern serve`'s Rerank over loopback gRPC.
    served = result["fern_serve"]
    assert served["pairs_per_s"] > 0 and served["clients"] == 4
    assert served["max_abs_logit_difference_vs_engine"] <= 1e-3 * agreement["max_abs_logit"]
    # The roofline: this architecture's matmul FLOPs per pair, from its config and the pairs' lengths.
    roofline = result["roofline"]
    assert roofline["flops_per_pair"] > 0
    ceiling = roofline["matmul_tflops_sustained"] * 1e12 / roofline["flops_per_pair"]
    assert roofline["pairs_per_s_at_sustained_matmul_rate"] == pytest.approx(ceiling, rel=1e-4)
    assert roofline["most_possible_over_sentence_transformers"] == pytest.approx(
        ceiling / result["sentence_transformers"]["pairs_per_s"], rel=1e-2)
