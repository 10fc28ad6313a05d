"""`benchmarks.lanes_e2e --st-baseline`: sentence-transformers' rate on the batch clients' passage lengths, per batch size."""

from __future__ import annotations

import pytest

from benchmarks import lanes_e2e


def test_the_baseline_measures_each_batch_size_on_new_passages_and_names_the_best() -> None:
    from core_engine.loader import default_model_dir

    tokenizer = str(default_model_dir() / "tokenizer.json")
    result = lanes_e2e.sentence_transformers_baseline(None, "cpu", tokenizer, low=16, high=48, texts=24,
                                                      batch_sizes=[4, 12], passes=1)
    rates = result["tokens_per_s_by_batch_size"]
    assert set(rates) == {"4", "12"} and all(rate > 0 for rate in rates.values())
    assert result["tokens_per_s"] == max(rates.values())
    assert rates[str(result["best_batch_size"])] == result["tokens_per_s"]
    assert (result["dtype"], result["texts_per_pass"], result["passes"]) == ("float32", 24, 1)


def test_a_stand_in_run_refuses_the_baseline_it_has_no_counterpart_for(capsys) -> None:
    with pytest.raises(SystemExit):
        lanes_e2e.main(["--stand-in", "100,100", "--st-baseline"])
    assert "--st-baseline" in capsys.readouterr().err
