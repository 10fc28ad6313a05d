"""Batch tokenization for the gateway: texts to the ids tokenizer.json gives, off the event loop.

`tokenizer` is the façade the gateway holds (TextTokenizer); `core` one model's synchronous
tokenization; `pool` the worker processes for bulk requests; `ascii` the BERT tokenizers' ASCII
twin; `memo` the chunk memo queries are tokenized from; `wordpiece` WordPiece in Python for the
memo's misses; `windows` the cutting of long texts; `rust` helpers over the `tokenizers` bindings.
"""

from sidecar.tokenize.ascii import CUT_CHARS_PER_TOKEN, JOIN_TEXTS, AsciiTwin
from sidecar.tokenize.core import INLINE_CHARS, INLINE_TEXTS, TokenizerCore, query_sized
from sidecar.tokenize.memo import MEMO_CHUNK_CHARS, MEMO_CHUNKS, MEMO_LEARN_CHUNKS, ChunkMemo
from sidecar.tokenize.pool import (PROCESS_CHARS, PROCESS_SLICE_CHARS, TokenizerProcesses, WorkerModel,
                                   default_process_threads, default_processes)
from sidecar.tokenize.tokenizer import SLICE_TEXTS, TextTokenizer, default_workers
from sidecar.tokenize.windows import LONG_TEXT_CHARS, LONG_WINDOW_CHARS, SPARSE_MAX_TOKENS, Windows
from sidecar.tokenize.wordpiece import WordPiece

__all__ = [
    "CUT_CHARS_PER_TOKEN", "INLINE_CHARS", "INLINE_TEXTS", "JOIN_TEXTS", "LONG_TEXT_CHARS",
    "LONG_WINDOW_CHARS", "MEMO_CHUNKS", "MEMO_CHUNK_CHARS", "MEMO_LEARN_CHUNKS", "PROCESS_CHARS",
    "PROCESS_SLICE_CHARS", "SLICE_TEXTS", "SPARSE_MAX_TOKENS", "AsciiTwin", "ChunkMemo", "TextTokenizer",
    "TokenizerCore", "TokenizerProcesses", "Windows", "WordPiece", "WorkerModel", "default_process_threads",
    "default_processes", "default_workers", "query_sized",
]
