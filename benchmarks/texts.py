"""Synthetic benchmark texts with controlled token counts (queries, passages, long documents), seeded.

The words follow English's shape rather than a short list: drawn by Zipf's law (Mandelbrot's
form, rank r weighted 1/(r + 2.7)) from the tokenizer's own whole words in its vocabulary's
order, which for BERT's WordPiece is by frequency ("the", "of", "and", ...: 21,720 words for
all-MiniLM-L6-v2); sentences of 6-24 words with a capital first, commas, full stops, question
marks, numbers, and some capitalized words mid-sentence. So a text's chunks are as varied as
prose's: a tokenizer's chunk memo misses on the rare words, as it would on real text, instead of
learning a 200-word list once. A tokenizer with no such vocabulary
gets the 200-word list.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate
from pathlib import Path

from tokenizers import Tokenizer

# The fallback word list, for a tokenizer whose vocabulary has too few whole words.
_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but "
    "have an they you were her she there been one all we their has would when what if will more no "
    "out do so can who about up said into them some could time these two may first then its only "
    "other new like also after over such most made even many where before must through back years "
    "much way well down should because each just those people how too little state good very make "
    "world still own see men work long get here between both life being under never day same another "
    "know while last might us great old year off come since against go came right used take three "
    "vector database index query search embedding model token batch graph kernel memory latency "
    "throughput cosine similarity neural network sentence postgres qdrant sidecar engine scheduler "
    "river mountain ocean forest city music painting history science language market energy water"
).split()
_MIN_VOCABULARY = 1000
VOCABULARIES = ("zipf", "words")


@lru_cache(maxsize=8)
def _vocabulary(config: str) -> tuple[list[str], list[float]]:
    """Whole lowercase words of a tokenizer's vocabulary in id order, and Zipf cumulative weights."""
    tok = Tokenizer.from_str(config)
    vocab = sorted(tok.get_vocab().items(), key=lambda item: item[1])
    words = [w for w, _ in vocab if re.fullmatch(r"[a-z]{2,}|a", w)]
    if len(words) < _MIN_VOCABULARY:
        words = _WORDS
    return words, list(accumulate(1.0 / (rank + 2.7) for rank in range(len(words))))


def _draft(rng: random.Random, words: list[str], weights: list[float], count: int) -> str:
    """`count` words of prose-shaped text: one uniform draw a word picks a number (2 %), a capital
    mid-sentence (4 %) or a comma after it (7 %)."""
    drawn = rng.choices(words, cum_weights=weights, k=count)
    out, left = [], 0
    for word, mark in zip(drawn, [rng.random() for _ in range(count)]):
        if mark < 0.02:
            word = str(rng.choice((rng.randint(0, 99), rng.randint(1800, 2030), rng.randint(100, 99999))))
        if left == 0:
            left = rng.randint(6, 24)
            word = word.capitalize()
        elif mark < 0.06:
            word = word.capitalize()
        left -= 1
        if left == 0:
            word += rng.choice("........?!")
        elif 0.06 <= mark < 0.13:
            word += ","
        out.append(word)
    return " ".join(out)


@dataclass(frozen=True)
class Workload:
    """A named set of texts whose token counts fall in [low, high] (special tokens included)."""

    name: str
    low: int
    high: int
    count: int


def make_texts(tokenizer: Tokenizer | str | Path, lengths: list[int], seed: int = 0,
               vocabulary: str = "zipf") -> list[str]:
    """One text per requested length; each tokenizes to that many tokens with specials.

    `vocabulary` "words" draws from the 200-word list evenly
    (lowercase, no punctuation), to compare with results on such texts."""
    if vocabulary not in VOCABULARIES:
        raise ValueError(f"vocabulary must be one of {VOCABULARIES}, got {vocabulary!r}")
    if not isinstance(tokenizer, Tokenizer):
        tokenizer = Tokenizer.from_file(str(tokenizer))
    tok = Tokenizer.from_str(tokenizer.to_str())
    tok.no_padding()
    tok.no_truncation()
    rng = random.Random(seed)
    specials = len(tok.encode("", add_special_tokens=True).ids)
    if vocabulary == "words":
        drafts = [" ".join(rng.choice(_WORDS) for _ in range(max(1, n))) for n in lengths]
    else:
        words, weights = _vocabulary(tok.to_str())
        drafts = [_draft(rng, words, weights, max(1, n)) for n in lengths]
    texts = []
    # Cut each draft at the end of its (n - specials)th token: WordPiece keeps the pieces
    # before a cut between two of a word's pieces, so the text has exactly that many tokens.
    for draft, n, encoding in zip(drafts, lengths, tok.encode_batch(drafts, add_special_tokens=False)):
        keep = min(max(1, n - specials), len(encoding.offsets))
        texts.append(draft[:encoding.offsets[keep - 1][1]])
    return texts


def workload_texts(tokenizer: Tokenizer | str | Path, workload: Workload, seed: int = 0,
                   vocabulary: str = "zipf") -> list[str]:
    """`workload.count` texts with lengths uniform in [low, high] (drawn once per tokenizer,
    workload, seed and vocabulary in a process: the benchmark's models share one tokenizer)."""
    config = tokenizer.to_str() if isinstance(tokenizer, Tokenizer) else Path(tokenizer).read_text()
    return list(_workload_texts(config, workload, seed, vocabulary))


@lru_cache(maxsize=32)
def _workload_texts(config: str, workload: Workload, seed: int, vocabulary: str) -> tuple[str, ...]:
    rng = random.Random(seed)
    lengths = [rng.randint(workload.low, workload.high) for _ in range(workload.count)]
    return tuple(make_texts(Tokenizer.from_str(config), lengths, seed=seed + 1, vocabulary=vocabulary))
