"""The gateway's tokenizer: the model's real limit, no padding, the reference's ids, errors naming inputs."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import numpy as np
import pytest
from transformers import AutoTokenizer

from core_engine.config import load_spec
from core_engine.loader import default_model_dir
from sidecar.errors import EmbedError
from sidecar.tokenize import CUT_CHARS_PER_TOKEN, SLICE_TEXTS, TextTokenizer


@pytest.fixture(scope="module")
def spec():
    return load_spec(default_model_dir())


@pytest.fixture(scope="module")
def tok(spec):
    t = TextTokenizer.for_spec(spec, workers=2, processes=0)  # the threads, on any host
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


def _differential_texts(seed: int) -> list[str]:
    """Texts of every kind the ASCII twin must route or tokenize exactly like the shipped pipeline."""
    import random
    import string

    rng = random.Random(seed)
    printable = string.printable[:95]  # 0x20-0x7E: upper case, digits and punctuation included
    fixed = [
        "", " ", "   \t\n  ", "\n", "Hello, World!", "HELLO world", "it's a dog's-life... (really?)",
        "e-mail: a.b@c.com; url https://x.y/z?q=1&r=2#frag", "3.14159 + 2,718 = 5.859 100% $5 #1",
        "snake_case_name camelCaseName kebab-case-name", "[CLS] typed by a user [SEP]", "[cls] [Sep] [MASK]ed",
        "a[UNK]b [PAD]", "[not a token]", "unaffable untranslatable antidisestablishmentarianism",
        "x" * 99, "y" * 100, "z" * 101, "ab" * 80 + " end", "qzxjvk wqpflm",
        "line one\nline two\r\nline three\ttabbed", "bell\x07here", "nul\x00byte", "del\x7fchar",
        "vt\x0bff\x0cfs\x1c", "esc\x1b[0m", "Café ÉLAN naïve façade", "中文 text 日本語 한국어",
        "ＦＵＬＬ width", "emoji 🙂 here", "\u00a0nbsp\u2003em space\u200bzero-width",
        "Ångström ß ﬁ ligature", "mixed ascii and é", "Ελληνικά русский עברית العربية",
        "\ufffdreplacement", "—dashes– “quotes” ‘single’ …", "tab\tand\nnewline",
    ]
    # Longer than the twin's cut: [UNK]-sized words (few tokens, so the head falls short),
    # no space to cut at, one at the cut's edge, a limit filled by digits and punctuation.
    longer = [("q" * 150 + " ") * 20, "w" * 3000, "word " * 306 + "antidisestablishmentarianism " * 9,
              "1,2;3.4!" * 300, "short\n" * 400, "a " * 300, "x" * 1535 + " tail words"]
    pieces = fixed + ["word", "Word", "WORD", ",", ".", "!", "?", "-", "'", "[", "]", "(", ")", "42",
                      "transformers", "tokenization", "é", "中", "\t", "\n", "\x07", "[SEP]", "  "]
    made = ["".join(rng.choice(printable) for _ in range(rng.randint(1, 1500))) for _ in range(150)]
    made += [" ".join(rng.choice(pieces) for _ in range(rng.randint(1, 400))) for _ in range(150)]
    made += ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 200))) for _ in range(100)]
    return fixed + longer + made


def _cut(ids: list[int], limit: int) -> list[int]:
    return ids if len(ids) <= limit else ids[:limit - 1] + [ids[-1]]


@pytest.mark.parametrize("rust_threads", [1, 10**6], ids=["joined", "one-by-one"])
def test_ids_equal_the_shipped_pipeline_on_every_kind_of_text(spec, tok, rust_threads, monkeypatch):
    # The ASCII twin (lowercasing in Python, a regex pre-tokenizer, no normalizer, texts joined
    # 16 to an input unless a batch is too small to keep Rust's threads busy) must give exactly
    # the shipped tokenizer.json's ids: truncated or not, with or without special tokens, in
    # pure-ASCII batches, mixed batches and one text at a time.
    from tokenizers import Tokenizer

    for twin in (tok.core.full_twin, tok.core.truncating_twin):
        monkeypatch.setattr(twin, "rust_threads", rust_threads)

    assert tok.core.truncating_twin is not None and tok.core.full_twin is not None  # the twin exists here
    reference = Tokenizer.from_file(str(spec.tokenizer_path))
    reference.no_padding()
    reference.no_truncation()
    # The twin's cut falls inside a long word whose first piece is the last token kept.
    edge = "hello " * (spec.max_tokens - 3) + "antidisestablishmentarianism" + " more" * 50
    assert len(edge) - 250 - 28 < spec.max_tokens * CUT_CHARS_PER_TOKEN < len(edge) - 250
    texts = _differential_texts(7) + [edge]
    full = [e.ids for e in reference.encode_batch(texts)]
    plain = [e.ids for e in reference.encode_batch(texts, add_special_tokens=False)]
    assert any(len(ids) > spec.max_tokens for ids in full)  # truncation is exercised
    assert any(100 in ids for ids in plain)  # [UNK] is exercised
    cut_at = spec.max_tokens * CUT_CHARS_PER_TOKEN
    over = [(len(t), len(ids)) for t, ids in zip(texts, plain) if len(t) > cut_at and " " in t]
    assert any(n < spec.max_tokens for _, n in over) and any(n > spec.max_tokens for _, n in over)
    ascii_only = [i for i, t in enumerate(texts) if tok.core.full_twin.fits(t)]
    assert 0 < len(ascii_only) < len(texts)  # both paths are exercised
    assert tok.encode(texts) == [_cut(ids, spec.max_tokens) for ids in full]
    assert tok.encode_plain(texts) == plain
    assert tok.encode([texts[i] for i in ascii_only]) == [_cut(full[i], spec.max_tokens) for i in ascii_only]
    assert tok.encode_plain([texts[i] for i in ascii_only]) == [plain[i] for i in ascii_only]
    assert asyncio.run(tok.encode_async(texts)) == [_cut(ids, spec.max_tokens) for ids in full]
    for text, ids in zip(texts, full):
        assert tok.encode([text]) == [_cut(ids, spec.max_tokens)], repr(text)
    at_limit = [i for i, ids in enumerate(full) if len(ids) <= spec.max_tokens]
    assert tok.encode([texts[i] for i in at_limit], truncate=False) == [full[i] for i in at_limit]


def test_the_twin_takes_ascii_and_leaves_what_the_normalizer_changes(tok):
    twin = tok.core.full_twin
    for text in ["Hello, World!", "two\nlines\tand a tab\r\n", "", "   ", "[CL S]", "x" * 5000]:
        assert twin.fits(text), repr(text)
    for text in ["Café", "中文", "bell\x07", "nul\x00", "del\x7f", "vt\x0b", "\u00a0", "a [SEP] b", "[cls]"]:
        assert not twin.fits(text), repr(text)


def test_tokenizers_without_a_bert_pipeline_get_no_twin_and_their_own_ids(spec, tmp_path):
    from tokenizers import Tokenizer

    shipped = json.loads(spec.tokenizer_path.read_text())
    for part, value in (("normalizer", {"type": "Lowercase"}), ("pre_tokenizer", {"type": "Whitespace"}),
                        ("normalizer", {**shipped["normalizer"], "lowercase": False})):
        path = tmp_path / f"{part}.json"
        path.write_text(json.dumps({**shipped, part: value}))
        reference = Tokenizer.from_file(str(path))
        reference.no_padding()
        t = TextTokenizer(path, 256, workers=1)
        try:
            assert t.core.full_twin is None and t.core.truncating_twin is None
            text = "Hello, World... CAFÉ"
            assert t.encode([text]) == [reference.encode(text).ids]
        finally:
            t.close()


def test_other_post_processors_keep_the_twin_without_joining_texts(spec, tok, tmp_path):
    # The twin joins texts only around a "[CLS] $A [SEP]" template; BertProcessing (older
    # tokenizer.json files) gets the twin one text at a time, with the same ids.
    from tokenizers import Tokenizer

    shipped = json.loads(spec.tokenizer_path.read_text())
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({**shipped, "post_processor": {
        "type": "BertProcessing", "sep": ["[SEP]", 102], "cls": ["[CLS]", 101]}}))
    reference = Tokenizer.from_file(str(path))
    reference.no_padding()
    reference.enable_truncation(256)
    t = TextTokenizer(path, 256, workers=1)
    try:
        assert t.core.full_twin is not None and t.core.full_twin.joint is None
        assert tok.core.full_twin.joint is not None  # the shipped template is joined
        texts = ["Hello, World!", "", "word " * 300, "two  spaces\tand tab"]
        assert t.encode(texts) == [e.ids for e in reference.encode_batch(texts)]
    finally:
        t.close()



def _rust_only(*args, **kwargs):
    raise AssertionError("a query-sized ASCII request reached Rust")


# What the chunk memo must split, look up and cut exactly like the shipped pipeline: around and
# over WordPiece's 100-character word limit ([UNK]), punctuation runs, digits, blanks only,
# the model's token limit, and chunks that repeat within a text.
_MEMO_TEXTS = [
    "", " ", "\t\n\r  \n", "Hello, World!", "x" * 99, "y" * 100, "z" * 101, "a" * 100 + "!" + "b" * 101,
    "!!!???...,,, ((())) [[]] {{}} <<>> --- ___ ~~~ ``` '' \"\" @@ ## $$ %% ^^ && ** ++ == || \\\\ // ;; ::",
    "a...b c--d e__f (g) [h] {i} 'j' \"k\" l/m n\\o p|q r@s t#u", "3.14159 1234567890 000123 1e10 0x1F 2,718 10%",
    "qwzx vbnmk zzzzqqq xylophonist's unaffable-ness", "the the the, the. the! (the) the",
    "word " * 254, "word " * 255, "word " * 300 + "tail", "1,2;3.4!" * 60, "a " * 600,
    "Tabs\tand\nnew lines\r\nand  double  spaces", "UPPER lower MiXeD", "[not a token] [un k] ### ##ing",
]


@pytest.fixture
def memo_tok(spec):
    t = TextTokenizer.for_spec(spec, workers=1)
    yield t
    t.close()


def test_query_sized_requests_take_the_chunk_memo_and_get_the_shipped_ids(spec, memo_tok, monkeypatch):
    # With the twin's Rust calls made to fail, every query-sized ASCII request must come out of
    # the memo (its misses tokenized by the memo's own call) with the shipped tokenizer.json's
    # ids, truncated or not, with or without special tokens, on a first call and on memo hits.
    from tokenizers import Tokenizer

    import sidecar.tokenize

    reference = Tokenizer.from_file(str(spec.tokenizer_path))
    reference.no_padding()
    reference.no_truncation()
    small = [t for t in _differential_texts(7) + _MEMO_TEXTS
             if len(t) <= sidecar.tokenize.INLINE_CHARS and memo_tok.core.full_twin.fits(t)]
    assert len(small) > 100
    monkeypatch.setattr(sidecar.tokenize.AsciiTwin, "encode", _rust_only)
    full = [e.ids for e in reference.encode_batch(small)]
    plain = [e.ids for e in reference.encode_batch(small, add_special_tokens=False)]
    assert 100 in sum(plain, []) and any(len(ids) > spec.max_tokens for ids in full)  # [UNK], truncation
    for _ in range(2):  # the second pass is all memo hits
        for text, ids, bare in zip(small, full, plain):
            assert memo_tok.encode([text]) == [_cut(ids, spec.max_tokens)], repr(text)
            assert memo_tok.encode_plain([text]) == [bare], repr(text)
            if len(ids) <= spec.max_tokens:
                assert memo_tok.encode([text], truncate=False) == [ids], repr(text)
        assert memo_tok.core.memo._memo
    # Up to INLINE_TEXTS texts a request, ASCII or not: each gets its own ids, in order.
    mixed = ["Café au lait", "plain words", "", "中文 and ascii"]
    assert memo_tok.encode(mixed) == [_cut(e.ids, spec.max_tokens) for e in reference.encode_batch(mixed)]


def test_a_query_needs_no_rust_call_and_a_warm_one_no_wordpiece(spec, memo_tok, monkeypatch):
    from tokenizers import Tokenizer

    import sidecar.tokenize

    reference = Tokenizer.from_file(str(spec.tokenizer_path))
    reference.no_padding()
    text = "Which vector database fits a small team, and why?"
    memo_tok.encode([text])
    monkeypatch.setattr(sidecar.tokenize.AsciiTwin, "encode", _rust_only)
    monkeypatch.setattr(memo_tok.core.memo, "_tokenizer", None)  # any Rust call would now fail
    unseen = "Qwertyuiop zxcvbnm, 31415 (unaffable)!"
    assert memo_tok.encode([unseen]) == [reference.encode(unseen).ids]  # its chunks through WordPiece
    monkeypatch.setattr(memo_tok.core.memo, "_wordpiece", None)  # now any miss would fail
    for seen in (text, "WHICH team, and why?\n", "fits fits a database", unseen):
        assert memo_tok.encode([seen]) == [reference.encode(seen).ids]
    with pytest.raises(AttributeError):
        memo_tok.encode(["an unheard-of word"])


def test_wordpiece_in_python_gives_the_rust_ids_of_every_chunk(memo_tok):
    # Chunks of every shape the memo can meet: vocabulary words and pieces glued together,
    # random letters and digits (pieces down to single characters), punctuation runs, words
    # at, under and over the 100-character limit, and words with a piece no vocabulary holds.
    import random
    import string

    rng = random.Random(3)
    wordpiece, rust = memo_tok.core.memo._wordpiece, memo_tok.core.memo._tokenizer
    vocab = list(wordpiece.vocab)
    chunks = ["x" * 99, "y" * 100, "z" * 101, "a" * 100 + "!" + "b" * 101, "!!!", "3.14", "e-mail:",
              "don't", "[unk]", "##ing", "#", "~`^", "\\"]
    for _ in range(4000):
        kind = rng.random()
        if kind < 0.4:
            chunk = "".join(rng.choice(vocab).replace("##", "") for _ in range(rng.randint(1, 4)))
        elif kind < 0.7:
            chunk = "".join(rng.choice(string.ascii_lowercase + string.digits) for _ in range(rng.randint(1, 30)))
        else:
            chunk = "".join(rng.choice(string.printable[:94]) for _ in range(rng.randint(1, 40)))
        chunk = "".join(chunk.lower().split())
        if chunk and memo_tok.core.full_twin.fits(chunk):
            chunks.append(chunk)
    assert len(chunks) > 3000
    for chunk in chunks:
        assert wordpiece.ids(chunk) == tuple(rust.encode(chunk, add_special_tokens=False).ids), chunk


def test_bulk_requests_stay_on_rust(memo_tok):
    from sidecar.tokenize import INLINE_CHARS, INLINE_TEXTS

    memo_tok.encode([f"text {i}" for i in range(INLINE_TEXTS + 1)])
    memo_tok.encode(["word " * (INLINE_CHARS // 5 + 1)])
    assert not memo_tok.core.memo._memo


def test_over_length_with_truncation_off_raises_as_without_the_memo(spec, memo_tok):
    without = TextTokenizer(spec.tokenizer_path, spec.max_tokens, workers=1, memo_chunks=0)
    try:
        assert without.core.memo is None
        for texts in (["word " * 255], ["ok", "1,2;3.4!" * 60], ["a", "b", "c", "d " * 300]):
            errors = []
            for t in (memo_tok, without):
                with pytest.raises(EmbedError) as info:
                    asyncio.run(t.encode_async(texts, truncate=False, field="queries", offset=3))
                errors.append((info.value.code, info.value.index, info.value.message))
            assert errors[0] == errors[1]
            assert errors[0][2].startswith(f"queries[{3 + len(texts) - 1}]: ")
        assert memo_tok.core.memo._memo  # the memo tokenized them
    finally:
        without.close()


@pytest.mark.parametrize("max_tokens,eos", [(3, None), (4, None), (10, None), (4, 102), (5, 102), (10, 102)])
def test_the_memo_cuts_at_every_limit_like_rust(spec, max_tokens, eos):
    # The smallest limits, with and without an appended EOS: the memo's cut matches the Rust
    # twin's (limits with no room for text are refused, tested below).
    texts = ["", "hi", "hello world", "word " * 8, "word " * 9, "word " * 20, "a, b. c! " * 4]
    with_memo = TextTokenizer(spec.tokenizer_path, max_tokens, eos_id=eos, workers=1)
    without = TextTokenizer(spec.tokenizer_path, max_tokens, eos_id=eos, workers=1, memo_chunks=0)
    try:
        for text in texts:
            assert with_memo.encode([text]) == without.encode([text]), repr(text)
            assert with_memo.encode_plain([text]) == without.encode_plain([text]), repr(text)
        assert with_memo.core.memo._memo
    finally:
        with_memo.close()
        without.close()


def test_a_full_memo_is_emptied_and_the_ids_stay_right(spec, monkeypatch):
    from tokenizers import Tokenizer

    from sidecar.tokenize import ChunkMemo

    reference = Tokenizer.from_file(str(spec.tokenizer_path))
    reference.no_padding()
    t = TextTokenizer(spec.tokenizer_path, spec.max_tokens, workers=1, memo_chunks=8)
    try:
        texts = [" ".join(f"w{i}x{j}," for j in range(i % 11)) for i in range(60)] + ["one two three"] * 3
        sizes = []
        for text in texts:
            assert t.encode([text]) == [reference.encode(text).ids], repr(text)
            sizes.append(len(t.core.memo._memo))
        assert max(sizes) == 8 and 0 < min(sizes[1:]) and sizes != sorted(sizes)  # filled, emptied, refilled
        assert t.core.memo._memo.keys() >= {"one", "two", "three"}
        # Only chunks up to `chars` characters are kept; a longer one is tokenized on every call.
        t.core.memo = ChunkMemo.of(t.core.full_twin, entries=8, chars=4)
        assert t.encode(["short muchlonger"]) == [reference.encode("short muchlonger").ids]
        assert set(t.core.memo._memo) == set()  # "short" is 5 characters
        t.core.memo = ChunkMemo.of(t.core.full_twin, entries=8, chars=200)
        long_word = "q" * 101 + " " + "r" * 100
        assert t.encode([long_word]) == t.encode([long_word]) == [reference.encode(long_word).ids]
        assert t.core.memo._memo["q" * 101] == (100,)  # [UNK], as WordPiece gives a word over 100 characters
    finally:
        t.close()


def test_tokenizers_whose_template_is_not_fixed_tokens_around_the_text_get_no_memo(spec, tmp_path):
    from tokenizers import Tokenizer

    from sidecar.tokenize import AsciiTwin, ChunkMemo

    shipped = json.loads(spec.tokenizer_path.read_text())
    spaced = {**shipped, "added_tokens": [*shipped["added_tokens"], {
        "id": 30522, "content": "new line", "single_word": False, "lstrip": False, "rstrip": False,
        "normalized": False, "special": True}]}
    doubled = {**shipped, "post_processor": {**shipped["post_processor"], "single": [
        *shipped["post_processor"]["single"], {"Sequence": {"id": "A", "type_id": 0}}]}}
    for config in (spaced, doubled, shipped):  # the shipped file pads to 128 (TextTokenizer does not)
        twin = AsciiTwin.of(Tokenizer.from_str(json.dumps(config)), rust_threads=1)
        assert twin is not None and ChunkMemo.of(twin) is None
    unpadded = Tokenizer.from_file(str(spec.tokenizer_path))
    unpadded.no_padding()
    assert ChunkMemo.of(AsciiTwin.of(unpadded, rust_threads=1)) is not None


@pytest.mark.parametrize("wordpiece", [True, False], ids=["wordpiece", "other-model"])
def test_a_mostly_new_text_is_tokenized_whole_and_teaches_the_memo_a_few_chunks_a_call(spec, memo_tok,
                                                                                        monkeypatch, wordpiece):
    # The same for a WordPiece model (whose few chunks go through Python) and another model.
    from tokenizers import Tokenizer

    import sidecar.tokenize
    from sidecar.tokenize import MEMO_LEARN_CHUNKS

    if not wordpiece:
        monkeypatch.setattr(memo_tok.core.memo, "_wordpiece", None)
    reference = Tokenizer.from_file(str(spec.tokenizer_path))
    reference.no_padding()
    reference.enable_truncation(spec.max_tokens)
    text = " ".join(f"Chunk{i}, (x{i % 7})" for i in range(60))  # 120 chunks, 67 distinct
    expected = [reference.encode(text).ids]
    sizes = []
    for _ in range(6):
        assert memo_tok.encode([text]) == expected
        sizes.append(len(memo_tok.core.memo._memo))
    # 16 a call while most are new, then the rest at once.
    assert sizes[:3] == [MEMO_LEARN_CHUNKS, 2 * MEMO_LEARN_CHUNKS, 3 * MEMO_LEARN_CHUNKS] and sizes[3] == 67
    monkeypatch.setattr(memo_tok.core.memo, "_tokenizer", None)  # now all of it comes from the memo
    monkeypatch.setattr(memo_tok.core.memo, "_wordpiece", None)
    monkeypatch.setattr(sidecar.tokenize.AsciiTwin, "encode", _rust_only)
    assert memo_tok.encode([text]) == expected


def test_a_limit_with_no_room_for_text_beside_the_special_tokens_is_refused():
    from core_engine.loader import default_model_dir

    path = default_model_dir() / "tokenizer.json"
    with pytest.raises(ValueError, match="max_tokens 3 leaves no room for text beside the 3 special tokens"):
        TextTokenizer(path, 3, eos_id=102)  # [CLS] [SEP] + EOS
    with pytest.raises(ValueError, match="max_tokens 2 leaves no room"):
        TextTokenizer(path, 2)  # [CLS] [SEP]
    tok = TextTokenizer(path, 4, eos_id=102)
    assert all(len(ids) <= 4 for ids in tok.encode(["hello world", "a b c d e f"]))


@pytest.fixture(scope="module")
def proc_tok(spec):
    t = TextTokenizer.for_spec(spec, workers=2, processes=2)
    yield t
    t.close()


def _values(seqs) -> list[list[int]]:
    """Token ids as int lists, whether they came as lists (threads) or int32 arrays (worker processes)."""
    return [list(map(int, ids)) for ids in seqs]


def _int32_arrays(seqs) -> bool:
    return all(isinstance(ids, np.ndarray) and ids.dtype == np.int32 for ids in seqs)


def _bulk(texts: list[str]) -> list[str]:
    """`texts` repeated until a request of them goes to the worker processes."""
    from sidecar.tokenize import PROCESS_CHARS

    out = list(texts)
    while sum(map(len, out)) < PROCESS_CHARS or len(out) < 2 * SLICE_TEXTS + 1:
        out += texts
    return out


def test_worker_processes_give_the_threads_ids(spec, tok, proc_tok):
    # The same ids as the threads give, truncated, whole and plain, over several slices of
    # ASCII, non-ASCII and over-long texts; and the processes did the work.
    texts = _bulk(_differential_texts(3))
    assert proc_tok._processes._started_with == (proc_tok._model,)  # loaded as the workers start
    served = proc_tok.process_slices
    seqs = asyncio.run(proc_tok.encode_async(texts))
    assert _values(seqs) == asyncio.run(tok.encode_async(texts))
    assert proc_tok.process_slices > served
    assert _int32_arrays(seqs)  # the model's ids stay int32, not Python ints
    plain = asyncio.run(proc_tok.encode_plain_async(texts))
    assert plain == tok.encode_plain(texts) and all(type(ids) is list for ids in plain)  # sparse ids: ints
    fitting = [t for t, ids in zip(texts, tok.encode(texts))
               if len(ids) < spec.max_tokens]
    whole = asyncio.run(proc_tok.encode_async(fitting, truncate=False))
    assert _values(whole) == tok.encode(fitting, truncate=False) and _int32_arrays(whole)


def test_a_query_sized_request_stays_off_the_worker_processes(proc_tok):
    served = proc_tok.process_slices
    few = ["a short query"] * 20
    assert asyncio.run(proc_tok.encode_async(few)) == proc_tok.encode(few)
    assert proc_tok.process_slices == served


def test_worker_processes_name_the_first_over_length_input_and_append_eos(spec):
    t = TextTokenizer(spec.tokenizer_path, 10, eos_id=102, workers=1, processes=1)
    threads = TextTokenizer(spec.tokenizer_path, 10, eos_id=102, workers=1, processes=0)
    try:
        texts = _bulk(["word " * 7, "a b c"])
        bad = len(texts) - 3
        texts[bad] = "word " * 9
        texts[-1] = "word " * 50
        with pytest.raises(EmbedError) as info:
            asyncio.run(t.encode_async(texts, truncate=False))
        assert info.value.index == bad
        assert info.value.message.startswith(f"texts[{bad}]: 12 tokens exceeds the model's limit of 10")
        seqs = asyncio.run(t.encode_async(texts))
        assert _values(seqs) == asyncio.run(threads.encode_async(texts)) and _int32_arrays(seqs)
        assert _values(seqs)[-1][-2:] == [102, 102] and len(seqs[-1]) == 10
        fitting = _bulk(["word " * 7, "a b c"])  # 9 tokens and EOS: exactly at the limit
        served = t.process_slices
        whole = asyncio.run(t.encode_async(fitting, truncate=False))
        assert _values(whole) == asyncio.run(threads.encode_async(fitting, truncate=False))
        assert t.process_slices > served and {int(ids[-1]) for ids in whole} == {102}
        assert max(map(len, whole)) == 10
    finally:
        t.close()
        threads.close()


def test_a_killed_worker_process_loses_no_text_and_is_replaced(tok, proc_tok, caplog):
    import os
    import signal

    texts = _bulk(["some words here and there"] * 50)
    expected = tok.encode(texts)
    assert _values(asyncio.run(proc_tok.encode_async(texts))) == expected  # the workers have served
    killed = proc_tok._processes.pids
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    with caplog.at_level("WARNING", logger="sidecar.tokenize"):
        assert _values(asyncio.run(proc_tok.encode_async(texts))) == expected  # redone on the threads
    assert "died" in caplog.text and not set(proc_tok._processes.pids) & set(killed)
    assert proc_tok.process_restarts == len(killed) == proc_tok.process_failures  # one per worker
    assert proc_tok.live_processes == 2
    served = proc_tok.process_slices
    assert _values(asyncio.run(proc_tok.encode_async(texts))) == expected
    assert proc_tok.process_slices > served  # the new workers serve


def test_a_hung_worker_process_is_killed_and_replaced_and_its_slice_redone(spec, tok, caplog):
    # A worker that stops answering (SIGSTOP: alive, its pipes open, nothing read or written) holds
    # its slice only until hang_s: then it is killed, the slice fails over to the threads
    # ("restarted"), and a new worker serves the next slice.
    import os
    import signal

    from sidecar.tokenize import TokenizerProcesses, WorkerModel

    procs = TokenizerProcesses(1, 1)
    model = WorkerModel(str(spec.tokenizer_path), spec.max_tokens, None)
    procs.add(model)
    try:
        texts = ["some words here and there"] * 300
        assert asyncio.run(procs.ids(model, texts, "truncate"))[1] == ""  # served once
        hung = procs.pids[0]
        os.kill(hung, signal.SIGSTOP)
        procs.hang_s = 0.5
        with caplog.at_level("WARNING", logger="sidecar.tokenize"):
            seqs, fate = asyncio.run(procs.ids(model, texts, "truncate"))
        assert seqs is None and fate == "restarted"
        assert f"tokenizer worker process {hung} did not answer a slice within 0.5 s" in caplog.text
        assert "a tokenizer worker process hung" in caplog.text
        assert procs.pids != [hung] and procs.live == 1
        procs.hang_s = 60.0
        seqs, fate = asyncio.run(procs.ids(model, texts, "truncate"))
        assert fate == "" and _values(seqs) == tok.encode(texts)
    finally:
        procs.remove()


def test_a_worker_process_takes_a_slice_larger_than_its_pipes_both_ways(spec, tok):
    # One slice of ~1 MB of text (its ids ~0.5 MB) sent straight to a worker: both pipes
    # (64 KB each) fill and drain while the loop writes and reads in turns, and the ids are whole.
    from sidecar.tokenize import TokenizerProcesses, WorkerModel

    procs = TokenizerProcesses(1, 1)
    model = WorkerModel(str(spec.tokenizer_path), spec.max_tokens, None)
    procs.add(model)
    try:
        texts = [f"passage {i} " + "lantern harbor quartz meadow " * 18 for i in range(2000)]
        seqs, fate = asyncio.run(procs.ids(model, texts, "truncate"))
        assert fate == "" and _values(seqs) == tok.encode(texts) and _int32_arrays(seqs)
        assert sum(map(len, texts)) > 1_000_000 and 4 * sum(map(len, seqs)) > 500_000
    finally:
        procs.remove()


def test_a_worker_process_error_is_raised_for_its_slice_and_the_worker_goes_on(spec, tok):
    # A model whose tokenizer the worker cannot load: that slice raises the worker's error,
    # the same worker (no restart) serves the next slice.
    from sidecar.tokenize import TokenizerProcesses, WorkerModel

    procs = TokenizerProcesses(1, 1)
    model = WorkerModel(str(spec.tokenizer_path), spec.max_tokens, None)
    procs.add(model)
    try:
        texts = ["some words here and there"] * 300
        assert asyncio.run(procs.ids(model, texts, "truncate"))[1] == ""
        pids = procs.pids
        with pytest.raises(Exception) as info:
            asyncio.run(procs.ids(WorkerModel("/nonexistent/tokenizer.json", 10, None), texts, "truncate"))
        assert "/nonexistent/tokenizer.json" in info.value.__notes__[-1]
        seqs, fate = asyncio.run(procs.ids(model, texts, "truncate"))
        assert fate == "" and _values(seqs) == tok.encode(texts) and procs.pids == pids
    finally:
        procs.remove()


def test_a_slice_whose_caller_went_away_frees_its_worker(spec, tok):
    # Callers cancelled while their slices are in the workers (a client gone mid-request), and
    # an event loop that ends with a slice in flight (asyncio.run returning): the workers'
    # answers are dropped, and the next request is served by the workers, whole.
    from sidecar.tokenize import TokenizerProcesses

    procs = TokenizerProcesses(2, 1)
    t = TextTokenizer.for_spec(spec, workers=1, processes=procs)
    procs.start()
    texts = _bulk(_differential_texts(4))
    expected = tok.encode(texts)
    try:
        assert _values(asyncio.run(t.encode_async(texts))) == expected

        async def cancelled_midway(wait: bool) -> None:
            task = asyncio.create_task(t.encode_async(texts * 4))
            deadline = time.monotonic() + 60
            while not any(w.busy for w in procs._workers):
                assert not task.done() and time.monotonic() < deadline, "no slice reached a worker"
                await asyncio.sleep(0.001)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            if wait:  # the workers' answers come and are dropped on this loop
                while any(w.busy for w in procs._workers):
                    assert time.monotonic() < deadline, "a worker stayed busy after its answer was due"
                    await asyncio.sleep(0.01)

        for wait in (True, False):
            asyncio.run(cancelled_midway(wait))
            served = t.process_slices
            assert _values(asyncio.run(t.encode_async(texts))) == expected
            assert t.process_slices > served and t.process_failures == 0
    finally:
        t.close()


def test_worker_processes_that_cannot_start_leave_the_threads_tokenizing(spec, tok, caplog):
    from sidecar.tokenize import TokenizerProcesses, WorkerModel

    procs = TokenizerProcesses(1)
    procs.add(WorkerModel("/nonexistent/tokenizer.json", 10, None))  # every worker fails as it starts
    t = TextTokenizer.for_spec(spec, workers=1, processes=procs)
    try:
        texts = _bulk(["some words here and there"] * 50)
        with caplog.at_level("ERROR", logger="sidecar.tokenize"):
            for _ in range(2):
                assert asyncio.run(t.encode_async(texts)) == tok.encode(texts)
        assert procs.given_up and not procs.pids and caplog.text.count("failed before serving") == 1
        assert t.live_processes == 0 and t.process_restarts == 0 and t.process_slices == 0
    finally:
        t.close()


def test_models_share_one_set_of_worker_processes(spec):
    # Two models' tokenizers (another limit, and EOS appended) on one worker: each gets its own
    # ids from it, including a model added after the worker started; the worker stops with the last.
    from sidecar.tokenize import TokenizerProcesses

    procs = TokenizerProcesses(1)
    first = TextTokenizer.for_spec(spec, workers=1, processes=procs)
    procs.start()
    second = TextTokenizer(spec.tokenizer_path, 32, eos_id=102, workers=1, processes=procs)
    alone = [TextTokenizer.for_spec(spec, workers=1, processes=0),
             TextTokenizer(spec.tokenizer_path, 32, eos_id=102, workers=1, processes=0)]
    try:
        texts = _bulk(_differential_texts(5)[:200])
        for t, threads in zip((first, second), alone):
            assert _values(asyncio.run(t.encode_async(texts))) == threads.encode(texts)
            assert t.process_slices > 0 and t.live_processes == 1
        assert len(procs.pids) == 1
        pids = procs.pids
        first.close()
        assert procs.pids == pids  # still serving the second model
        assert _values(asyncio.run(second.encode_async(texts))) == alone[1].encode(texts)
        second.close()
        assert not procs.pids
    finally:
        for t in (first, second, *alone):
            t.close()


def test_worker_processes_by_core_count():
    from sidecar.tokenize import default_process_threads, default_processes

    assert [default_processes(c) for c in (1, 2, 4, 7, 8, 16, 64)] == [0, 0, 0, 0, 2, 4, 16]
    assert default_process_threads(4, 16) == 3 and default_process_threads(2, 8) == 3
    assert default_process_threads(16, 16) == 1


def test_a_registry_of_several_models_runs_one_set_of_worker_processes(spec):
    # `fern serve --tokenizer-processes 1` with two models: one worker between them, started
    # once both are loaded, and stopped when the registry closes.
    from sidecar.registry import ModelSource, Registry

    reg = Registry.load([ModelSource(None), ModelSource(spec.path, "again")], device="cpu",
                        tokenizer_workers=1, tokenizer_processes=1)
    try:
        first, second = (served.tokenizer for served in reg)
        assert first._processes is second._processes and first.processes == second.processes == 1
        procs = first._processes
        assert procs.pids and procs._models == [first._model]  # the same tokenizer twice
        assert procs._started_with == (first._model,)  # loaded as the workers start
        texts = _bulk(["some words here and there"] * 50)
        assert _values(asyncio.run(second.encode_async(texts))) == first.encode(texts) and second.process_slices > 0
    finally:
        reg.close()
    assert not procs.pids


def test_the_worker_processes_int32_ids_embed_to_the_threads_vectors():
    # Bulk requests through the gateway, scheduler and CPU engine: the worker processes' int32
    # arrays, packed by the engine, give the vectors the threads' lists give, bit for bit.
    from sidecar.gateway import EmbedParams, Gateway
    from sidecar.registry import ModelSource, Registry
    from sidecar.scheduler import Lane

    kinds = [t for t in _differential_texts(11) if any(c.isalnum() for c in t)]  # none empty
    fitting = _bulk([t for t in kinds if len(t) < 100])
    texts = fitting + ["Über " + "word " * 400]  # one cut at the limit

    async def embed(processes: int):
        reg = Registry.load([ModelSource(None)], device="cpu", tokenizer_workers=1,
                            tokenizer_processes=processes)
        await reg.start()
        try:
            gateway = Gateway(reg)
            prepared = await gateway.prepare(EmbedParams(texts=texts, lane=Lane.BATCH))
            results = [await gateway.execute(prepared),
                       await gateway.embed(EmbedParams(texts=fitting, lane=Lane.BATCH, truncate=False))]
            return prepared.sequences, results, next(iter(reg)).tokenizer.process_slices
        finally:
            await reg.drain()
            reg.close()

    seqs, with_processes, slices = asyncio.run(embed(1))
    threads_seqs, with_threads, _ = asyncio.run(embed(0))
    assert slices > 0 and _int32_arrays(seqs) and _values(seqs) == threads_seqs
    assert len(seqs[-1]) == 256
    for got, want in zip(with_processes, with_threads):
        np.testing.assert_array_equal(got.vectors, want.vectors)
        assert got.token_counts == want.token_counts
