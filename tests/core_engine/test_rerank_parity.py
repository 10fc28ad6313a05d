"""Cross-encoders (BERT and XLM-R with a sequence-classification head) on Fern's packed engine equal transformers.

Each checkpoint is a real reranker config's structure, shrunk, with seeded random weights,
saved as a directory; the pairs are tokenized by Fern's pair tokenizer and, for the
reference, by transformers' own fast tokenizer (its token_type_ids included).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import PreTrainedTokenizerFast

from benchmarks.models import TINY_RERANKERS, randomize_weights, reranker_model, save_reranker_dir, unigram_tokenizer
from core_engine.config import load_spec
from core_engine.engine import Engine
from sidecar.errors import EmbedError
from sidecar.tokenize.pairs import PairTokenizer

QUERY = "how do vector databases rank documents?"
DOCUMENTS = [
    "A vector database stores embeddings and searches them by distance.",
    "Paris is the capital of France.",
    "Cross-encoders read the query and the document together and score the pair.",
    "ok",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Rerankers reorder the top results of a first-stage search by relevance.",
]
TRAINING_TEXTS = [QUERY, *DOCUMENTS, "the search engine returns documents for a query",
                  "embeddings map text to vectors; databases index them"]


def _reranker_dir(tmp_path: Path, family: str, seed: int, *, template: bool = True):
    torch.manual_seed(seed)
    hf = reranker_model(TINY_RERANKERS[family]).eval()
    randomize_weights(hf, seed)
    tokenizer_from = None
    if family == "xlm-roberta":
        tokenizer_from = tmp_path / "tok"
        unigram_tokenizer(tokenizer_from / "tokenizer.json", TRAINING_TEXTS)
    out = save_reranker_dir(hf, tmp_path / family, tokenizer_from)
    if not template:  # a tokenizer.json whose post-processor says nothing of pairs
        data = json.loads((out / "tokenizer.json").read_text())
        data["post_processor"] = None
        (out / "tokenizer.json").write_text(json.dumps(data))
    return hf, out


def _reference(hf: torch.nn.Module, tokenizer_json: Path, query: str, documents: list[str],
               max_length: int | None = None) -> tuple[np.ndarray, list[list[int]]]:
    """transformers' logits, one unpadded pair at a time, and the ids its tokenizer gave."""
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))
    scores, ids = [], []
    with torch.inference_mode():
        for document in documents:
            enc = tokenizer(query, document, truncation="only_second" if max_length else False,
                            max_length=max_length, return_tensors="pt", return_token_type_ids=True)
            out = hf(input_ids=enc["input_ids"], token_type_ids=enc["token_type_ids"])
            scores.append(out.logits[0, 0].item())
            ids.append(enc["input_ids"][0].tolist())
    return np.asarray(scores, dtype=np.float32), ids


@pytest.mark.parametrize("family", ["bert", "xlm-roberta"])
def test_cross_encoder_scores_match_transformers(tmp_path: Path, family: str) -> None:
    hf, path = _reranker_dir(tmp_path, family, seed=11)
    spec = load_spec(path)
    assert (spec.kind, spec.dimensions, spec.pooling, spec.normalize) == ("reranker", 1, "cls", False)
    assert spec.token_types == (2 if family == "bert" else 1)
    # Bucket padding on: the packed steps are shaped as CUDA graphs would see them.
    engine = Engine(path, device="cpu", pad_to_buckets=True)
    pairs = PairTokenizer.for_spec(spec)
    sequences = pairs.encode(QUERY, DOCUMENTS)
    ref, ref_ids = _reference(hf, path / "tokenizer.json", QUERY, DOCUMENTS)
    # The same tokens, type 1 carried as id + vocab_size.
    plain = [[t % spec.vocab_size for t in s] for s in sequences]
    assert plain == ref_ids
    ours = engine.score(sequences)
    assert ours.shape == (len(DOCUMENTS),)
    assert np.ptp(ref) > 20 * 1e-3 * np.abs(ref).max(), "the random weights should tell the pairs apart"
    np.testing.assert_allclose(ours, ref, rtol=1e-3, atol=1e-3 * np.abs(ref).max())
    # Scored one at a time, each pair gives the same score as packed with the others.
    alone = np.array([engine.score([s])[0] for s in sequences])
    np.testing.assert_allclose(alone, ours, rtol=1e-4, atol=1e-5)


def test_bert_pairs_carry_token_types_and_the_model_uses_them(tmp_path: Path) -> None:
    hf, path = _reranker_dir(tmp_path, "bert", seed=12)
    spec = load_spec(path)
    engine = Engine(path, device="cpu")
    sequence = PairTokenizer.for_spec(spec).encode(QUERY, DOCUMENTS[:1])[0]
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    enc = tokenizer(QUERY, DOCUMENTS[0], return_token_type_ids=True)
    cls, sep = tokenizer.convert_tokens_to_ids(["[CLS]", "[SEP]"])
    query_ids = tokenizer(QUERY, add_special_tokens=False)["input_ids"]
    # [CLS] q [SEP] d [SEP], types 0 for the first part and 1 for the document and its [SEP].
    assert sequence[: len(query_ids) + 2] == [cls, *query_ids, sep]
    assert sequence[-1] == sep + spec.vocab_size
    assert [int(t >= spec.vocab_size) for t in sequence] == enc["token_type_ids"]
    # Every token read as type 0 scores differently: the types are not ignored.
    typed, untyped = engine.score([sequence, [t % spec.vocab_size for t in sequence]])
    assert abs(typed - untyped) > 1e-3


def test_xlm_roberta_pairs_use_double_separator_and_a_missing_template_is_built(tmp_path: Path) -> None:
    _, path = _reranker_dir(tmp_path, "xlm-roberta", seed=13, template=False)
    spec = load_spec(path)
    sequence = PairTokenizer.for_spec(spec).encode(QUERY, ["a query about dogs"])[0]
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    q = tokenizer(QUERY, add_special_tokens=False)["input_ids"]
    d = tokenizer("a query about dogs", add_special_tokens=False)["input_ids"]
    assert sequence == [0, *q, 2, 2, *d, 2]  # <s> q </s></s> d </s>, all type 0


@pytest.mark.parametrize("family", ["bert", "xlm-roberta"])
def test_only_the_document_is_truncated(tmp_path: Path, family: str) -> None:
    hf, path = _reranker_dir(tmp_path, family, seed=14)
    spec = load_spec(path)
    engine = Engine(path, device="cpu")
    pairs = PairTokenizer.for_spec(spec)
    long_document = "relevance ranking of documents for a query " * 60
    sequence = pairs.encode(QUERY, [long_document])[0]
    assert len(sequence) == spec.max_tokens
    ref, ref_ids = _reference(hf, path / "tokenizer.json", QUERY, [long_document], max_length=spec.max_tokens)
    assert [t % spec.vocab_size for t in sequence] == ref_ids[0]
    np.testing.assert_allclose(engine.score([sequence]), ref, rtol=1e-3, atol=1e-4)

    with pytest.raises(EmbedError, match=r"documents\[1\]: \d+ tokens with the query exceeds the model's limit"):
        pairs.encode(QUERY, ["short", long_document], truncate=False)
    with pytest.raises(EmbedError, match="query: .* leaves no room for a document"):
        pairs.encode(long_document, ["short"])


def test_an_embedding_engine_does_not_score(tmp_path: Path) -> None:
    engine = Engine(device="cpu")  # the bundled MiniLM: an embedding model
    assert engine.spec.kind == "embedding"
    with pytest.raises(ValueError, match="only a reranker scores pairs"):
        engine.score([[101, 102]])


def test_a_classifier_with_several_labels_is_refused(tmp_path: Path) -> None:
    _, path = _reranker_dir(tmp_path, "bert", seed=15)
    config = json.loads((path / "config.json").read_text())
    config["id2label"] = {"0": "NEGATIVE", "1": "POSITIVE"}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="2 labels is not a reranker"):
        load_spec(path)
