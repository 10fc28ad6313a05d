"""The gateway's tokenizer: the model's real limit, no padding, the reference's ids, errors naming inputs."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from transformers import AutoTokenizer

from core_engine.config import load_spec
from core_engine.loader import default_model_dir
from sidecar.errors import EmbedError
from sidecar.tokenize import SLICE_TEXTS, TextTokenizer


@pytest.fixture(scope="module")
def spec():
    return load_spec(default_model_dir())


@pytest.fixture(scope="module")
def tok(spec):
    t = TextTokenizer.for_spec(spec, workers=2)
    yield t
    t.close()


def test_shipped_tokenizer_json_truncates_at_128_but_fern_uses_256(spec, tok):
    shipped = json.loads(spec.tokenizer_path.read_text())
    assert shipped["truncation"]["max_length"] == 128 and shipped["padding"] is not None
    assert spec.max_tokens == 256
    ids = tok.encode(["word " * 1000])[0]
    assert len(ids) == 256
    assert ids[0] == 101 and ids[-1] == 102  # [CLS] ... [SEP] survive truncation


def test_no_padding(tok):
    short, longer = tok.encode(["hi", "a somewhat longer sentence here"])
    assert short == [101, 7632, 102]
    assert len(longer) > len(short) and 0 not in longer


def test_ids_equal_the_reference_tokenizer_with_sentence_transformers_settings(spec, tok, texts):
    ref = AutoTokenizer.from_pretrained(str(spec.path))
    expected = ref(texts, truncation=True, max_length=spec.max_tokens)["input_ids"]
    assert asyncio.run(tok.encode_async(texts)) == expected


def test_async_slices_keep_input_order(tok):
    texts = [f"text number {i}" for i in range(SLICE_TEXTS * 3 + 7)]
    assert asyncio.run(tok.encode_async(texts)) == tok.encode(texts)


def test_over_length_with_truncation_off_names_the_first_offending_input(tok):
    texts = ["short"] * (SLICE_TEXTS + 5) + ["word " * 300] + ["x"] + ["word " * 500]
    with pytest.raises(EmbedError) as info:
        asyncio.run(tok.encode_async(texts, truncate=False))
    err = info.value
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.index == SLICE_TEXTS + 5
    assert err.message.startswith(f"texts[{SLICE_TEXTS + 5}]: 302 tokens")
    assert "limit of 256" in err.message


def test_exactly_at_the_limit_is_accepted_with_truncation_off(tok):
    ids = tok.encode(["word " * 254], truncate=False)[0]
    assert len(ids) == 256


def test_eos_is_appended_after_truncating_one_token_earlier(spec):
    t = TextTokenizer(spec.tokenizer_path, 10, eos_id=102, workers=1)
    try:
        long_ids = t.encode(["word " * 50])[0]
        assert len(long_ids) == 10 and long_ids[-1] == 102 and long_ids[-2] == 102
        with pytest.raises(EmbedError, match=r"texts\[0\]: 12 tokens exceeds the model's limit of 10"):
            t.encode(["word " * 9], truncate=False)
        assert len(t.encode(["word " * 7], truncate=False)[0]) == 10
    finally:
        t.close()


def test_plain_ids_have_no_special_tokens_and_no_truncation(tok):
    ids = tok.encode_plain(["word " * 400])[0]
    assert len(ids) == 400 and not set(ids) & tok.special_ids


def test_truncate_ids_keeps_a_trailing_special_token(tok):
    ids = [101] + [2773] * 300 + [102]
    cut = tok.truncate_ids(ids)
    assert len(cut) == 256 and cut[0] == 101 and cut[-1] == 102
    plain = [2773] * 300
    assert tok.truncate_ids(plain) == [2773] * 256


def test_query_sized_requests_give_the_same_ids_and_errors_inline(spec, tok):
    small = ["a short query", "another one"]
    assert asyncio.run(tok.encode_async(small)) == tok.encode(small)
    assert asyncio.run(tok.encode_plain_async(small)) == tok.encode_plain(small)
    tiny = TextTokenizer(spec.tokenizer_path, 8, workers=1)
    try:
        with pytest.raises(EmbedError, match=r"^texts\[1\]: 12 tokens exceeds the model's limit of 8"):
            asyncio.run(tiny.encode_async(["ok", "word " * 10], truncate=False))
    finally:
        tiny.close()


def test_printable_ascii_fast_path_gives_the_full_normalizers_ids(spec, tok):
    # MiniLM's BertNormalizer has a lowercase-only twin for printable-ASCII batches; it must
    # give exactly the ids of the shipped normalizer (clean-up, CJK, NFD accent stripping).
    import random
    import string

    from tokenizers import Tokenizer

    assert tok._truncating_ascii is not None  # the fast path exists for this model
    reference = Tokenizer.from_file(str(spec.tokenizer_path))
    reference.no_padding()
    reference.no_truncation()
    rng = random.Random(7)
    printable = string.printable[:95]  # 0x20-0x7E, upper case, digits and punctuation included
    texts = ["".join(rng.choice(printable) for _ in range(rng.randint(1, 1500))) for _ in range(400)]
    full = [e.ids for e in reference.encode_batch(texts)]
    assert tok.encode_plain(texts) == [e.ids for e in reference.encode_batch(texts, add_special_tokens=False)]
    assert tok.encode(texts) == [ids if len(ids) <= spec.max_tokens else ids[:spec.max_tokens - 1] + [ids[-1]]
                                 for ids in full]
    assert any(len(ids) > spec.max_tokens for ids in full)  # truncation was exercised too
    # Text the twin must not see (accents, CJK, control characters, tabs) still matches.
    others = ["Café ÉLAN", "中文 text", "bell\x07here", "tab\tand\nnewline", "ＦＵＬＬ width"]
    for text in others:
        assert tok.encode([text, "plain ascii"]) == [reference.encode(text).ids,
                                                     reference.encode("plain ascii").ids]
        assert tok.encode([text]) == [reference.encode(text).ids]
