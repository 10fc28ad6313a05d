"""Property-based tests (hypothesis): request validation never crashes the gateway, long texts tokenize as if
whole, and a text's vector does not depend on what else is packed into its step (in-process CPU engine)."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sidecar.tokenize as tokenize
from core_engine.loader import default_model_dir
from sidecar.errors import EmbedError
from sidecar.gateway import EmbedParams, Gateway
from sidecar.registry import ModelSource, Registry
from sidecar.scheduler import Lane, SchedulerConfig
from sidecar.tokenize import TextTokenizer

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                       HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def gateway(loop):
    config = SchedulerConfig.for_device("cpu", max_queued_tokens_online=4096, max_queued_tokens_batch=4096)
    registry = Registry.load([ModelSource(None)], device="cpu", scheduler_config=config, tokenizer_workers=2)
    loop.run_until_complete(registry.start())
    yield Gateway(registry, max_inputs=16, chunk_texts=4)
    loop.run_until_complete(registry.drain())
    registry.close()


PIECES = ["word", "Café", "e\u0301", " ", "  ", "\n", "\t", "[CLS]", "[sep]", "!", "...", "東京", "😀",
          "x.y", "##", "a" * 120, "\u200b", "(", "]", "[MASK]", "Straße", "123", "\x00", "[", "mask"]
texts = st.lists(st.sampled_from(PIECES), min_size=1, max_size=300).map("".join)


@FAST
@given(text=texts, how=st.sampled_from(["truncate", "full", "plain"]))
def test_a_long_text_tokenized_in_windows_gets_the_whole_texts_ids(text, how, monkeypatch):
    # Small windows, so that hypothesis' texts cross many cuts (the bundled tokenizer, 16-token limit).
    monkeypatch.setattr(tokenize.core, "LONG_TEXT_CHARS", 8)
    monkeypatch.setattr(tokenize.core, "LONG_WINDOW_CHARS", 5)
    tok = _tokenizer()
    whole = tok.core._ids_of_short([text], how)[0]
    got = tok.core.ids_of([text], how)[0]
    if how == "plain":
        assert got == whole[:tokenize.SPARSE_MAX_TOKENS]
    elif how == "full" and len(whole) > tok.core.room:  # refused: enough of its ids to know it is over
        assert len(got) > tok.core.room and got[:-1] == whole[:len(got) - 1]
    else:
        assert got == whole


_TOKENIZERS: dict[str, TextTokenizer] = {}


def _tokenizer() -> TextTokenizer:
    if "t" not in _TOKENIZERS:
        _TOKENIZERS["t"] = TextTokenizer(default_model_dir() / "tokenizer.json", 16, workers=1,
                                         processes=0, memo_chunks=0)
    return _TOKENIZERS["t"]


anything = st.one_of(st.integers(-2**40, 2**40), st.text(max_size=8), st.none(), st.booleans())
params = st.fixed_dictionaries({
    "texts": st.lists(st.one_of(st.text(max_size=40), st.sampled_from(["", " ", "\u200b", "ok"])), max_size=20),
    "token_ids": st.one_of(st.just(()), st.lists(st.lists(st.integers(-5, 40_000), max_size=6), max_size=4)),
    "model": st.sampled_from(["", "all-MiniLM-L6-v2", "nope"]),
    "lane": st.sampled_from([Lane.ONLINE, Lane.BATCH]),
    "prompt_name": st.sampled_from(["", "query", "passage", "shout"]),
    "normalize": st.sampled_from([None, True, False]),
    "truncate": st.booleans(),
    "dimensions": st.integers(-3, 400),
    "encoding": st.sampled_from(["float32", "float16", "int8", "binary", "float64"]),
    "return_sparse": st.booleans(),
})


@FAST
@given(kwargs=params)
def test_any_request_embeds_or_is_refused_naming_an_input(gateway, loop, kwargs):
    try:
        result = loop.run_until_complete(gateway.embed(EmbedParams(**kwargs)))
    except EmbedError as error:
        assert error.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), error
        assert ":" in error.message or "model" in error.message, error.message
        if error.index is not None:
            assert error.message.startswith((f"texts[{error.index}]", f"token_ids[{error.index}]"))
        return
    count = len(kwargs["texts"]) or len(kwargs["token_ids"])
    assert result.vectors.shape[0] == count and len(result.token_counts) == count


POOL = ["alpha", "a somewhat longer sentence about vector databases and search",
        "東京は日本の首都です。", "word " * 80, "x", "Fern packs sequences without padding."]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.lists(st.sampled_from(range(len(POOL))), min_size=1, max_size=12))
def test_a_texts_vector_does_not_depend_on_its_step_companions(gateway, loop, batch):
    alone = {i: loop.run_until_complete(gateway.embed(EmbedParams(texts=[POOL[i]]))).vectors[0]
             for i in set(batch)}
    packed = loop.run_until_complete(gateway.embed(EmbedParams(texts=[POOL[i] for i in batch], lane=Lane.BATCH)))
    for row, i in zip(packed.vectors, batch):
        np.testing.assert_allclose(row, alone[i], atol=2e-5)
