"""Batch tokenization for the gateway: Rust `tokenizers` on worker threads, off the event loop.

The model's tokenizer.json is loaded with its padding switched off (packed batches need
none) and its truncation set to the model's real limit (`spec.max_tokens`, e.g. 256 for
all-MiniLM-L6-v2, whose shipped tokenizer.json says 128). Special tokens ([CLS] ... [SEP],
<s> ... </s>) are added by the tokenizer's own post-processor and survive truncation.
Models whose pooling reads the last token (Qwen3-Embedding) need an end-of-text token
there; when the tokenizer.json does not append it (ModelSpec.append_eos), it is appended
here, truncating one token earlier to make room, as the model's reference code does.

`encode_batch_fast` (no character offsets) does the work; it releases the GIL and fans
out over Rust threads, and large requests are cut into slices spread over several
Python worker threads, so tokenizing a bulk request never holds up the asyncio loop
that feeds the GPU. Only a query-sized request (up to INLINE_TEXTS texts and INLINE_CHARS
characters: a few queries, or one 512-token passage) is tokenized on the loop itself, where
it costs less than the thread hop would.

On a host with cores to spare (default_processes: one per 4 cores from 8 up), a bulk request
(PROCESS_CHARS and more) has its slices tokenized in worker processes instead, each with its
own GIL and a few Rust threads. Reading ids off Encodings holds the GIL ~50 ns a token, and in
one process that GIL is also the engine loop's: on the H200 host MiniLM text to vectors went
from 4.2-4.8 to 4.9-5.8 M tokens/s (passages, side by side). A worker sends its ids back as
int32 bytes, which become lists here at ~10 ns a token. The processes are spawned (the parent
holds CUDA and threads), so they start from a clean interpreter. One set of them serves every
model of a sidecar (TokenizerProcesses), each worker holding every model's tokenizer. A slice
whose worker dies is redone on the threads; a pool that served before is then replaced, one
that never served is given up.

BERT tokenizers (WordPiece behind a `BertNormalizer` and a `BertPreTokenizer`: MiniLM, BGE,
E5, GTE) normalize every text with control-character cleanup, CJK spacing, NFD accent
stripping and lowercasing, then split it on whitespace and Unicode punctuation. On ASCII
text made of printable characters, tabs and line breaks, all of that reduces to: lowercase,
then keep the runs of letters and digits and every other non-blank character on its own.
Such texts go through a twin of the tokenizer that does exactly that: Python's `str.lower`
(a C loop over ASCII, cheaper than Rust's normalizer with its per-byte alignment
bookkeeping) and a one-regex `Split` pre-tokenizer, with no normalizer at all. The twin
gives the same ids at 2.3x the shipped pipeline's tokens/s on one core of the H200 host
(MiniLM passages, 0.34 -> 0.78 M); on its 16 cores the sliced path went 5.3 -> 7.7 M tokens/s
(`python -m tools.profiling.tokenize_bench`). What remains serial there is Python's share under
the GIL: building the id lists and freeing the Encoding objects (~50 ns a token, more for
short texts); the `tokenizers` API returns nothing leaner than an Encoding, so the twin
makes fewer of them by joining JOIN_TEXTS texts into one input. Texts that hold an added
token's text ("[CLS]" typed by a user) or anything else go through the shipped pipeline; a
batch is split between the two and put back in order. A text far over the limit has only its
head tokenized by the twin (CUT_CHARS_PER_TOKEN), since truncation would discard the rest.

A query-sized request skips Rust too, whose fixed cost per call (the Encoding, the regex
pre-tokenizer) is most of a short text's: the twin's words never cross a blank and WordPiece
goes a word at a time, so a text's ids are its blank-separated chunks' ids in order, looked up
in a bounded memo (MEMO_CHUNKS) that twin calls fill on misses; special tokens and
truncation are then applied as the post-processor applies them. On a 2-core host, `encode` of
one 128-token query went from 97 to 18 us once its chunks were known (16 tokens: 25 to 3.7 us),
and costs 150 us when none is (`python -m tools.profiling.tokenize_bench --single-only`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import re
from array import array
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from itertools import chain, compress, count
from operator import gt
from pathlib import Path
from typing import NamedTuple

from tokenizers import Tokenizer

from core_engine.config import ModelSpec
from sidecar.errors import invalid_argument

log = logging.getLogger(__name__)

# Texts per worker slice: large enough to amortize a thread hop, small enough that a bulk
# request spreads over the workers and an online request never waits behind a whole one.
SLICE_TEXTS = 256


# A query this small tokenizes in tens of microseconds, less than the hop to a worker
# thread and back (~0.3 ms measured on a busy 2-core host): it is done on the loop, from the
# chunk memo. 4,096 characters hold one 512-token passage (English runs 4-5 characters a
# token): from the memo 92 us against 489 us through Rust on the 2-core CI machine, and 662 us
# on the loop when every chunk is new. At 2,048 such a passage went to a worker, through Rust.
INLINE_TEXTS = 4
INLINE_CHARS = 4096

# On ASCII, BertNormalizer's clean-up removes control characters other than tab and line
# breaks (which the pre-tokenizer splits on like spaces); a text with one takes the full path.
# The check deletes these bytes and looks for leftovers: a C loop, 3-5x faster than a regex
# or str.isprintable, which matters since it runs under the GIL on every batch.
_ASCII_TEXT = bytes(range(0x20, 0x7F)) + b"\t\n\r"

# BertPreTokenizer on lowercased ASCII: runs of letters and digits, and every other
# non-blank character (all of ASCII's are Unicode punctuation) on its own.
_ASCII_WORDS = r"[a-z0-9]+|[^a-z0-9 \t\n\r]"

# A text the twin truncates is first cut, at a space, to this many characters per token of
# the limit (English runs 4-5 per token): its head alone is tokenized. When the head fills
# the limit, its ids are the whole text's (the same words make the same tokens, and
# truncation keeps only the first ones); when it falls short, the whole text is redone.
CUT_CHARS_PER_TOKEN = 6

# Texts per joined string: the twin tokenizes "[CLS] a [SEP] [CLS] b [SEP] ..." as one input and
# splits the ids at each [SEP]. Each text otherwise costs an Encoding object, built in Rust and
# then read and freed in Python under the GIL: 16 to a string cut that share, which is what
# stays serial on a many-core host (20,000 queries: 1.35x tokens/s on one core).
JOIN_TEXTS = 16
# Fewer when a batch is small, so that each call still gives Rust's threads (one a core unless
# RAYON_NUM_THREADS says otherwise) two inputs each: a 100-text request keeps its latency.
_RUST_THREADS = int(os.environ.get("RAYON_NUM_THREADS") or 0) or os.cpu_count() or 1

# A query-sized request's ASCII texts are tokenized from a memo of whitespace-separated chunks
# ("world," "(really?)") to their ids: dictionary lookups instead of a Rust call. An entry takes
# ~350 bytes on words (10 MiB full), ~1.4 KB at worst (32 punctuation marks: 45 MiB full); a
# full memo is emptied and refills from later misses.
# FERN_TOKEN_MEMO_CHUNKS sets it; 0 turns the memo off (a stream of mostly unseen words, IDs
# or hashes pays ~1.55x the Rust path per text on misses).
MEMO_CHUNKS = int(os.environ.get("FERN_TOKEN_MEMO_CHUNKS", 1 << 15))
# Longer chunks (URLs, hashes, [UNK]-sized words) are rare in a query and are not kept.
MEMO_CHUNK_CHARS = 32
# A text whose chunks are mostly new gets its ids from one Rust call as without the memo, and
# a second call on at most this many of its new chunks fills the memo: a text with no chunk
# seen before costs ~1.6x the memo-less path rather than ~2x, and the memo still warms up.
MEMO_LEARN_CHUNKS = 16


# A text longer than this many characters is tokenized a window at a time (LONG_WINDOW_CHARS each,
# cut where no token can span the cut), and only as far as the result needs: truncation keeps
# the first tokens, a refusal needs only to know the limit is passed, a sparse vector counts
# at most SPARSE_MAX_TOKENS. Tokenizing a 10 MB text whole built 3.5 M tokens' Encodings (~900
# MiB) just to keep 256 of them or to refuse it.
LONG_TEXT_CHARS = 65536
LONG_WINDOW_CHARS = 16384
# The tokens a sparse vector counts: a text's first 8,192 (32 times the dense limit of a
# 256-token model), so that one huge text cannot make the sidecar hold millions of ids.
SPARSE_MAX_TOKENS = 8192
# Where a BERT tokenizer's words break whatever surrounds them: whitespace, ASCII punctuation and
# the CJK ideographs it spaces out. A cut just before one changes no token on either side.
_BERT_BREAK = re.compile(r"[\s!-/:-@\[-`{-~\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")


# A bulk request (at least this many characters: ~4,000 English tokens, a few ms of one core's
# tokenizing) goes to the worker processes when there are any; smaller ones would pay more for
# the round trip through a process's queues than they save.
PROCESS_CHARS = 16384
# A request on the worker processes is cut into slices of about this many characters (and at
# most SLICE_TEXTS texts), so that a few requests in flight keep every process busy.
PROCESS_SLICE_CHARS = 65536


def default_workers() -> int:
    """Tokenizer worker threads: a few, since each `encode_batch_fast` call fans out in Rust."""
    return max(2, min(8, os.cpu_count() or 2))


def default_processes(cpus: int | None = None) -> int:
    """Tokenizer worker processes for bulk requests: one per 4 cores from 8 cores up, none below.

    On the 16-core H200 host, side by side in one run, MiniLM text to vectors with 4 processes of 3 Rust threads and 64 K-character
    slices against the threads alone: passages 4.85 / 5.80 M tokens/s against 4.23 / 4.80 M,
    queries 2.76 / 2.44 against 2.10 / 1.82, long 4.36 / 5.00 against 4.22 / 4.16. 7 x 2, 12 x 1
    and 14 x 1 with smaller slices tokenized faster alone but fed the engine slower (3.2-4.9 M
    passages): they crowd the cores that the engine's thread and the loop need. The threads
    share one GIL with the engine's loop, and reading ids off Encodings holds it ~50 ns a token.
    On 2 cores two processes tokenized slower than the threads (1.9 against 2.9 M tokens/s,
    MiniLM passages): there is no core to give them.
    """
    cpus = cpus or os.cpu_count() or 1
    return cpus // 4 if cpus >= 8 else 0


def default_process_threads(processes: int, cpus: int | None = None) -> int:
    """Rust threads per worker process: the cores less two (the loop and the engine), shared out."""
    cpus = cpus or os.cpu_count() or 1
    return max(1, (cpus - 2) // max(1, processes))


def _ids(tokenizer: Tokenizer, texts: list[str], special: bool) -> list[list[int]]:
    # encode_batch_fast (tokenizers >= 0.21) skips the character offsets Fern never reads.
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    return [e.ids for e in encode(texts, add_special_tokens=special)]


class WorkerModel(NamedTuple):
    """What a worker process needs to build a model's TextTokenizer (and the key it keeps it by)."""

    tokenizer_path: str
    max_tokens: int
    eos_id: int | None


# In a tokenizer worker process: a TextTokenizer per model it serves (no threads, no memo, no
# processes).
_WORKER_TOKENIZERS: dict[WorkerModel, "TextTokenizer"] = {}


def _start_worker(rust_threads: int, models: tuple[WorkerModel, ...]) -> None:
    # Rust's thread pool starts at its first parallel call and reads RAYON_NUM_THREADS then;
    # _RUST_THREADS sizes the twin's joined inputs to that pool. The models known when the pool
    # starts are loaded now; one added later is loaded by its first slice.
    global _RUST_THREADS
    os.environ["RAYON_NUM_THREADS"] = str(rust_threads)
    _RUST_THREADS = rust_threads
    for model in models:
        _worker_tokenizer(model)


def _worker_tokenizer(model: WorkerModel) -> "TextTokenizer":
    tok = _WORKER_TOKENIZERS.get(model)
    if tok is None:
        tok = _WORKER_TOKENIZERS[model] = TextTokenizer(model.tokenizer_path, model.max_tokens,
                                                        eos_id=model.eos_id, workers=1, memo_chunks=0,
                                                        processes=0)
    return tok


def _worker_ids(model: WorkerModel, texts: list[str], how: str) -> tuple[bytes, bytes]:
    """`TextTokenizer._ids_of` in a worker process, packed: every id as int32, then each text's count."""
    seqs = _worker_tokenizer(model)._ids_of(texts, how)
    flat = array("i")
    for ids in seqs:
        flat.extend(ids)
    return flat.tobytes(), array("i", map(len, seqs)).tobytes()


class TokenizerProcesses:
    """The worker processes that tokenize bulk requests, shared by the models of a sidecar.

    Each worker holds a tokenizer for every model that `add`ed itself: the models known when the
    pool starts are loaded by each worker as it starts, a later one by its first slice there. So
    a sidecar serving several models runs one set of `processes` workers (default_processes),
    not one per model, and a busy model has all of them. The processes are spawned (the parent
    holds CUDA and threads) when `start` is first called, in the background, so that the first
    bulk request does not wait for them. After a worker dies, a pool that had served is replaced;
    one that never served (workers that cannot start: a main module that starts Fern again when
    spawned) is given up, and every model tokenizes on its threads.
    """

    def __init__(self, processes: int, threads: int | None = None) -> None:
        if processes < 1:
            raise ValueError(f"processes must be at least 1, got {processes}")
        self.processes = int(processes)
        self.threads = threads or default_process_threads(self.processes)
        self._models: list[WorkerModel] = []
        self._users = 0
        self._pool: ProcessPoolExecutor | None = None
        self._served = False
        self.given_up = False

    def add(self, model: WorkerModel) -> None:
        """A model's tokenizer will send its slices here."""
        if model not in self._models:
            self._models.append(model)
        self._users += 1

    def start(self) -> None:
        """Start the workers now (a no-op once started or given up)."""
        if self._pool is None and not self.given_up:
            self._pool = self._started()

    def _started(self) -> ProcessPoolExecutor:
        pool = ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_start_worker, initargs=(self.threads, tuple(self._models)))
        for _ in range(self.processes):
            pool.submit(len, "")
        self._served = False
        return pool

    @property
    def live(self) -> int:
        """Workers that take bulk requests now (0: given up)."""
        return 0 if self.given_up else self.processes

    async def ids(self, model: WorkerModel, texts: list[str], how: str) -> tuple[list[list[int]] | None, str]:
        """`model`'s ids of `texts` from a worker, and "" when the slice was served; else no ids
        and what happened to the pool: "restarted" (a worker died; a new pool takes over), "died"
        (the same, seen by another slice first), "failed" (the pool never served and is given
        up) or "gone" (given up before)."""
        self.start()
        pool = self._pool
        if pool is None:
            return None, "gone"
        try:
            packed = await asyncio.get_running_loop().run_in_executor(pool, _worker_ids, model, texts, how)
        except BrokenProcessPool:
            if self._pool is not pool:  # another slice has dealt with this pool
                return None, "died"
            if self._served:
                log.warning("a tokenizer worker process died; starting new ones")
                self._pool = self._started()
                return None, "restarted"
            log.error("tokenizer worker processes failed before serving; tokenizing on threads "
                      "(FERN_TOKENIZER_PROCESSES=0 skips them)")
            self._pool, self.given_up = None, True
            return None, "failed"
        if self._pool is pool:
            self._served = True
        return _unpacked(packed), ""

    def remove(self) -> None:
        """A model's tokenizer is done with the processes; the last one stops them."""
        self._users -= 1
        if self._users <= 0 and self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _unpacked(packed: tuple[bytes, bytes]) -> list[list[int]]:
    """The id lists `_worker_ids` packed (~10 ns a token, against ~50 to read them off Encodings)."""
    flat, counts = array("i"), array("i")
    flat.frombytes(packed[0])
    counts.frombytes(packed[1])
    ids = flat.tolist()
    seqs, start = [], 0
    for n in counts:
        seqs.append(ids[start:start + n])
        start += n
    return seqs


def _joint(config: dict) -> tuple[str, int] | None:
    """For a "[CLS] $A [SEP]" template whose two tokens are added tokens (so typed between
    texts they are matched as themselves): the string that joins texts, and [SEP]'s id."""
    post = config.get("post_processor") or {}
    single = post.get("single") or []
    if post.get("type") != "TemplateProcessing" or len(single) != 3 or "Sequence" not in single[1]:
        return None
    try:
        cls, sep = (single[0]["SpecialToken"]["id"], single[2]["SpecialToken"]["id"])
        (cls_id,), (sep_id,) = (post["special_tokens"][cls]["ids"], post["special_tokens"][sep]["ids"])
    except (KeyError, TypeError, ValueError):
        return None
    added = {(t["content"], t["id"]) for t in config.get("added_tokens") or []}
    if (cls, cls_id) not in added or (sep, sep_id) not in added or cls_id == sep_id:
        return None
    return f" {sep} {cls} ", sep_id


def _head(text: str, chars: int) -> str:
    """`text` up to its last space within `chars` characters (all of it when there is none)."""
    cut = text.rfind(" ", 0, chars)
    return text[:cut] if cut > 0 else text


class _AsciiTwin:
    """A copy of a BERT tokenizer for lowercased ASCII text: no normalizer, a one-regex
    pre-tokenizer, the same model, added tokens, post-processor and truncation."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        config = json.loads(tokenizer.to_str())
        config["normalizer"] = None
        config["pre_tokenizer"] = {"type": "Split", "pattern": {"Regex": _ASCII_WORDS},
                                   "behavior": "Removed", "invert": True}
        self.tokenizer = Tokenizer.from_str(json.dumps(config))
        # TextTokenizer truncates at the right with no stride, which the cut in `encode` relies on.
        self._limit = (config.get("truncation") or {}).get("max_length")
        self._join = _joint(config)
        config["truncation"] = None
        self._untruncated = Tokenizer.from_str(json.dumps(config))
        # A text holding an added token's text must see the shipped pipeline, which matches
        # it before normalizing (case-sensitive) or after (lowercased): either way not here.
        contents = sorted({t["content"] for t in config.get("added_tokens") or []}, key=len, reverse=True)
        self._added = re.compile("|".join(map(re.escape, contents)), re.IGNORECASE) if contents else None
        # First characters of added tokens, either case: a text with none of them holds none.
        self._added_starts = tuple({f(c[0]) for c in contents for f in (str.lower, str.upper)})

    @staticmethod
    def of(tokenizer: Tokenizer) -> "_AsciiTwin | None":
        """The twin of `tokenizer`, or None unless it is a lowercasing BertNormalizer
        followed by a BertPreTokenizer (where the twin's ids are provably the same)."""
        config = json.loads(tokenizer.to_str())
        normalizer = config.get("normalizer") or {}
        pre = config.get("pre_tokenizer") or {}
        if (normalizer.get("type") != "BertNormalizer" or not normalizer.get("lowercase")
                or pre.get("type") != "BertPreTokenizer"):
            return None
        return _AsciiTwin(tokenizer)

    def encode(self, texts: list[str], special: bool) -> list[list[int]]:
        """Ids of texts that `fits` accepts, as the shipped pipeline gives them."""
        lowered = [t.lower() for t in texts]
        if self._limit is None:
            return self._encode(lowered, special)
        chars = self._limit * CUT_CHARS_PER_TOKEN
        heads = [t if len(t) <= chars else _head(t, chars) for t in lowered]
        seqs = self._encode(heads, special)
        short = [i for i, (t, h, ids) in enumerate(zip(lowered, heads, seqs))
                 if h is not t and len(ids) < self._limit]
        for i, ids in zip(short, self._encode([lowered[i] for i in short], special)):
            seqs[i] = ids
        return seqs

    def _encode(self, lowered: list[str], special: bool) -> list[list[int]]:
        group = min(JOIN_TEXTS, len(lowered) // (2 * _RUST_THREADS))
        if not special or self._join is None or group < 2:
            return _ids(self.tokenizer, lowered, special)
        joint, sep = self._join
        limit = self._limit
        seqs: list[list[int]] = []
        for ids in _ids(self._untruncated, [joint.join(lowered[i:i + group])
                                            for i in range(0, len(lowered), group)], True):
            start, end, find = 0, len(ids), ids.index
            while start < end:
                stop = find(sep, start) + 1
                if limit is not None and stop - start > limit:  # as the template truncates
                    seqs.append([*ids[start:start + limit - 1], sep])
                else:
                    seqs.append(ids[start:stop])
                start = stop
        return seqs

    def fits(self, text: str) -> bool:
        """Whether `text` gets the shipped pipeline's ids from the twin (after `str.lower`)."""
        if not text.isascii() or text.encode("ascii").translate(None, _ASCII_TEXT):
            return False
        return not (any(c in text for c in self._added_starts) and self._added.search(text))


class _WordPiece:
    """The twin's plain ids of one blank-free chunk in Python: its regex's words, each through
    WordPiece as the `tokenizers` library runs it (greedy longest match first, "##" before
    every piece after the first, the whole word [UNK] when a piece cannot be matched or the
    word is over max_input_chars_per_word). For the few chunks a query's memo lacks this is a
    few dictionary lookups: on the 2-core machine 1 / 16 chunks cost 1.7 / 18.7 us, one Rust
    call on them 5.6 / 29.2 us (benchmarks/results/cpu/wordpiece.json)."""

    _words = re.compile(_ASCII_WORDS).findall

    def __init__(self, model: dict) -> None:
        self._vocab: dict[str, int] = model["vocab"]
        self._unk = self._vocab[model["unk_token"]]
        self._prefix = model["continuing_subword_prefix"]
        self._max_chars = model["max_input_chars_per_word"]

    @staticmethod
    def of(tokenizer: Tokenizer) -> "_WordPiece | None":
        """The WordPiece of `tokenizer`'s model, or None when it is another model."""
        model = json.loads(tokenizer.to_str())["model"]
        if model.get("type") != "WordPiece" or model.get("unk_token") not in model.get("vocab", {}):
            return None
        return _WordPiece(model)

    def ids(self, chunk: str) -> tuple[int, ...]:
        out: list[int] = []
        for word in self._words(chunk):
            out += self._word(word)
        return tuple(out)

    def _word(self, word: str) -> list[int]:
        if len(word) > self._max_chars:
            return [self._unk]
        vocab, pieces, start = self._vocab, [], 0
        while start < len(word):
            for end in range(len(word), start, -1):
                piece = vocab.get(word[start:end] if start == 0 else self._prefix + word[start:end])
                if piece is not None:
                    break
            else:
                return [self._unk]
            pieces.append(piece)
            start = end
        return pieces


class _ChunkIds:
    """The twin's ids for a few texts, from a memo of their whitespace-separated chunks' ids.

    The twin's words (regex matches) never cross whitespace and WordPiece works a word at a
    time, so a text's plain ids are its chunks' plain ids in order; special tokens and
    truncation are then applied as the post-processor does: prefix + body cut to the limit
    less the special tokens + suffix. Up to MEMO_LEARN_CHUNKS chunks missing from the memo go
    through `_WordPiece` when the model is WordPiece; more are tokenized by the twin itself in
    one call, joined by spaces (no added token holds whitespace, so none can match across two
    chunks) and told apart by their tokens' offsets. A text made mostly of new chunks is
    tokenized whole instead, and teaches the memo MEMO_LEARN_CHUNKS of them."""

    def __init__(self, tokenizer: Tokenizer, prefix: list[int], suffix: list[int],
                 entries: int = MEMO_CHUNKS, chars: int = MEMO_CHUNK_CHARS) -> None:
        self._tokenizer = tokenizer
        self._wordpiece = _WordPiece.of(tokenizer)
        self._prefix, self._suffix = prefix, suffix
        self.specials = len(prefix) + len(suffix)
        self._entries, self._chars = entries, chars
        self._memo: dict[str, tuple[int, ...]] = {}

    @staticmethod
    def of(twin: _AsciiTwin, entries: int = MEMO_CHUNKS, chars: int = MEMO_CHUNK_CHARS) -> "_ChunkIds | None":
        """The memo for `twin`, or None when it pads, an added token holds whitespace or the
        post-processor does more than put fixed tokens around the text's ids."""
        tokenizer = twin._untruncated
        if tokenizer.padding is not None:
            return None
        added = [t.content for t in tokenizer.get_added_tokens_decoder().values()]
        if any(ch.isspace() for content in added for ch in content):
            return None
        specials = tokenizer.encode("", add_special_tokens=True).ids
        plain = tokenizer.encode("a", add_special_tokens=False).ids
        full = tokenizer.encode("a", add_special_tokens=True).ids
        cuts = [k for k in range(len(specials) + 1) if full == [*specials[:k], *plain, *specials[k:]]]
        if len(cuts) != 1 or set(plain) & set(specials):
            return None
        return _ChunkIds(tokenizer, specials[:cuts[0]], specials[cuts[0]:], entries, chars)

    def encode(self, texts: list[str], special: bool, limit: int | None) -> list[list[int]]:
        """Ids of texts that the twin `fits`, as its `encode` gives them truncated to `limit`
        (which must leave room for the special tokens)."""
        seqs = []
        for text in texts:
            lowered = text.lower()
            chunks = lowered.split()  # under `fits`, str.split's whitespace is the twin's
            try:
                body = list(chain.from_iterable(map(self._memo.__getitem__, chunks)))
            except KeyError:
                body = self._miss(lowered, chunks)
            room = None if limit is None else limit - (self.specials if special else 0)
            if room is not None and len(body) > room:
                del body[room:]
            if special:
                body = [*self._prefix, *body, *self._suffix]
            seqs.append(body)
        return seqs

    def _miss(self, lowered: str, chunks: list[str]) -> list[int]:
        """The plain ids of `lowered` (split into `chunks`), some of which the memo lacks."""
        memo = self._memo
        known = {chunk: memo.get(chunk) for chunk in chunks}
        missing = [chunk for chunk, ids in known.items() if ids is None]
        if len(missing) <= MEMO_LEARN_CHUNKS or 2 * len(missing) <= len(known):  # only they are tokenized
            learned = self._few(missing) if len(missing) <= MEMO_LEARN_CHUNKS else self._tokenize(missing)
            known.update(learned)
            body = list(chain.from_iterable(map(known.__getitem__, chunks)))
        else:  # mostly new: the text in one call as without the memo, which learns some of them
            body = _ids(self._tokenizer, [lowered], False)[0]
            learned = self._few([c for c in missing if len(c) <= self._chars][:MEMO_LEARN_CHUNKS])
        kept = [(chunk, ids) for chunk, ids in learned.items() if len(chunk) <= self._chars][:self._entries]
        if len(memo) + len(kept) > self._entries:
            memo.clear()
        memo.update(kept)
        return body

    def _few(self, chunks: list[str]) -> dict[str, tuple[int, ...]]:
        """`_tokenize` for at most MEMO_LEARN_CHUNKS chunks: through `_WordPiece` where there is
        one, which costs less than the Rust call at every count up to 32 chunks measured. A text
        of mostly new chunks is still tokenized whole by Rust (`_miss`)."""
        if self._wordpiece is None:
            return self._tokenize(chunks)
        return {chunk: self._wordpiece.ids(chunk) for chunk in chunks}

    def _tokenize(self, chunks: list[str]) -> dict[str, tuple[int, ...]]:
        """The twin's plain ids of each of `chunks`, from one call on them joined by spaces."""
        if not chunks:
            return {}
        encoding = self._tokenizer.encode(" ".join(chunks), add_special_tokens=False)
        starts, ends = zip(*encoding.offsets)
        # A chunk's tokens are contiguous (its words are, and so are a word's pieces) and a
        # space separates two chunks: a chunk's first token is the one after a gap.
        firsts = [0, *compress(count(1), map(gt, starts[1:], ends)), len(starts)]
        if len(firsts) != len(chunks) + 1:
            raise RuntimeError(f"{len(firsts) - 1} token runs for {len(chunks)} chunks: {chunks[:8]!r}")
        ids = tuple(encoding.ids)
        return dict(zip(chunks, [ids[a:b] for a, b in zip(firsts, firsts[1:])]))


class _Windows:
    """How a BERT tokenizer's long text is cut into windows whose ids, joined, are the text's.

    A BertNormalizer works a character at a time (NFD and accent stripping never reach across a
    space or a punctuation mark, which are starters) and a BertPreTokenizer splits words at
    whitespace, punctuation and CJK ideographs, which WordPiece then takes one at a time; so a
    cut just before such a character (`cut`) changes no token, unless it falls inside an added
    token typed in the text ("[CLS]" holds punctuation), which `cut` steps over. `prefix` and
    `suffix` are the special tokens the post-processor puts around a text's ids.
    """

    def __init__(self, prefix: list[int], suffix: list[int], added: list[str]) -> None:
        self.prefix, self.suffix = prefix, suffix
        self.specials = len(prefix) + len(suffix)
        self._added = [a for a in added if a]
        self._reach = max((len(a) for a in self._added), default=0)

    @staticmethod
    def of(tokenizer: Tokenizer) -> "_Windows | None":
        """The windows of `tokenizer`, or None unless it is a BERT pipeline (where cuts are proven
        not to change ids) whose post-processor puts fixed tokens around the text's ids."""
        config = json.loads(tokenizer.to_str())
        normalizer = (config.get("normalizer") or {}).get("type")
        pre = (config.get("pre_tokenizer") or {}).get("type")
        if normalizer not in (None, "BertNormalizer") or pre != "BertPreTokenizer":
            return None
        if config.get("truncation") or config.get("padding"):
            return None
        specials = tokenizer.encode("", add_special_tokens=True).ids
        plain = tokenizer.encode("a", add_special_tokens=False).ids
        full = tokenizer.encode("a", add_special_tokens=True).ids
        cuts = [k for k in range(len(specials) + 1) if full == [*specials[:k], *plain, *specials[k:]]]
        if len(cuts) != 1:
            return None
        added = [t.content for t in tokenizer.get_added_tokens_decoder().values()]
        return _Windows(specials[:cuts[0]], specials[cuts[0]:], added)

    def cut(self, text: str, at: int) -> int:
        """The first safe cut in `text` at or after `at` (len(text) when there is none)."""
        while at < len(text):
            found = _BERT_BREAK.search(text, at)
            if found is None:
                return len(text)
            at = found.start()
            if at > 0 and not self._inside_added(text, at):
                return at
            at += 1
        return len(text)

    def _inside_added(self, text: str, at: int) -> bool:
        if not self._reach:
            return False
        near = text[max(0, at - self._reach):at + self._reach].lower()
        offset = max(0, at - self._reach)
        for added in self._added:
            pos = near.find(added.lower())
            while pos != -1:
                if offset + pos < at < offset + pos + len(added):
                    return True
                pos = near.find(added.lower(), pos + 1)
        return False


class TextTokenizer:
    """One model's tokenizer: texts in, token id lists (special tokens included) out.

    `encode` is the synchronous core; `encode_async` runs it on the worker pool. Inputs
    over `max_tokens` are cut at the end when `truncate` is true and rejected with
    INVALID_ARGUMENT (naming the input and its token count) when it is false.
    `memo_chunks` bounds the chunk memo that query-sized requests are tokenized from (0: none).
    """

    def __init__(self, tokenizer_path: str | Path, max_tokens: int, *, eos_id: int | None = None,
                 workers: int | None = None, slice_texts: int = SLICE_TEXTS,
                 memo_chunks: int = MEMO_CHUNKS, processes: int | TokenizerProcesses | None = None,
                 process_threads: int | None = None, process_slice_chars: int = PROCESS_SLICE_CHARS) -> None:
        self.max_tokens = int(max_tokens)
        if self.max_tokens < 2:
            raise ValueError(f"max_tokens must be at least 2, got {max_tokens}")
        self._full = Tokenizer.from_file(str(tokenizer_path))
        self._full.no_padding()
        self._full.no_truncation()
        self.eos_id = eos_id
        # Tokens the tokenizer itself may produce: one fewer when EOS is appended here.
        self._room = self.max_tokens - (1 if self.eos_id is not None else 0)
        specials = len(self._full.encode("", add_special_tokens=True).ids)
        if self._room <= specials:  # no room for a single token of text: truncation could not hold the limit
            raise ValueError(f"max_tokens {max_tokens} leaves no room for text beside the "
                             f"{specials + self.max_tokens - self._room} special tokens")
        self._truncating = Tokenizer.from_file(str(tokenizer_path))
        self._truncating.no_padding()
        self._truncating.enable_truncation(self._room)
        # Twins for ASCII texts (None: this tokenizer has no such twin).
        self._full_twin = _AsciiTwin.of(self._full)
        self._truncating_twin = _AsciiTwin.of(self._truncating)
        # One chunk memo serves both twins, whose plain ids are the same (0 chunks: no memo).
        self._chunks = (_ChunkIds.of(self._full_twin, memo_chunks)
                        if self._full_twin is not None and memo_chunks > 0 else None)
        self.special_ids = frozenset(i for i, tok in self._full.get_added_tokens_decoder().items()
                                     if tok.special)
        self.vocab_size = self._full.get_vocab_size(with_added_tokens=True)
        self.slice_texts = int(slice_texts)
        self.workers = workers or default_workers()
        self._pool = ThreadPoolExecutor(self.workers,
                                        thread_name_prefix="fern-tokenize")
        # Worker processes for bulk requests: a sidecar's shared ones (its registry starts them
        # once every model is added), or this tokenizer's own (`processes` of them,
        # default_processes when None; 0: none), started here, after this model is added, so
        # that each worker loads its tokenizer as it starts rather than on its first slice.
        own = not isinstance(processes, TokenizerProcesses)
        if own:
            count = default_processes() if processes is None else int(processes)
            processes = TokenizerProcesses(count, process_threads) if count > 0 else None
        self._processes = processes
        self._model = WorkerModel(str(tokenizer_path), self.max_tokens, eos_id)
        if processes is not None:
            processes.add(self._model)
            if own:
                processes.start()
        # Counters for /metrics: slices the worker processes tokenized, slices redone on the
        # threads because their worker died, and pools started anew after such a death.
        self.process_slices = self.process_failures = self.process_restarts = 0
        self.process_slice_chars = int(process_slice_chars)
        self._windows = _Windows.of(self._full)

    def _batch(self, tokenizer: Tokenizer, twin: _AsciiTwin | None, texts: list[str],
               special: bool) -> list[list[int]]:
        if twin is None or not texts:
            return _ids(tokenizer, texts, special)
        small = self._small(texts)
        if twin.fits("\n".join(texts)):  # one pass over the batch: the common case
            return self._twin_ids(twin, texts, special, small)
        fast = [twin.fits(t) for t in texts]
        if not any(fast):
            return _ids(tokenizer, texts, special)
        easy = iter(self._twin_ids(twin, [t for t, f in zip(texts, fast) if f], special, small))
        hard = iter(_ids(tokenizer, [t for t, f in zip(texts, fast) if not f], special))
        return [next(easy) if f else next(hard) for f in fast]

    def _twin_ids(self, twin: _AsciiTwin, texts: list[str], special: bool, small: bool) -> list[list[int]]:
        # A query-sized request's from the chunk memo, in Python under the GIL (on the loop,
        # which holds it anyway); a bulk one's from Rust's threads, which run without it.
        # __init__ refuses a limit with no room beside the special tokens, as the memo needs.
        if small and self._chunks is not None:
            return self._chunks.encode(texts, special, twin._limit)
        return twin.encode(texts, special)

    @classmethod
    def for_spec(cls, spec: ModelSpec, workers: int | None = None,
                 processes: int | TokenizerProcesses | None = None) -> "TextTokenizer":
        """The tokenizer of a core_engine ModelSpec (EOS appended when `spec.append_eos`)."""
        return cls(spec.tokenizer_path, spec.max_tokens,
                   eos_id=spec.eos_token_id if spec.append_eos else None, workers=workers,
                   processes=processes)

    def encode(self, texts: Sequence[str], *, truncate: bool = True, field: str = "texts",
               offset: int = 0) -> list[list[int]]:
        """Token ids of each text; errors name `field[offset + i]`."""
        how = "truncate" if truncate else "full"
        texts = list(texts)
        return self._checked(self._ids_of(texts, how), how, field, offset, texts)

    def _ids_of(self, texts: list[str], how: str) -> list[list[int]]:
        """The tokenizer's own ids: "truncate" and "full" with special tokens (cut to the limit
        less a room for EOS, or not cut), "plain" without special tokens and not cut (at most
        SPARSE_MAX_TOKENS for a text over LONG_TEXT_CHARS). A "full" text over the limit may
        come back as only its first tokens past the limit (enough to refuse it)."""
        if self._windows is not None and texts and max(map(len, texts)) > LONG_TEXT_CHARS:
            seqs = self._ids_of_short([t if len(t) <= LONG_TEXT_CHARS else "" for t in texts], how)
            for i, text in enumerate(texts):
                if len(text) > LONG_TEXT_CHARS:
                    seqs[i] = self._long_ids(text, how)
            return seqs
        return self._ids_of_short(texts, how)

    def _long_ids(self, text: str, how: str) -> list[int]:
        """`_ids_of` for one long text, tokenized a window at a time and only as far as needed.

        The windows are cut where no token spans the cut (`_Windows`), so the whole text's plain
        ids are its windows' plain ids, in order. Truncation keeps the first tokens: once the
        windows read hold the room, those windows alone (the head) give the whole text's
        truncated ids. A text whose windows never fill the room has all its ids known.
        """
        windows = self._windows
        room = self._room - windows.specials
        need = {"truncate": room, "full": room + 1, "plain": SPARSE_MAX_TOKENS}[how]
        body: list[int] = []
        start = 0
        while start < len(text) and len(body) < need:
            end = windows.cut(text, start + LONG_WINDOW_CHARS)
            body += self._batch(self._full, self._full_twin, [text[start:end]], False)[0]
            start = end
        if how == "plain":
            return body[:SPARSE_MAX_TOKENS]
        if how == "truncate" and len(body) >= room:
            return self._batch(self._truncating, self._truncating_twin, [text[:start]], True)[0]
        return [*windows.prefix, *body, *windows.suffix]

    def _ids_of_short(self, texts: list[str], how: str) -> list[list[int]]:
        if how == "truncate":
            return self._batch(self._truncating, self._truncating_twin, texts, True)
        return self._batch(self._full, self._full_twin, texts, how != "plain")

    def _checked(self, seqs: list[list[int]], how: str, field: str, offset: int,
                 texts: Sequence[str]) -> list[list[int]]:
        """`_ids_of`'s ids with EOS appended where the model needs it; "full" ones over the limit
        are refused, naming the first such input (a long text's count is of what was read)."""
        if how == "plain":
            return seqs
        if how == "full":
            for i, ids in enumerate(seqs):
                if len(ids) > self._room:
                    count = len(ids) + (1 if self.eos_id is not None else 0)
                    partial = "+" if self._windows is not None and len(texts[i]) > LONG_TEXT_CHARS else ""
                    raise invalid_argument(
                        f"{field}[{offset + i}]: {count}{partial} tokens exceeds the model's limit of "
                        f"{self.max_tokens} tokens (truncation is TRUNCATION_ERROR)", offset + i)
        if self.eos_id is not None:
            for ids in seqs:
                ids.append(self.eos_id)
        return seqs

    def encode_plain(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids without special tokens and without truncation (for sparse vectors)."""
        return self._ids_of(list(texts), "plain")

    async def encode_async(self, texts: Sequence[str], *, truncate: bool = True,
                           field: str = "texts", offset: int = 0) -> list[list[int]]:
        """`encode` off the loop, in slices of `slice_texts` run in parallel: on the worker
        processes for a bulk request where there are any, else on the worker threads.

        When several slices fail, the error of the lowest input index is raised."""
        if self._small(texts):
            return self.encode(texts, truncate=truncate, field=field, offset=offset)
        return await self._run_slices(texts, "truncate" if truncate else "full", field, offset)

    async def encode_plain_async(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode_plain` off the loop, as `encode_async` runs it."""
        if self._small(texts):
            return self.encode_plain(texts)
        return await self._run_slices(texts, "plain", "texts", 0)

    @property
    def processes(self) -> int:
        """The worker processes this tokenizer's bulk requests go to (shared with other models)."""
        return self._processes.processes if self._processes is not None else 0

    @property
    def live_processes(self) -> int:
        """Worker processes that take bulk requests now (0: none configured, or given up)."""
        return self._processes.live if self._processes is not None else 0

    @staticmethod
    def _small(texts: Sequence[str]) -> bool:
        return len(texts) <= INLINE_TEXTS and sum(len(t) for t in texts) <= INLINE_CHARS

    async def _run_slices(self, texts: Sequence[str], how: str, field: str, offset: int) -> list[list[int]]:
        procs = self._processes if self.live_processes and sum(map(len, texts)) >= PROCESS_CHARS else None
        starts = self._process_cuts(texts) if procs is not None else range(0, len(texts), self.slice_texts)
        ends = [*starts[1:], len(texts)]
        slices = [list(texts[a:b]) for a, b in zip(starts, ends)]
        parts = await asyncio.gather(*(self._slice(procs, part, how) for part in slices), return_exceptions=True)
        seqs: list[list[int]] = []
        for start, part in zip(starts, parts):
            if isinstance(part, BaseException):
                raise part
            seqs.extend(self._checked(part, how, field, offset + start, texts[start:start + len(part)]))
        return seqs

    def _process_cuts(self, texts: Sequence[str]) -> list[int]:
        """Where the worker processes' slices of `texts` start: every process_slice_chars
        characters or slice_texts texts, whichever comes first."""
        cuts, chars = [0], 0
        for i, text in enumerate(texts, 1):
            chars += len(text)
            if (chars >= self.process_slice_chars or i - cuts[-1] >= self.slice_texts) and i < len(texts):
                cuts.append(i)
                chars = 0
        return cuts

    async def _slice(self, procs: TokenizerProcesses | None, texts: list[str], how: str) -> list[list[int]]:
        if procs is not None:
            seqs, fate = await procs.ids(self._model, texts, how)
            if seqs is not None:
                self.process_slices += 1
                return seqs
            # A worker died, or the pool had been given up: this slice is redone on the threads,
            # so no accepted text is lost.
            self.process_failures += fate != "gone"
            self.process_restarts += fate == "restarted"
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._ids_of, texts, how)

    def truncate_ids(self, ids: Sequence[int]) -> list[int]:
        """Cut pre-tokenized ids to max_tokens at the end, keeping a trailing special token."""
        if len(ids) <= self.max_tokens:
            return list(ids)
        if ids[-1] in self.special_ids:
            return [*ids[:self.max_tokens - 1], ids[-1]]
        return list(ids[:self.max_tokens])

    def close(self) -> None:
        """Stop the worker threads and processes (pending slices finish first)."""
        self._pool.shutdown(wait=True)
        if self._processes is not None:
            self._processes.remove()
            self._processes = None
