"""The ASCII twin: a BERT tokenizer's copy that gives its ids on printable ASCII at a fraction of the cost.

A BertNormalizer (control-character cleanup, CJK spacing, NFD accent stripping, lowercasing)
followed by a BertPreTokenizer (split on whitespace and Unicode punctuation) reduces, on ASCII
made of printable characters, tabs and line breaks, to: lowercase, then keep the runs of letters
and digits and every other non-blank character on its own. The twin does exactly that, with
Python's `str.lower` (a C loop over ASCII, cheaper than Rust's normalizer and its alignment
bookkeeping) and a one-regex `Split` pre-tokenizer, and no normalizer at all. Texts holding an
added token's text ("[CLS]" typed by a user), or anything else, go through the shipped pipeline.
"""

from __future__ import annotations

import json
import re

from tokenizers import Tokenizer

from sidecar.tokenize.rust import encode_ids

# On ASCII, BertNormalizer's clean-up removes control characters other than tab and line
# breaks (which the pre-tokenizer splits on like spaces); a text with one takes the full path.
# The check deletes these bytes and looks for leftovers: a C loop, faster than a regex or
# str.isprintable, which matters since it runs under the GIL on every batch.
ASCII_TEXT = bytes(range(0x20, 0x7F)) + b"\t\n\r"

# BertPreTokenizer on lowercased ASCII: runs of letters and digits, and every other
# non-blank character (all of ASCII's are Unicode punctuation) on its own.
ASCII_WORDS = r"[a-z0-9]+|[^a-z0-9 \t\n\r]"

# A text the twin truncates is first cut, at a space, to this many characters per token of
# the limit (English runs 4-5 per token): its head alone is tokenized. When the head fills
# the limit, its ids are the whole text's (the same words make the same tokens, and
# truncation keeps only the first ones); when it falls short, the whole text is redone.
CUT_CHARS_PER_TOKEN = 6

# Texts per joined string: the twin tokenizes "[CLS] a [SEP] [CLS] b [SEP] ..." as one input and
# splits the ids at each [SEP], since each text otherwise costs an Encoding object built in
# Rust and then read and freed in Python under the GIL, the share that stays serial.
JOIN_TEXTS = 16


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


class AsciiTwin:
    """A copy of a BERT tokenizer for lowercased ASCII text: no normalizer, a one-regex
    pre-tokenizer, the same model, added tokens, post-processor and truncation.

    `rust_threads` is the size of Rust's thread pool: a batch is joined into fewer inputs
    only while each of those threads still gets two of them, so a small batch keeps its latency.
    """

    def __init__(self, tokenizer: Tokenizer, rust_threads: int) -> None:
        config = json.loads(tokenizer.to_str())
        config["normalizer"] = None
        config["pre_tokenizer"] = {"type": "Split", "pattern": {"Regex": ASCII_WORDS},
                                   "behavior": "Removed", "invert": True}
        self.tokenizer = Tokenizer.from_str(json.dumps(config))
        self.rust_threads = rust_threads
        # TextTokenizer truncates at the right with no stride, which the cut in `encode` relies on.
        self.limit: int | None = (config.get("truncation") or {}).get("max_length")
        self.joint = _joint(config)
        config["truncation"] = None
        self.untruncated = Tokenizer.from_str(json.dumps(config))
        # A text holding an added token's text must see the shipped pipeline, which matches
        # it before normalizing (case-sensitive) or after (lowercased): either way not here.
        contents = sorted({t["content"] for t in config.get("added_tokens") or []}, key=len, reverse=True)
        self._added = re.compile("|".join(map(re.escape, contents)), re.IGNORECASE) if contents else None
        # First characters of added tokens, either case: a text with none of them holds none.
        self._added_starts = tuple({f(c[0]) for c in contents for f in (str.lower, str.upper)})

    @staticmethod
    def of(tokenizer: Tokenizer, rust_threads: int) -> "AsciiTwin | None":
        """The twin of `tokenizer`, or None unless it is a lowercasing BertNormalizer
        followed by a BertPreTokenizer (where the twin's ids are provably the same)."""
        config = json.loads(tokenizer.to_str())
        normalizer = config.get("normalizer") or {}
        pre = config.get("pre_tokenizer") or {}
        if (normalizer.get("type") != "BertNormalizer" or not normalizer.get("lowercase")
                or pre.get("type") != "BertPreTokenizer"):
            return None
        return AsciiTwin(tokenizer, rust_threads)

    def encode(self, texts: list[str], special: bool) -> list[list[int]]:
        """Ids of texts that `fits` accepts, as the shipped pipeline gives them."""
        lowered = [t.lower() for t in texts]
        if self.limit is None:
            return self._encode(lowered, special)
        chars = self.limit * CUT_CHARS_PER_TOKEN
        heads = [t if len(t) <= chars else _head(t, chars) for t in lowered]
        seqs = self._encode(heads, special)
        short = [i for i, (t, h, ids) in enumerate(zip(lowered, heads, seqs))
                 if h is not t and len(ids) < self.limit]
        for i, ids in zip(short, self._encode([lowered[i] for i in short], special)):
            seqs[i] = ids
        return seqs

    def _encode(self, lowered: list[str], special: bool) -> list[list[int]]:
        group = min(JOIN_TEXTS, len(lowered) // (2 * self.rust_threads))
        if not special or self.joint is None or group < 2:
            return encode_ids(self.tokenizer, lowered, special)
        joint, sep = self.joint
        limit = self.limit
        seqs: list[list[int]] = []
        for ids in encode_ids(self.untruncated, [joint.join(lowered[i:i + group])
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
        if not text.isascii() or text.encode("ascii").translate(None, ASCII_TEXT):
            return False
        return not (any(c in text for c in self._added_starts) and self._added.search(text))
