"""Each model family, built from seeded random weights, equals transformers on the same weights (fp32, CPU)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import BertConfig, BertModel, Qwen3Config, Qwen3Model, XLMRobertaConfig, XLMRobertaModel

from core_engine.attention import get_backend
from core_engine.batch import model_inputs, pack
from core_engine.config import ModelSpec, load_spec
from core_engine.loader import build_model

POOLING_FLAGS = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token", "last": "pooling_mode_lasttoken"}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Replace every weight with seeded noise (norm scales near 1), so no mix-up can hide."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() and name.endswith("weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))


def save_model_dir(
    path: Path, model: torch.nn.Module, pooling: str, prefix: str = "", fern: dict | None = None, normalize: bool = False
) -> Path:
    """A Hugging Face + sentence-transformers layout directory for ``model``."""
    path.mkdir(parents=True, exist_ok=True)
    model.config.to_json_file(path / "config.json")
    save_file({prefix + k: v.contiguous() for k, v in model.state_dict().items()}, path / "model.safetensors")
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    flags = {flag: mode == pooling for mode, flag in POOLING_FLAGS.items()}
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": model.config.hidden_size, **flags}))
    (path / "tokenizer.json").write_text(json.dumps({"version": "1.0", "post_processor": None}))
    if fern is not None:
        (path / "fern.json").write_text(json.dumps(fern))
    return path


def random_sequences(seed: int, vocab: int, low: int = 3, count: int = 9) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = [1, 2, 40, 7, 1, 23, 64, 3, 15][:count]
    return [rng.integers(low, vocab, size=n).tolist() for n in lengths]


def fern_vectors(spec: ModelSpec, seqs: list[list[int]]) -> np.ndarray:
    model = build_model(spec, torch.device("cpu"), torch.float32, get_backend("cpu"))
    with torch.inference_mode():
        return model(*model_inputs(*pack(seqs), spec.causal)).numpy()


def reference_vectors(hf: torch.nn.Module, seqs: list[list[int]], pooling: str) -> np.ndarray:
    """transformers, one unpadded sequence at a time, pooled like sentence-transformers."""
    out = []
    with torch.inference_mode():
        for s in seqs:
            h = hf(input_ids=torch.tensor([s])).last_hidden_state[0]
            out.append({"mean": h.mean(0), "cls": h[0], "last": h[-1]}[pooling])
    return torch.stack(out).numpy()


def assert_parity(ours: np.ndarray, ref: np.ndarray, threshold: float = 0.99999) -> None:
    assert ours.shape == ref.shape
    cos = (ours * ref).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(ref, axis=1))
    assert cos.min() >= threshold, f"cosines {cos}"
    np.testing.assert_allclose(ours, ref, rtol=1e-3, atol=1e-4)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_bert_matches_transformers(tmp_path: Path, pooling: str) -> None:
    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=128,
    )
    hf = BertModel(cfg, add_pooling_layer=False).eval()
    randomize(hf, 1)
    spec = load_spec(save_model_dir(tmp_path / "bert", hf, pooling, prefix="bert.", normalize=True))
    assert (spec.family, spec.pooling, spec.normalize, spec.position_offset) == ("bert", pooling, True, 0)
    seqs = random_sequences(2, cfg.vocab_size)
    assert_parity(fern_vectors(spec, seqs), reference_vectors(hf, seqs, pooling))


def test_xlm_roberta_matches_transformers_and_needs_its_position_offset(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = XLMRobertaConfig(
        vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=130, pad_token_id=1, type_vocab_size=1,
    )
    hf = XLMRobertaModel(cfg, add_pooling_layer=False).eval()
    randomize(hf, 3)
    spec = load_spec(save_model_dir(tmp_path / "xlmr", hf, "cls", prefix="roberta."))
    assert (spec.family, spec.position_offset, spec.max_tokens) == ("xlm-roberta", 2, 128)
    seqs = random_sequences(4, cfg.vocab_size)  # ids >= 3: no pad token inside a sequence
    ref = reference_vectors(hf, seqs, "cls")
    assert_parity(fern_vectors(spec, seqs), ref)
    # The same weights read with BERT's positions (no offset) must not pass: the offset matters.
    wrong = fern_vectors(dataclasses.replace(spec, position_offset=0), seqs)
    assert cosines(wrong, ref).min() < 0.999


def qwen3_config(heads: int, kv_heads: int, head_dim: int, bias: bool = False) -> Qwen3Config:
    cfg = Qwen3Config(
        vocab_size=400, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-6, eos_token_id=399,
        attention_bias=bias,
    )
    cfg._attn_implementation = "eager"
    return cfg


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "bias"),
                         [(4, 2, 32, False), (4, 4, 16, False), (4, 2, 32, True)])
def test_qwen3_causal_last_token_matches_transformers(tmp_path: Path, heads: int, kv_heads: int, head_dim: int,
                                                      bias: bool) -> None:
    # bias: attention_bias=True, biases on q/k/v/o (then the out projection is a plain nn.Linear)
    torch.manual_seed(0)
    hf = Qwen3Model(qwen3_config(heads, kv_heads, head_dim, bias)).eval()
    randomize(hf, 5)
    spec = load_spec(save_model_dir(tmp_path / "qwen3", hf, "last"))
    assert (spec.family, spec.causal, spec.pooling, spec.native_int8) == ("qwen3", True, "last", False)
    # Qwen3-Embedding: the tokenizer here does not add EOS, so the gateway must append it.
    assert spec.append_eos and spec.eos_token_id == 399
    seqs = random_sequences(6, 400)
    assert_parity(fern_vectors(spec, seqs), reference_vectors(hf, seqs, "last"))


@pytest.mark.parametrize("prefix", ["", "model."])
def test_qwen3_bidirectional_mean_matches_transformers(tmp_path: Path, prefix: str) -> None:
    torch.manual_seed(0)
    cfg = qwen3_config(heads=4, kv_heads=2, head_dim=32)
    hf = Qwen3Model(cfg).eval()
    randomize(hf, 7)
    fern = {"causal": False, "pooling": "mean", "native_int8": True}
    spec = load_spec(save_model_dir(tmp_path / "pplx", hf, "mean", prefix=prefix, fern=fern))
    assert (spec.causal, spec.pooling, spec.native_int8, spec.append_eos) == (False, "mean", True, False)

    bidirectional = Qwen3Model(qwen3_config(heads=4, kv_heads=2, head_dim=32)).eval()
    bidirectional.config.is_causal = False
    bidirectional.load_state_dict(hf.state_dict())
    # Check the reference really is bidirectional: the last token changes the first one's state.
    with torch.inference_mode():
        a = bidirectional(input_ids=torch.tensor([[5, 6, 7, 8]])).last_hidden_state[0, 0]
        b = bidirectional(input_ids=torch.tensor([[5, 6, 7, 9]])).last_hidden_state[0, 0]
        c = hf(input_ids=torch.tensor([[5, 6, 7, 9]])).last_hidden_state[0, 0]
        d = hf(input_ids=torch.tensor([[5, 6, 7, 8]])).last_hidden_state[0, 0]
    assert not torch.allclose(a, b) and torch.equal(c, d)

    seqs = random_sequences(8, 400)
    ref = reference_vectors(bidirectional, seqs, "mean")
    ours = fern_vectors(spec, seqs)
    assert_parity(ours, ref)
    # And the causal reading of the same weights differs (the flag is not ignored).
    causal = fern_vectors(dataclasses.replace(spec, causal=True), seqs)
    assert cosines(causal[[2, 5, 6]], ref[[2, 5, 6]]).max() < 0.999
