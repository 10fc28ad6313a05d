"""Feed-forward blocks: BERT's dense-activation-dense and Qwen3's SwiGLU with a fused gate/up matmul."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from core_engine.layers.linear import ResidualLinear

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_python": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation function called ``name`` in a Hugging Face config (``hidden_act``)."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"hidden_act {name!r} is not supported; choose one of {sorted(ACTIVATIONS)}") from None


@torch.library.custom_op("fern::linear_gelu", mutates_args=())
def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """gelu(x W^T + b) as one matmul whose epilogue adds the bias and applies GELU.

    On CUDA this is cuBLASLt's GELU epilogue (the tanh form of GELU), so the [T, intermediate]
    activation is written once instead of written, read and written again. An opaque op, so
    torch.compile keeps it whole rather than splitting it back into matmul + pointwise.
    """
    return torch._addmm_activation(bias, x, weight.t(), use_gelu=True)


@linear_gelu.register_fake
def _linear_gelu_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


class DenseMLP(nn.Module):
    """up = act(x W1 + b1); out = up W2 + b2 (BERT's intermediate + output dense).

    On CUDA a GELU activation runs as the up-projection's cuBLASLt epilogue (`linear_gelu`):
    measured on an H200 with the BGE-M3 shape, +6.7 % embeddings/s at 512 tokens and 0.944 ->
    0.907 ms of GPU kernel time for one 128-token text, vectors at cosine >= 0.99994 to the
    separate exact-GELU kernel (the epilogue uses GELU's tanh form). `gelu_epilogue=False`
    (KernelOptions.gelu_epilogue) turns it off.
    """

    def __init__(self, hidden: int, intermediate: int, act: str, gelu_epilogue: bool = True) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, intermediate)
        self.down = nn.Linear(intermediate, hidden)
        self.act = activation(act)
        self.gelu_epilogue = act.startswith("gelu") and gelu_epilogue

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gelu_epilogue and x.is_cuda:
            return self.down(linear_gelu(x, self.up.weight, self.up.bias))
        return self.down(self.act(self.up(x)))


class SwiGLU(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up stacked in one weight, one matmul.

    ``down`` feeds the residual stream (`ResidualLinear`, opaque unless `opaque_residual=False`).
    """

    def __init__(self, hidden: int, intermediate: int, act: str, opaque_residual: bool = True) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = ResidualLinear(intermediate, hidden, opaque=opaque_residual)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.intermediate, dim=-1)
        return self.down(self.act(gate) * up)
