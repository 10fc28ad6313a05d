"""What both database adapters' reranking tests share: a sidecar serving a random-weight cross-encoder, and a small corpus."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from benchmarks.models import TINY_RERANKERS, randomize_weights, reranker_model, save_reranker_dir


@dataclass(frozen=True)
class RerankSidecar:
    """A sidecar serving the bundled embedder (default) and `model`, a cross-encoder; `corpus` (name ->
    text) and `query` for a search whose top rows the cross-encoder reorders."""

    target: str
    model: str
    corpus: dict[str, str]
    query: str


CORPUS = {
    "laptop": "My laptop will not turn on and the display stays dark after I press power.",
    "zorblax": "Zorblax is the codename of the new line of ceramic garden gnomes.",
    "cat": "The cat sat quietly on the warm windowsill all afternoon.",
    "garden": "Tomatoes need plenty of sunlight and regular watering to ripen.",
    "train": "The night train from Vienna to Venice crosses the Alps.",
    "screen": "A black screen at boot often means the graphics driver failed to load.",
    "battery": "Replace the battery if the computer shuts down right after it starts.",
    "music": "The orchestra rehearsed the symphony's final movement twice.",
}


@pytest.fixture(scope="module")
def rerank_sidecar(sidecar_factory, tmp_path_factory) -> Iterator[RerankSidecar]:
    torch.manual_seed(5)
    hf = reranker_model(TINY_RERANKERS["bert"]).eval()
    randomize_weights(hf, 5)
    path = save_reranker_dir(hf, tmp_path_factory.mktemp("reranker") / "test-reranker")
    process = sidecar_factory("--model", "default", "--model", f"test-reranker={path}")
    yield RerankSidecar(process.target, "test-reranker", CORPUS, "computer won't boot, black screen (zorblax)")
    process.stop()
