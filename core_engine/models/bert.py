"""The BERT encoder family (MiniLM, BGE, E5, GTE) and XLM-RoBERTa (BGE-M3) over packed tokens.

XLM-RoBERTa is the same network; it differs in its position ids, which start at
``pad_token_id + 1``. The loader drops the first ``position_offset`` rows of the
position table, so this model always takes 0-based positions. Token types are not
used by embedding inputs (all zero), so the type-0 embedding is folded into the
position table at load time.

``BertScorer`` is the cross-encoder (``BertForSequenceClassification``,
``XLMRobertaForSequenceClassification`` with one label): the same encoder over one packed
(query, document) sequence per slot, then a head on the first token, dense + tanh + a
projection to the score (BERT's pooler and classifier; XLM-R's ``classifier.dense`` and
``classifier.out_proj``). A token of type 1 arrives as ``id + vocab_size``; the model
adds the difference of the two type embeddings to it, so the packed inputs stay one id
stream and no other part of the engine knows token types exist.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from core_engine.attention.base import AttentionBackend, AttentionMetadata
from core_engine.config import ModelSpec
from core_engine.heads import TokenHeads
from core_engine.layers.embedding import Embedding
from core_engine.layers.linear import QKVLinear, fuse_rows
from core_engine.layers.mlp import DenseMLP
from core_engine.layers.norm import LayerNorm
from core_engine.pooling import Pooler
from core_engine.settings import KernelOptions


class BertLayer(nn.Module):
    """Post-norm transformer block: x = LN(x + attn(x)); x = LN(x + mlp(x))."""

    def __init__(self, cfg: dict[str, Any], attention: AttentionBackend, kernels: KernelOptions) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        eps = cfg.get("layer_norm_eps", 1e-12)
        self.qkv = QKVLinear(hidden, heads, heads, hidden // heads, bias=True)
        self.out = nn.Linear(hidden, hidden)
        self.attn_norm = LayerNorm(hidden, eps=eps)
        self.mlp = DenseMLP(hidden, cfg["intermediate_size"], cfg.get("hidden_act", "gelu"), kernels.gelu_epilogue)
        self.mlp_norm = LayerNorm(hidden, eps=eps)
        self.attention = attention

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, rows: torch.Tensor | None = None) -> torch.Tensor:
        """[T, H] -> [T, H]; with ``rows`` (indices into T), only those rows go on after attention: [len(rows), H]."""
        q, k, v = self.qkv(x)
        a = self.attention(q, k, v, meta).reshape(x.shape[0], -1)
        if rows is not None:
            a, x = a.index_select(0, rows), x.index_select(0, rows)
        x = self.attn_norm(x + self.out(a))
        return self.mlp_norm(x + self.mlp(x))


class _BertStack(nn.Module):
    """What the encoder and the cross-encoder share: the word and position embeddings, their
    norm and the N post-norm layers (the last of which may keep only some rows)."""

    def __init__(self, spec: ModelSpec, attention: AttentionBackend, kernels: KernelOptions) -> None:
        super().__init__()
        cfg = spec.config
        hidden = cfg["hidden_size"]
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(
                f"{spec.path}: position_embedding_type {cfg['position_embedding_type']!r} is not supported "
                "(only 'absolute')"
            )
        self.vocab_size = int(cfg["vocab_size"])
        self.word_embeddings = Embedding(self.vocab_size, hidden)
        # Position rows from position_offset on, with the token-type-0 vector already added.
        self.position_embeddings = Embedding(cfg["max_position_embeddings"] - spec.position_offset, hidden)
        self.embed_norm = LayerNorm(hidden, eps=cfg.get("layer_norm_eps", 1e-12))
        self.layers = nn.ModuleList(BertLayer(cfg, attention, kernels) for _ in range(cfg["num_hidden_layers"]))

    def _layers(self, x: torch.Tensor, meta: AttentionMetadata, rows: torch.Tensor | None) -> torch.Tensor:
        """Every layer over x; the last keeps only `rows` (None: every row)."""
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x, meta, rows if i == last else None)
        return x


class BertEncoder(_BertStack):
    """Embeddings, N post-norm layers and pooling: (input_ids[T], positions[T], meta) -> [B, H] fp32."""

    def __init__(self, spec: ModelSpec, attention: AttentionBackend, kernels: KernelOptions | None = None) -> None:
        kernels = kernels or KernelOptions()
        super().__init__(spec, attention, kernels)
        hidden = spec.config["hidden_size"]
        # CLS and last-token pooling read one row per text: the last layer keeps only those rows
        # after attention.
        self.pooler = Pooler(spec.pooling, len(self.layers), kernels.pool_early)
        self.causal = spec.causal
        # BGE-M3's learned sparse and ColBERT heads, when the checkpoint has them.
        self.heads = TokenHeads(hidden, spec.sparse_head, spec.colbert_dim) \
            if spec.sparse_head or spec.colbert_dim else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                token_outputs: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Pooled [B, H]; with ``token_outputs`` (a model with heads), (pooled, heads [T, width])."""
        if meta.causal != self.causal:
            raise ValueError(f"meta.causal={meta.causal} but this model is causal={self.causal}")
        if token_outputs and self.heads is None:
            raise ValueError("token_outputs: this model has no sparse_linear.pt or colbert_linear.pt head")
        x = self.embed_norm(self.word_embeddings(input_ids) + self.position_embeddings(positions))
        # The heads read every token, so with them the last layer keeps every row.
        x = self._layers(x, meta, None if token_outputs else self.pooler.rows(meta, x.shape[0]))
        if not token_outputs:
            return self.pooler(x, meta)
        return self.pooler.pool(x, meta), self.heads(x)


class BertScorer(_BertStack):
    """Cross-encoder: (input_ids[T] with type-1 tokens at ``id + vocab_size``, positions[T], meta) -> [B, 1] fp32 scores."""

    def __init__(self, spec: ModelSpec, attention: AttentionBackend, kernels: KernelOptions | None = None) -> None:
        kernels = kernels or KernelOptions()
        super().__init__(spec, attention, kernels)
        hidden = spec.config["hidden_size"]
        # Type-1 embedding minus type-0 (which the position table already holds); absent with one type.
        self.type_delta = nn.Parameter(torch.empty(hidden)) if spec.token_types > 1 else None
        # The head reads the first token of each sequence: the last layer keeps only those rows.
        self.pooler = Pooler("cls", len(self.layers), kernels.pool_early)
        self.head_dense = nn.Linear(hidden, hidden)
        self.head_out = nn.Linear(hidden, spec.dimensions)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if meta.causal:
            raise ValueError("meta.causal=True but a cross-encoder attends both ways")
        second = input_ids >= self.vocab_size
        ids = torch.where(second, input_ids - self.vocab_size, input_ids)
        x = self.word_embeddings(ids) + self.position_embeddings(positions)
        if self.type_delta is not None:
            x = x + second.unsqueeze(1).to(x.dtype) * self.type_delta
        x = self.embed_norm(x)
        x = self._layers(x, meta, self.pooler.rows(meta, x.shape[0]))
        first = self.pooler(x, meta)  # [B, H] float32
        head = torch.tanh(self.head_dense(first.to(self.head_dense.weight.dtype)))
        return self.head_out(head).float()


_PREFIXES = ("bert.", "roberta.", "xlm_roberta.", "model.")


def _strip(name: str) -> str:
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def convert_weights(hf: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Map a Hugging Face BertModel / XLMRobertaModel state dict onto BertEncoder's names."""
    w = {}
    for name, tensor in hf.items():
        name = _strip(name).replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        w[name] = tensor

    def take(name: str) -> torch.Tensor:
        try:
            return w[name]
        except KeyError:
            raise ValueError(f"{spec.path}: weight {name!r} is missing from the checkpoint") from None

    offset = spec.position_offset
    positions = take("embeddings.position_embeddings.weight")[offset:]
    token_type = w.get("embeddings.token_type_embeddings.weight")
    if token_type is not None:
        positions = positions + token_type[0]
    out = {
        "word_embeddings.weight": take("embeddings.word_embeddings.weight"),
        "position_embeddings.weight": positions,
        "embed_norm.weight": take("embeddings.LayerNorm.weight"),
        "embed_norm.bias": take("embeddings.LayerNorm.bias"),
    }
    for i in range(spec.config["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        o = f"layers.{i}."
        for kind in ("weight", "bias"):
            out[o + f"qkv.proj.{kind}"] = fuse_rows(
                take(p + f"attention.self.query.{kind}"),
                take(p + f"attention.self.key.{kind}"),
                take(p + f"attention.self.value.{kind}"),
            )
            out[o + f"out.{kind}"] = take(p + f"attention.output.dense.{kind}")
            out[o + f"attn_norm.{kind}"] = take(p + f"attention.output.LayerNorm.{kind}")
            out[o + f"mlp.up.{kind}"] = take(p + f"intermediate.dense.{kind}")
            out[o + f"mlp.down.{kind}"] = take(p + f"output.dense.{kind}")
            out[o + f"mlp_norm.{kind}"] = take(p + f"output.LayerNorm.{kind}")
    return out


def convert_scorer_weights(hf: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Map a Hugging Face ``*ForSequenceClassification`` state dict onto BertScorer's names."""
    out = convert_weights(hf, spec)
    w = {_strip(name): tensor for name, tensor in hf.items()}

    def take(*names: str) -> torch.Tensor:
        for name in names:
            if name in w:
                return w[name]
        raise ValueError(f"{spec.path}: weight {names[0]!r} of the classification head is missing from the checkpoint")

    if spec.token_types > 1:
        types = take("embeddings.token_type_embeddings.weight")
        out["type_delta"] = types[1] - types[0]
    for kind in ("weight", "bias"):
        if spec.family == "bert":  # pooler (dense + tanh on [CLS]), then the classifier
            out[f"head_dense.{kind}"] = take(f"pooler.dense.{kind}")
            out[f"head_out.{kind}"] = take(f"classifier.{kind}")
        else:  # XLM-R's classification head: dense + tanh on <s>, then out_proj
            out[f"head_dense.{kind}"] = take(f"classifier.dense.{kind}")
            out[f"head_out.{kind}"] = take(f"classifier.out_proj.{kind}")
    return out
