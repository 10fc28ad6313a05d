"""BGE-M3's token heads over the last hidden states: learned sparse weights and ColBERT multi-vectors.

A BGE-M3 checkpoint directory carries, beside the XLM-R encoder, two torch ``Linear``
state dicts (``weight``, ``bias``):

- ``sparse_linear.pt``: Linear(hidden, 1). A token's lexical weight is
  ``relu(sparse_linear(h))``; a text's learned sparse vector keeps, per token id of its
  input, the largest weight, without the special tokens (cls, eos, pad, unk) and without
  zero weights.
- ``colbert_linear.pt``: Linear(hidden, dim). A text's multi-vector is
  ``colbert_linear(h)`` of every token but the first (CLS), each L2-normalized; the
  closing ``</s>`` is one of them.

On the device the heads run over every packed token row at once (`TokenHeads`): one
[T, width] float32 tensor, column 0 the sparse weight (when there is a sparse head), the
rest the normalized ColBERT vector. Its shape depends only on T, so the heads live inside
the CUDA graph of a step. The per-text cut and the sparse reduction run on the host, on the
rows of the real tokens (core_engine.token_outputs).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

SPARSE_FILE = "sparse_linear.pt"
COLBERT_FILE = "colbert_linear.pt"


def read_head(path: Path, hidden: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """A Linear(hidden, out) state dict from ``path``: {"weight": [out, hidden], "bias": [out]}; errors name the file."""
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file: say which one
        raise ValueError(f"{path}: not a readable torch state dict ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict) or not {"weight", "bias"} <= set(state):
        keys = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{path}: expected a Linear state dict with 'weight' and 'bias', got {keys}")
    weight, bias = state["weight"], state["bias"]
    if weight.ndim != 2 or weight.shape[1] != hidden or bias.shape != (weight.shape[0],):
        raise ValueError(f"{path}: weight {tuple(weight.shape)} and bias {tuple(bias.shape)} are not a "
                         f"Linear({hidden}, out) (hidden_size {hidden} from config.json)")
    return {"weight": weight, "bias": bias}


def colbert_dimensions(model_dir: Path, hidden: int) -> int:
    """The ColBERT head's output width in ``model_dir`` (0 without ``colbert_linear.pt``)."""
    path = model_dir / COLBERT_FILE
    return int(read_head(path, hidden)["weight"].shape[0]) if path.is_file() else 0


def has_sparse_head(model_dir: Path, hidden: int) -> bool:
    """Whether ``model_dir`` holds a valid ``sparse_linear.pt`` (Linear(hidden, 1))."""
    path = model_dir / SPARSE_FILE
    if not path.is_file():
        return False
    if read_head(path, hidden)["weight"].shape[0] != 1:
        raise ValueError(f"{path}: a sparse head has one output (Linear({hidden}, 1))")
    return True


def read_heads(model_dir: Path, hidden: int, sparse: bool, colbert_dim: int,
               device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """The head weights of ``model_dir`` under `TokenHeads`' names, prefixed "heads."."""
    weights = {}
    for name, file, wanted in (("sparse", SPARSE_FILE, sparse), ("colbert", COLBERT_FILE, bool(colbert_dim))):
        if wanted:
            for kind, tensor in read_head(model_dir / file, hidden, device).items():
                weights[f"heads.{name}.{kind}"] = tensor
    return weights


class TokenHeads(nn.Module):
    """[T, hidden] -> [T, width] float32: relu(sparse) in column 0 (if any), then the normalized ColBERT vector."""

    def __init__(self, hidden: int, sparse: bool, colbert_dim: int) -> None:
        super().__init__()
        self.sparse = nn.Linear(hidden, 1) if sparse else None
        self.colbert = nn.Linear(hidden, colbert_dim) if colbert_dim else None
        self.width = int(sparse) + colbert_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = []
        if self.sparse is not None:
            parts.append(torch.relu(self.sparse(x)).float())
        if self.colbert is not None:
            parts.append(F.normalize(self.colbert(x).float(), dim=-1))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
