"""GPU parity of the cross-encoders: bf16 scores through eager, captured and replayed steps against transformers fp32."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.models import TINY_RERANKERS, randomize_weights, reranker_model, save_reranker_dir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

QUERY = "which engine reranks search results on a GPU?"
DOCUMENTS = [f"document {i}: " + "packed cross-encoder steps score query and document pairs " * (1 + i % 7)
             for i in range(24)]


@pytest.mark.parametrize("family", ["bert", "xlm-roberta"])
def test_bf16_scores_match_transformers_through_graph_replay(tmp_path: Path, family: str) -> None:
    from core_engine.engine import Engine
    from sidecar.tokenize.pairs import PairTokenizer

    torch.manual_seed(3)
    hf = reranker_model(TINY_RERANKERS[family]).eval()
    randomize_weights(hf, 3)
    path = save_reranker_dir(hf, tmp_path / family)  # the bundled MiniLM tokenizer: BERT's pair layout
    hf = hf.to("cuda", torch.float32)
    engine = Engine(path, device="cuda")
    assert engine.dtype == torch.bfloat16
    sequences = PairTokenizer.for_spec(engine.spec).encode(QUERY, DOCUMENTS)
    vocab = engine.spec.vocab_size
    ref = []
    with torch.inference_mode():
        for s in sequences:
            ids = torch.tensor([[t % vocab for t in s]], device="cuda")
            types = torch.tensor([[int(t >= vocab) for t in s]], device="cuda")
            if engine.spec.token_types == 1:
                types = torch.zeros_like(types)
            ref.append(hf(input_ids=ids, token_type_ids=types).logits[0, 0].item())
    ref = np.asarray(ref, dtype=np.float32)
    runs = [engine.score(sequences) for _ in range(3)]  # eager, capture, replay
    c = engine.counters
    assert (c.eager_runs, c.captures, c.replays) == (1, 1, 1)
    # 1e-2 of the logits' scale, floored at 1 (bf16 keeps about 3 significant digits, so logits
    # near zero are held to 1e-2 absolute).
    tolerance = 1e-2 * max(1.0, float(np.abs(ref).max()))
    for scores in runs:
        assert np.abs(scores - ref).max() <= tolerance
    np.testing.assert_array_equal(runs[1], runs[2])
