"""The benchmark harness's own pieces: text lengths, FLOP counting, the `fern bench` parser, plots."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from benchmarks.cli import register
from benchmarks.models import ARCHS
from benchmarks.suite import PLANS, _settled_heap, _timed_passes, flops_per_token, sustained_matmul_tflops
from benchmarks.texts import Workload, make_texts, workload_texts


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    from core_engine.loader import default_model_dir

    tok = Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    return tok


@pytest.mark.parametrize("vocabulary", ["zipf", "words"])
def test_texts_have_the_requested_token_counts(tokenizer: Tokenizer, vocabulary: str) -> None:
    lengths = [3, 8, 16, 24, 64, 128, 256, 512] * 5
    texts = make_texts(tokenizer, lengths, seed=1, vocabulary=vocabulary)
    counts = [len(e.ids) for e in tokenizer.encode_batch(texts)]
    assert counts == lengths
    assert make_texts(tokenizer, lengths, seed=1, vocabulary=vocabulary) == texts  # seeded
    wl = workload_texts(tokenizer, Workload("passages", 64, 256, 50), seed=2, vocabulary=vocabulary)
    counts = [len(e.ids) for e in tokenizer.encode_batch(wl)]
    assert len(wl) == 50 and min(counts) >= 64 and max(counts) <= 256
    assert workload_texts(tokenizer, Workload("passages", 64, 256, 50), seed=3, vocabulary=vocabulary) != wl


def test_zipf_texts_read_like_prose_and_the_word_list_does_not(tokenizer: Tokenizer) -> None:
    # Many distinct chunks, capitals, punctuation and numbers: what a tokenizer's chunk memo
    # meets in real text, unlike a short list of repeated words.
    zipf, words = (" ".join(workload_texts(tokenizer, Workload("passages", 64, 256, 300), seed=4, vocabulary=v))
                   for v in ("zipf", "words"))
    assert len(set(zipf.split())) > 8000 and len(set(words.split())) <= 200
    assert all(any(c in zipf for c in kind) for kind in (",.?!", "0123456789", "ABCDEFGHIJKLMNOPQRSTUVWXYZ"))
    assert words == words.lower() and not any(c in words for c in ",.?!0123456789")
    with pytest.raises(ValueError, match="vocabulary must be one of"):
        make_texts(tokenizer, [8], vocabulary="english")


def test_flops_per_token_counts_projections_mlp_and_attention() -> None:
    bert = ARCHS["bge-base"].config
    per_layer = 2 * 768 * 3 * 768 + 2 * 768 * 768 + 2 * 2 * 768 * 3072 + 4 * 128 * 768
    assert flops_per_token(bert, "bert", 128, causal=False) == 12 * per_layer
    qwen = ARCHS["pplx-0.6b"].config  # GQA: 16 query heads, 8 KV heads of 128; SwiGLU
    proj = 2 * 1024 * (2048 + 2 * 1024) + 2 * 2048 * 1024
    mlp = 3 * 2 * 1024 * 3072
    full = flops_per_token(qwen, "qwen3", 512, causal=False)
    assert full == 28 * (proj + mlp + 4 * 512 * 2048)
    assert flops_per_token(qwen, "qwen3", 512, causal=True) == 28 * (proj + mlp + 2 * 512 * 2048)


def test_timed_passes_time_each_pass_and_reject_a_short_one() -> None:
    stepped = iter([100, 100, 100, 100, 99])
    rates = _timed_passes(lambda: next(stepped), 100)
    assert len(rates) == 3 and all(r > 0 for r in rates)
    with pytest.raises(RuntimeError, match="stepped 99 tokens, expected 100"):
        _timed_passes(lambda: next(stepped), 100)


def test_measurements_run_with_the_loaded_heap_frozen_and_release_it_after() -> None:
    import gc

    kept = [[i] for i in range(1000)]  # tracked containers, as a loaded process holds
    with _settled_heap():
        assert gc.get_freeze_count() >= len(kept)
    assert gc.get_freeze_count() == 0
    assert sustained_matmul_tflops("cpu") is None  # only a GPU has a power limit to find


def test_bench_verb_parses_into_options() -> None:
    parser = argparse.ArgumentParser(prog="fern")
    register(parser.add_subparsers(dest="verb"))
    args = parser.parse_args(["bench", "--suite", "gpu", "--only", "latency", "--only", "capture",
                              "--out", "/tmp/x", "--no-grpc", "--tag", "h200"])
    assert (args.suite, args.only, args.out, args.no_grpc, args.tag) == (
        "gpu", ["latency", "capture"], Path("/tmp/x"), True, "h200")
    assert callable(args.func)
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--suite", "tpu"])
    args = parser.parse_args(["bench", "--latency-models", "minilm", "bge-base", "--latency-lengths", "32"])
    assert (args.latency_models, args.latency_lengths) == (["minilm", "bge-base"], [32])
    assert parser.parse_args(["bench", "--capture-prewarm", "queries"]).capture_prewarm == "queries"


def test_cpu_plan_stays_small() -> None:
    cpu = PLANS["cpu"]
    assert cpu.latency_models == ("minilm",) and cpu.throughput_seconds <= 2
    assert sum(w.count for w in cpu.workloads) <= 400


def test_plots_are_written_for_each_part(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from benchmarks.plots import write_plots

    pct = {"p50_ms": 1.0, "p99_ms": 2.0}
    results = {
        "environment": {"device_name": "test"},
        "parts": {
            "latency": {"m": {"engine": {"16": {"engine": pct}, "128": {"engine": pct}},
                              "e2e": {"128": pct}, "published": {"e2e_p50_ms": 1.5}}},
            "throughput": {"text_tokens": 512, "m": {"engine": {"1": {"embeddings_per_s": 10.0},
                                                                "100": {"embeddings_per_s": 900.0}},
                                                     "e2e": {"texts_per_request": 100, "embeddings_per_s": 800.0}}},
            "compare": {"m": {"workloads": {"q": {"fern_tokens_per_s": 5.0, "fern_engine_tokens_per_s": 6.0,
                                                  "st_best_tokens_per_s": 1.0, "tokenizer_tokens_per_s": 7.0}}}},
            "capture": {"model": "m", "windows_s": [1.0, 1.0], "timeline": [[0.1, 5.0], [1.5, 1.0]]},
        },
    }
    paths = write_plots(results, tmp_path, "t")
    assert [p.name for p in paths] == ["t-latency.png", "t-throughput.png", "t-compare.png", "t-capture.png"]
    assert all(p.stat().st_size > 1000 for p in paths)


def test_provenance_hashes_the_sources_and_tells_when_they_differ_from_the_commit(tmp_path: Path) -> None:
    import subprocess

    from benchmarks.provenance import code_identity, commit_sha256, working_tree_sha256

    def git(*args: str) -> str:
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                              capture_output=True, text=True, check=True).stdout.strip()

    (tmp_path / "core_engine").mkdir()
    (tmp_path / "core_engine" / "a.py").write_text("x = 1\n")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "r.py").write_text("not code\n")  # results are not sources
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "one")
    identity = code_identity(tmp_path)
    assert identity["git_commit"] == git("rev-parse", "HEAD") and identity["sources_match_commit"] is True
    assert identity["source_sha256"] == commit_sha256("HEAD", tmp_path) == working_tree_sha256(tmp_path)
    (tmp_path / "benchmarks" / "results" / "r.py").write_text("changed\n")
    assert code_identity(tmp_path)["sources_match_commit"] is True
    (tmp_path / "core_engine" / "a.py").write_text("x = 2\n")  # the code that runs is not the commit's
    changed = code_identity(tmp_path)
    assert changed["sources_match_commit"] is False and changed["source_sha256"] != identity["source_sha256"]
    (tmp_path / "core_engine" / "a.py").write_text("x = 1\n")
    (tmp_path / "sidecar").mkdir()
    (tmp_path / "sidecar" / "new.py").write_text("")  # an untracked source counts too
    assert code_identity(tmp_path)["sources_match_commit"] is False


def test_capture_with_prewarm_sends_the_same_requests_to_a_prewarmed_server(monkeypatch, tmp_path: Path) -> None:
    import dataclasses
    import types

    import sidecar.client
    from benchmarks import suite

    served_with: list[tuple[str, ...]] = []
    sent: dict[tuple[str, ...], list[list[str]]] = {}

    logs: list[str | None] = []

    def serve(ctx, name, extra=(), log_name=None):
        assert extra[-2] == "--metrics-port"  # where the harness watches for the compiled engine
        extra = tuple(extra[:-2])
        served_with.append(extra)
        logs.append(log_name)
        sent[extra] = []
        log_path = tmp_path / f"sidecar-{log_name or name}.log"
        log_path.write_text("fern: serving\ncompiled all-MiniLM-L6-v2 in 1.0 s\n")
        return types.SimpleNamespace(target=f"t{len(served_with)}", seconds_to_serving=0.5, log_path=log_path,
                                     command=["fern", "serve", *extra], stop=lambda: None)

    class Client:
        def __init__(self, target, timeout):
            self.calls = sent[served_with[-1]]

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def embed(self, texts):
            self.calls.append(list(texts))

    monkeypatch.setattr(suite, "_serve", serve)
    monkeypatch.setattr(suite, "_sidecar_reason", lambda ctx: None)
    monkeypatch.setattr(sidecar.client, "FernClient", Client)
    plan = dataclasses.replace(PLANS["cpu"], capture_windows=(0.02, 0.02))
    ctx = suite.Context(options=suite.BenchOptions(capture_prewarm="queries", capture_compile_in_background=True),
                        plan=plan, device="cpu", models_dir=tmp_path, log_dir=tmp_path)
    result = suite.part_capture(ctx)
    assert served_with == [(), ("--prewarm", "queries"), ("--compile-in-background",)]
    assert len(set(logs)) == 3  # three log files, not one overwritten
    lazy, warm, background = sent[()], sent[("--prewarm", "queries")], sent[("--compile-in-background",)]
    assert lazy and warm and background
    common = min(len(lazy), len(warm), len(background))  # each run sends for as long as its windows last
    assert lazy[:common] == warm[:common] == background[:common]
    assert result["prewarm"]["spec"] == "queries"
    assert result["prewarm"]["server_command"].endswith("--prewarm queries")
    assert result["compile_in_background"]["server_command"].endswith("--compile-in-background")
    assert "first_window" in result and "first_window" in result["prewarm"]
    assert "first_window" in result["compile_in_background"]
    assert result["compile_log"] == ["compiled all-MiniLM-L6-v2 in 1.0 s"]
