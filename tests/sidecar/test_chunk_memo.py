"""The chunk memo on its own: hits need no tokenizer, misses learn their chunks, a full memo is emptied."""

from __future__ import annotations

import pytest

from core_engine.loader import default_model_dir
from sidecar.tokenize import AsciiTwin, ChunkMemo, TextTokenizer
from sidecar.tokenize.rust import load


@pytest.fixture(scope="module")
def reference():
    return load(default_model_dir() / "tokenizer.json")


def _memo(reference, entries: int) -> ChunkMemo:
    memo = ChunkMemo.of(AsciiTwin.of(reference, rust_threads=1), entries=entries)
    assert memo is not None and len(memo) == 0
    return memo


def test_a_miss_learns_its_chunks_and_a_hit_needs_no_tokenizer(reference, monkeypatch):
    memo = _memo(reference, entries=100)
    text = "Hello, World! hello again"
    expected = [reference.encode(text).ids]
    assert memo.encode([text], True, None) == expected  # a miss, through WordPiece
    assert set(memo._memo) == {"hello,", "world!", "hello", "again"}  # whitespace-separated, lowercased
    monkeypatch.setattr(memo, "_wordpiece", None)
    monkeypatch.setattr(memo, "_tokenizer", None)  # any miss would now fail
    assert memo.encode([text], True, None) == expected
    plain = reference.encode("world! hello,", add_special_tokens=False).ids
    assert memo.encode(["WORLD! Hello,"], False, None) == [plain]
    with pytest.raises(AttributeError):
        memo.encode(["unseen"], True, None)


def test_a_memo_at_capacity_is_emptied_before_it_grows(reference):
    memo = _memo(reference, entries=3)
    memo.encode(["alpha beta gamma"], True, None)
    assert len(memo) == 3
    assert memo.encode(["delta"], True, None) == [reference.encode("delta").ids]
    assert set(memo._memo) == {"delta"}  # emptied, then refilled with the miss
    memo.encode(["alpha beta"], True, None)
    assert set(memo._memo) == {"delta", "alpha", "beta"}
    memo.clear()
    assert len(memo) == 0


def test_the_tokenizer_passes_its_memo_size_and_rust_threads_down():
    path = default_model_dir() / "tokenizer.json"
    tok = TextTokenizer(path, 32, workers=1, processes=0, memo_chunks=2, rust_threads=3)
    off = TextTokenizer(path, 32, workers=1, processes=0, memo_chunks=0)
    try:
        assert tok.core.full_twin.rust_threads == tok.core.truncating_twin.rust_threads == 3
        assert tok.encode(["one two three"]) == off.encode(["one two three"])
        assert len(tok.core.memo) <= 2 and off.core.memo is None
    finally:
        tok.close()
        off.close()
