"""Thin helpers over the Rust `tokenizers` bindings that every tokenizing path shares."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer


def load(tokenizer_path: str | Path, truncate_at: int | None = None) -> Tokenizer:
    """A tokenizer.json without padding (packed batches need none), truncating at `truncate_at`."""
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    tokenizer.no_padding()
    if truncate_at is None:
        tokenizer.no_truncation()
    else:
        tokenizer.enable_truncation(truncate_at)
    return tokenizer


def encode_ids(tokenizer: Tokenizer, texts: list[str], special: bool) -> list[list[int]]:
    """Each text's ids; `encode_batch_fast` (tokenizers >= 0.21) skips the offsets Fern never reads."""
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    return [e.ids for e in encode(texts, add_special_tokens=special)]


def fixed_specials(tokenizer: Tokenizer) -> tuple[list[int], list[int], list[int]] | None:
    """The special ids the post-processor puts before and after a text's ids, and the plain ids of
    "a" it was probed with; None when its output is not fixed tokens around the text's ids."""
    specials = tokenizer.encode("", add_special_tokens=True).ids
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    full = tokenizer.encode("a", add_special_tokens=True).ids
    cuts = [k for k in range(len(specials) + 1) if full == [*specials[:k], *plain, *specials[k:]]]
    if len(cuts) != 1:
        return None
    return specials[:cuts[0]], specials[cuts[0]:], plain
