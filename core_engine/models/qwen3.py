"""The Qwen3 family as an embedder: Qwen3-Embedding (causal, last token) and pplx-embed (bidirectional, mean).

Pre-norm blocks with RMSNorm, rotary positions (``rope_theta``), per-head RMSNorm on q
and k, grouped-query attention (``num_key_value_heads``), a SwiGLU MLP, and a final
RMSNorm before pooling. Q/K/V come from one fused matmul and gate/up from another;
the fusion happens at load time from the Hugging Face ``q_proj``/``k_proj``/``v_proj``
and ``gate_proj``/``up_proj`` weights. Positions are 0-based per sequence.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from core_engine.attention.base import AttentionBackend, AttentionMetadata
from core_engine.config import ModelSpec
from core_engine.layers.embedding import Embedding
from core_engine.layers.linear import ResidualLinear, fuse_rows
from core_engine.layers.mlp import SwiGLU
from core_engine.layers.norm import RMSNorm
from core_engine.layers.qk_norm_rope import qk_norm_rope
from core_engine.layers.rotary import RotaryEmbedding
from core_engine.pooling import Pooler
from core_engine.settings import KernelOptions


def _head_dim(cfg: dict[str, Any]) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


class Qwen3Layer(nn.Module):
    """x += attn(norm(x)); x += mlp(norm(x)), with q/k normalized per head before rotary.

    q and k heads sit side by side in the fused projection's output, so they are
    normalized and rotated together as one [T, Hq + Hkv, D] tensor: one norm, one weight
    multiply and one rotary instead of two of each. ``qk_norm_weight`` [Hq + Hkv, D] holds
    q_norm's weight on the q rows and k_norm's on the k rows (stacked at load time).
    """

    def __init__(self, cfg: dict[str, Any], attention: AttentionBackend, kernels: KernelOptions) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        head_dim = _head_dim(cfg)
        eps = cfg.get("rms_norm_eps", 1e-6)
        bias = bool(cfg.get("attention_bias", False))
        self.heads, self.kv_heads, self.head_dim, self.eps = heads, kv_heads, head_dim, eps
        self.input_norm = RMSNorm(hidden, eps)
        self.qkv = nn.Linear(hidden, (heads + 2 * kv_heads) * head_dim, bias=bias)
        self.qk_norm_weight = nn.Parameter(torch.ones(heads + kv_heads, head_dim))
        # With a bias, the projection is addmm(bias, ...), whose 1-D bias cuBLAS adds in its
        # epilogue, and torch.compile leaves the residual add alone; only the bias-free form
        # would have the residual folded into its matmul, which `ResidualLinear` prevents.
        self.out = (nn.Linear(heads * head_dim, hidden, bias=True) if bias
                    else ResidualLinear(heads * head_dim, hidden, opaque=kernels.opaque_residual))
        self.post_norm = RMSNorm(hidden, eps)
        self.mlp = SwiGLU(hidden, cfg["intermediate_size"], cfg.get("hidden_act", "silu"), kernels.opaque_residual)
        self.triton = kernels.triton_kernels
        self.attention = attention

    def forward(
        self, x: torch.Tensor, pending: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
        meta: AttentionMetadata, rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual stream, the MLP output not yet added to it) -> the same pair after this layer.

        The previous layer's MLP output (``pending``) joins the stream here, in front of this
        layer's input norm, rather than at the end of that layer. Attention splits every layer
        into compiled regions, so an add at a layer's end would be a kernel of its own (or,
        folded into the matmul, a copy); here it fuses with the norm that reads the sum anyway.
        With ``rows`` (indices into T), only those rows go on after attention.
        """
        if pending is not None:
            x = x + pending
        t, d = x.shape[0], self.head_dim
        qk, v = self.qkv(self.input_norm(x)).split([(self.heads + self.kv_heads) * d, self.kv_heads * d], dim=-1)
        q, k = qk_norm_rope(qk.view(t, -1, d), self.qk_norm_weight, cos, sin, self.eps, self.heads, self.triton)
        a = self.attention(q, k, v.view(t, self.kv_heads, d), meta).reshape(t, -1)
        if rows is not None:
            a, x = a.index_select(0, rows), x.index_select(0, rows)
        x = x + self.out(a)
        return x, self.mlp(self.post_norm(x))


class Qwen3Encoder(nn.Module):
    """Token embeddings, N Qwen3 layers, final norm, pooling: (input_ids, positions, meta) -> [B, H] fp32."""

    def __init__(self, spec: ModelSpec, attention: AttentionBackend, kernels: KernelOptions | None = None) -> None:
        super().__init__()
        kernels = kernels or KernelOptions()
        cfg = spec.config
        if cfg.get("use_sliding_window"):
            raise ValueError(f"{spec.path}: sliding-window attention is not supported")
        scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        if scaling.get("rope_type", scaling.get("type", "default")) != "default":
            raise ValueError(f"{spec.path}: rope scaling {scaling!r} is not supported")
        self.embed_tokens = Embedding(cfg["vocab_size"], cfg["hidden_size"])
        theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        self.rotary = RotaryEmbedding(_head_dim(cfg), float(theta))
        self.layers = nn.ModuleList(Qwen3Layer(cfg, attention, kernels) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6))
        # CLS and last-token pooling read one row per text: the last layer keeps only those rows
        # after attention.
        self.pooler = Pooler(spec.pooling, len(self.layers), kernels.pool_early)
        self.causal = spec.causal

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if meta.causal != self.causal:
            raise ValueError(f"meta.causal={meta.causal} but this model is causal={self.causal}")
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        rows = self.pooler.rows(meta, x.shape[0])
        last = len(self.layers) - 1
        pending = None
        for i, layer in enumerate(self.layers):
            x, pending = layer(x, pending, cos, sin, meta, rows if i == last else None)
        if pending is not None:
            x = x + pending
        return self.pooler(self.norm(x), meta)


def convert_weights(hf: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Map a Hugging Face Qwen3Model / Qwen3ForCausalLM state dict onto Qwen3Encoder's names."""
    w = {(n[len("model.") :] if n.startswith("model.") else n): t for n, t in hf.items()}

    def take(name: str) -> torch.Tensor:
        try:
            return w[name]
        except KeyError:
            raise ValueError(f"{spec.path}: weight {name!r} is missing from the checkpoint") from None

    bias = bool(spec.config.get("attention_bias", False))
    out = {"embed_tokens.weight": take("embed_tokens.weight"), "norm.weight": take("norm.weight")}
    for i in range(spec.config["num_hidden_layers"]):
        p = f"layers.{i}."
        a = p + "self_attn."
        out[p + "input_norm.weight"] = take(p + "input_layernorm.weight")
        out[p + "post_norm.weight"] = take(p + "post_attention_layernorm.weight")
        out[p + "qkv.weight"] = fuse_rows(take(a + "q_proj.weight"), take(a + "k_proj.weight"), take(a + "v_proj.weight"))
        if bias:
            out[p + "qkv.bias"] = fuse_rows(take(a + "q_proj.bias"), take(a + "k_proj.bias"), take(a + "v_proj.bias"))
            out[p + "out.bias"] = take(a + "o_proj.bias")
        out[p + "out.weight"] = take(a + "o_proj.weight")
        heads = spec.config["num_attention_heads"]
        kv_heads = spec.config.get("num_key_value_heads") or heads
        q_norm, k_norm = take(a + "q_norm.weight"), take(a + "k_norm.weight")
        out[p + "qk_norm_weight"] = fuse_rows(q_norm.expand(heads, -1), k_norm.expand(kv_heads, -1))
        out[p + "mlp.gate_up.weight"] = fuse_rows(take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight"))
        out[p + "mlp.down.weight"] = take(p + "mlp.down_proj.weight")
    return out
