"""SwiGLU's activation, silu(gate) * up, read from the fused gate/up projection's output in one pass.

On CUDA this is one Triton kernel: each program reads a block of one row's gate half and the
matching block of its up half, both contiguous, and writes their product, computed in
float32 and rounded once (as torch.compile's fused code for the same lines does). It is a
custom op, so torch.compile keeps it whole and CUDA graphs record it. The first CUDA call
checks the kernel against the torch formula on random rows; if Triton is missing, the check
fails or FERN_TRITON_KERNELS=0 is set, the torch formula serves instead (logged once).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from core_engine.layers.triton_support import check_kernel, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, cols, x_stride, out_stride, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = col < cols
        gate = tl.load(x_ptr + row * x_stride + col, mask=live, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * x_stride + cols + col, mask=live, other=0.0).to(tl.float32)
        out = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + row * out_stride + col, out.to(out_ptr.dtype.element_ty), mask=live)


BLOCK = 1024


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """The torch formula: silu of the first half of the last dimension times the second half."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _triton_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows, width = gate_up.shape
    cols = width // 2
    out = torch.empty((rows, cols), dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0:
        return out
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    _silu_mul_kernel[(rows, triton.cdiv(cols, BLOCK))](
        gate_up, out, cols, gate_up.stride(0), out.stride(0), BLOCK=BLOCK, num_warps=4)
    return out


def _compare(device: torch.device) -> float:
    """Largest difference between kernel and formula on random rows, relative to the value (at least 1)."""
    gen = torch.Generator(device=device).manual_seed(0)
    gate_up = torch.randn(37, 2 * 1500, generator=gen, device=device, dtype=torch.bfloat16) * 3
    got = _triton_silu_mul(gate_up).float()
    want = silu_mul_reference(gate_up.float())
    return ((got - want).abs() / want.abs().clamp_min(1.0)).max().item()


@functools.cache
def _kernel_ok_on(index: int) -> bool:
    # A bf16 result is within 2**-8 of the value: allow a rounding step or two.
    return check_kernel("SwiGLU silu * up", torch.device("cuda", index), _compare, tolerance=0.01)


@torch.library.custom_op("fern::silu_mul", mutates_args=())
def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2I] = [gate | up]: [T, I], contiguous. See the module doc."""
    if gate_up.is_cuda and gate_up.shape[-1] % 2 == 0 and _kernel_ok_on(
            gate_up.device.index if gate_up.device.index is not None else torch.cuda.current_device()):
        return _triton_silu_mul(gate_up)
    return silu_mul_reference(gate_up).contiguous()


@silu_mul.register_fake
def _silu_mul_fake(gate_up: torch.Tensor) -> torch.Tensor:
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))
