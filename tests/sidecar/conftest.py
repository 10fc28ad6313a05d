"""Fixtures for the sidecar tests: varied texts and the sentence-transformers reference."""

from __future__ import annotations

import random

import pytest


def varied_texts() -> list[str]:
    """Over 200 texts: short, long past the 256-token limit, multilingual, emoji, whitespace around words, code."""
    rng = random.Random(20261129)
    fixed = [
        "hello", "Hello, world!", "a", "I", "ok", "?", "...",
        " a", "   b   ", "\tc", "\n\nd\n", " \t\n e ", "\u00a0\u2003f",
        "The quick brown fox jumps over the lazy dog.",
        "What is the capital of France?",
        "café naïve résumé façade jalapeño straße",
        "東京は日本の首都です。", "我喜欢用向量数据库做语义搜索。", "한국어 문장도 임베딩할 수 있습니다.",
        "مرحبا بالعالم، هذا نص عربي.", "שלום עולם", "Привет, мир! Это проверка.",
        "Γειά σου κόσμε", "नमस्ते दुनिया", "สวัสดีชาวโลก", "Xin chào thế giới",
        "😀", "🚀🎉👍🏽", "I ❤️ embeddings 🤖", "👨‍👩‍👧‍👦 family emoji",
        "def f(x):\n    return x * 2\n", "SELECT id FROM t WHERE v <=> $1 LIMIT 10;",
        "for (int i = 0; i < n; ++i) { sum += a[i]; }", "{\"key\": [1, 2, 3], \"ok\": true}",
        "https://example.com/path?q=vector+search&x=1", "user@example.com", "3.14159 2.71828 1e-9",
        "UPPER lower MiXeD CaSe", "tab\tseparated\tvalues", "   leading and trailing spaces   ",
    ]
    paragraph = ("Embedding models map text to dense vectors so that similar meanings land close "
                 "together, and a database can search them by distance. ")
    long = [
        paragraph * 8, paragraph * 25, "word " * 254, "word " * 255, "word " * 256, "word " * 400,
        "東京は日本の首都です。" * 60, "Привет, мир! " * 120, "😀🚀🎉 " * 150,
        "def f(x):\n    return x * 2\n" * 40, " ".join(str(i) for i in range(500)),
    ]
    vocab = ("data vector search index query table row column model token batch graph memory "
             "latency cosine neural embedding sentence postgres qdrant sidecar engine lane "
             "apple river mountain ocean forest city music history").split()
    extras = ["東京", "мир", "café", "😀", "عربي", "λόγος", "x = y + 1;", "#include <stdio.h>"]
    generated = []
    for i in range(170):
        n = rng.choice([1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 320])
        words = [rng.choice(vocab) for _ in range(n)]
        if i % 3 == 0:
            words.insert(rng.randrange(len(words) + 1), rng.choice(extras))
        generated.append(rng.choice([" ", ", ", "\n", "  "]).join(words) + rng.choice([".", "?", ""]))
    return fixed + long + generated


@pytest.fixture(scope="session")
def texts() -> list[str]:
    out = varied_texts()
    assert len(out) >= 200
    return out


@pytest.fixture(scope="session")
def st_model():
    """sentence-transformers on the same bundled weights: the independent reference."""
    import torch
    from sentence_transformers import SentenceTransformer

    from core_engine.loader import default_model_dir

    torch.set_num_threads(2)
    return SentenceTransformer(str(default_model_dir()), device="cpu")
