"""Synthetic benchmark texts with controlled token counts (queries, passages, long documents), seeded."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

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


@dataclass(frozen=True)
class Workload:
    """A named set of texts whose token counts fall in [low, high] (special tokens included)."""

    name: str
    low: int
    high: int
    count: int


def make_texts(tokenizer: Tokenizer | str | Path, lengths: list[int], seed: int = 0) -> list[str]:
    """One text per requested length; each tokenizes to about that many tokens with specials."""
    if not isinstance(tokenizer, Tokenizer):
        tokenizer = Tokenizer.from_file(str(tokenizer))
    tok = Tokenizer.from_str(tokenizer.to_str())
    tok.no_padding()
    tok.no_truncation()
    rng = random.Random(seed)
    specials = len(tok.encode("", add_special_tokens=True).ids)
    drafts = [" ".join(rng.choice(_WORDS) for _ in range(max(1, n))) for n in lengths]
    encoded = tok.encode_batch_fast(drafts, add_special_tokens=False)
    return [tok.decode(e.ids[: max(1, n - specials)]) for e, n in zip(encoded, lengths)]


def workload_texts(tokenizer: Tokenizer | str | Path, workload: Workload, seed: int = 0) -> list[str]:
    """`workload.count` texts with lengths uniform in [low, high]."""
    rng = random.Random(seed)
    lengths = [rng.randint(workload.low, workload.high) for _ in range(workload.count)]
    return make_texts(tokenizer, lengths, seed=seed + 1)
