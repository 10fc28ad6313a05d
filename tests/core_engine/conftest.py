"""Shared fixtures for the engine-model tests: the bundled model, its reference, and varied texts."""

from __future__ import annotations

import random

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _one_thread() -> None:
    # One intra-op thread: on a small machine shared with other suites, OpenMP threads spin
    # while waiting for a busy core; measured here, 2 threads cost 3-10x the CPU time of 1
    # for the same forward passes, and were slower in wall time too.
    torch.set_num_threads(1)


def _varied_texts() -> list[str]:
    rng = random.Random(1234)
    base = [
        "hello",
        "Hello, world!",
        "The quick brown fox jumps over the lazy dog.",
        "Vector databases store embeddings next to rows.",
        "What is the capital of France?",
        "a",
        "I",
        "ok",
        "",
        " ",
        "   ",
        "\t",
        "\n\n\n",
        " \t \n ",
        "\u00a0\u2003",
        "café naïve résumé façade jalapeño über straße",
        "Ångström, Øresund, Łódź, Ærøskøbing",
        "Crème brûlée à la carte, s'il vous plaît.",
        "東京は日本の首都です。",
        "我喜欢用向量数据库做语义搜索。",
        "한국어 문장도 임베딩할 수 있습니다.",
        "日本語とEnglishが混ざった文章",
        "مرحبا بالعالم، هذا نص عربي للاختبار.",
        "שלום עולם",
        "Привет, мир! Это проверка кириллицы.",
        "Съешь же ещё этих мягких французских булок, да выпей чаю.",
        "Γειά σου κόσμε",
        "नमस्ते दुनिया, यह एक परीक्षण है।",
        "สวัสดีชาวโลก",
        "Tiếng Việt có dấu: Xin chào thế giới",
        "😀",
        "🚀🚀🚀 launch day 🎉",
        "I ❤️ embeddings 👩‍💻👨‍👩‍👧‍👦",
        "🏳️‍🌈 flags 🇫🇷🇯🇵🇺🇸",
        "def add(a, b):\n    return a + b\n",
        "SELECT id, embedding <=> $1 AS d FROM items ORDER BY d LIMIT 10;",
        "for (int i = 0; i < n; ++i) { sum += x[i] * y[i]; }",
        "const f = async (x) => { await fetch(`/api/${x}`); };",
        "#include <stdio.h>\nint main(void) { printf(\"hi\\n\"); return 0; }",
        "{\"key\": [1, 2, 3], \"nested\": {\"a\": null, \"b\": true}}",
        "https://example.com/path/to/page?query=vector&lang=en#section-2",
        "http://user:pass@192.168.0.1:8080/a/b/c.html",
        "mailto:someone@example.org",
        "ftp://files.example.net/pub/README.txt",
        "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
        "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!",
        "ha" * 300,
        "a" * 2000,
        "x " * 700,
        "123 456 7890 3.14159 2.71828 1e-10 0xDEADBEEF",
        "$$$ €€€ £££ ¥¥¥ ₹₹₹",
        "∀x ∈ ℝ, ∃y : x² + y² = 1",
        "Line one\nLine two\r\nLine three\tTabbed",
        "MiXeD CaSe TeXt WiTh CAPS",
        "<html><body><p>Hello</p></body></html>",
        "[CLS] [SEP] [PAD] [MASK] [UNK]",
        "don't won't can't shouldn't y'all'd've",
        "e.g. i.e. etc. vs. Mr. Mrs. Dr.",
    ]
    paragraph = (
        "Embedding models map text to dense vectors so that similar meanings land close "
        "together. Serving them next to a database means every insert and every search "
        "needs a vector, and the latency of that step adds to each query. "
    )
    long_texts = [
        paragraph * 6,
        paragraph * 20,
        ("Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 60),
        "東京は日本の首都です。" * 80,
        "Привет, мир! " * 150,
        "مرحبا بالعالم " * 150,
        "😀🚀🎉 " * 200,
        "def f(x):\n    return x * 2\n" * 40,
        " ".join(str(i) for i in range(600)),
        "word " * 255,
        "word " * 254,
        "word " * 256,
    ]
    vocab = (
        "data vector search index query table row column model token batch graph kernel "
        "memory latency throughput cosine similarity neural network embedding sentence "
        "database postgres qdrant sidecar engine scheduler lane stream client server "
        "apple banana cherry river mountain ocean forest city music painting history"
    ).split()
    generated = []
    for i in range(150):
        # Mostly query/passage lengths; every 15th runs past the 256-token limit.
        n = 300 if i % 15 == 0 else rng.choice([1, 2, 3, 5, 8, 13, 21, 34, 55, 89])
        words = [rng.choice(vocab) for _ in range(n)]
        if i % 3 == 0:
            words.insert(rng.randrange(len(words) + 1), rng.choice(["東京", "мир", "café", "😀", "عربي", "https://x.io/a?b=c"]))
        sep = rng.choice([" ", " ", ", ", "  ", "\n"])
        text = sep.join(words)
        generated.append(text.capitalize() + rng.choice([".", "?", "!", ""]))
    return base + long_texts + generated


@pytest.fixture(scope="session")
def varied_texts() -> list[str]:
    """At least 200 texts: short, long past 256 tokens, multilingual, emoji, whitespace, code, URLs."""
    texts = _varied_texts()
    assert len(texts) >= 200
    return texts
