"""Builds a ready-to-run embedding model from a ModelSpec: module, safetensors weights, dtype, device."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from core_engine.attention.base import AttentionBackend
from core_engine.config import ModelSpec, default_model_dir  # noqa: F401 - callers import it from here too
from core_engine.heads import read_heads
from core_engine.models import FAMILIES
from core_engine.settings import KernelOptions


def read_checkpoint(model_dir: Path, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` (or its ``model-*-of-*`` shards) on ``device``."""
    device = str(device)
    single = model_dir / "model.safetensors"
    if single.is_file():
        return load_file(single, device=device)
    shards = sorted(model_dir.glob("model-*-of-*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"model directory {str(model_dir)!r} has no model.safetensors")
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        weights.update(load_file(shard, device=device))
    return weights


def _module_class(spec: ModelSpec) -> tuple[type[nn.Module], Callable[..., dict[str, torch.Tensor]]]:
    """The module class of ``spec``'s family and kind, with the function converting its checkpoint."""
    family = FAMILIES[spec.family]
    if spec.kind == "reranker":
        if family.scorer is None or family.convert_scorer_weights is None:
            raise ValueError(f"{spec.path}: {spec.family} has no cross-encoder in Fern")
        return family.scorer, family.convert_scorer_weights
    return family.module, family.convert_weights


def build_model(
    spec: ModelSpec, device: torch.device | str, dtype: torch.dtype, attention: AttentionBackend,
    kernels: KernelOptions | None = None,
) -> nn.Module:
    """The model of ``spec`` in eval mode on ``device``/``dtype``, calling ``attention`` in every layer.

    ``kernels`` picks the forms of individual kernels (default: the ones that serve).

    ``module(input_ids[T] int64, positions[T] int64, meta)`` returns pooled [B, D] float32
    (a reranker: scores [B, 1], one per packed (query, document) sequence); a model
    with token heads (``spec.sparse_head``, ``spec.colbert_dim``) also takes ``token_outputs=True``
    and then returns (pooled, heads [T, width] float32) (core_engine.heads).
    ``positions`` are 0-based within each sequence for every family (the XLM-R offset is
    already applied to the position table). The forward pass has no host syncs of its own,
    so it is CUDA-graph capturable whenever the attention backend is.
    """
    module_class, convert = _module_class(spec)
    with torch.device("meta"):
        module = module_class(spec, attention, kernels or KernelOptions())
    # Read straight onto the device: fusing and casting there is faster than on the host.
    weights = convert(read_checkpoint(spec.path, device), spec)
    if spec.sparse_head or spec.colbert_dim:
        weights.update(read_heads(spec.path, spec.dimensions, spec.sparse_head, spec.colbert_dim, device))
    # The checkpoint decides the parameter shapes it holds; check them against the config.
    expected = module.state_dict()
    for name, tensor in weights.items():
        if name in expected and expected[name].shape != tensor.shape:
            raise ValueError(
                f"{spec.path}: weight {name} has shape {tuple(tensor.shape)}, "
                f"config.json implies {tuple(expected[name].shape)}"
            )
    weights = {name: t.to(dtype).contiguous() for name, t in weights.items()}
    module.load_state_dict(weights, strict=True, assign=True)
    # Only weights take ``dtype``; buffers (rotary inverse frequencies) stay float32 as in
    # transformers, which is why this is not module.to(dtype).
    module.to(device=device)
    module.eval()
    module.requires_grad_(False)
    return module


def rebuild_model(spec: ModelSpec, model: nn.Module, attention: AttentionBackend,
                  kernels: KernelOptions | None = None) -> nn.Module:
    """A second module of ``spec`` on ``model``'s own weights and buffers (shared, not copied), calling
    ``attention``: what the engine compiles beside the module it serves from, so that neither
    touches the other's attention state."""
    module_class, _ = _module_class(spec)
    with torch.device("meta"):
        module = module_class(spec, attention, kernels or KernelOptions())
    shared = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for name, tensor in shared:
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        slots = owner._parameters if attr in owner._parameters else owner._buffers
        slots[attr] = tensor
    leftover = [name for name, t in list(module.named_parameters()) + list(module.named_buffers()) if t.is_meta]
    if leftover:
        raise RuntimeError(f"rebuild_model: {spec.name}: {leftover[:3]} have no tensor in the served model")
    module.eval()
    return module
