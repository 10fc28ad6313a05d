"""Qwen3's per-head q/k RMSNorm followed by rotary embedding, in one pass over the rows.

On CUDA this is one Triton kernel: each row (one head of one token) is read once, its
RMS taken, the norm weight and the rotation applied, all in float32, and the row written
once. torch.compile did not find that on its own: on an H200 its code for the same lines
took 4.8 ms of a 35.7 ms pplx-0.6b step of 16k tokens (two kernels reading strided rows at
under 1 TB/s), where the bytes moved need about 1.6 ms.

It is a custom op, so torch.compile keeps it whole and CUDA graphs record it. The first
CUDA call checks the kernel against the plain torch formula on random rows; if Triton is
missing or the check fails, the torch formula serves instead (logged once), so a broken
kernel can cost speed but never vectors. `triton=False` (KernelOptions.triton_kernels) asks
for the torch formula.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from core_engine.layers.rotary import apply_rotary

log = logging.getLogger(__name__)

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install has no Triton; the torch formula serves
    triton = None


def qk_norm_rope_reference(qk: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           eps: float) -> torch.Tensor:
    """The torch formula: rms_norm over each head (rounded), times the weight, then rotary.

    qk [T, H, D] (any strides with a contiguous last dimension), weight [H, D], cos/sin
    [T, 1, D / 2]. Rounds between the norm and the weight as transformers' Qwen3RMSNorm does.
    """
    normed = F.rms_norm(qk, (qk.shape[-1],), None, eps) * weight
    return apply_rotary(normed, cos, sin)


if triton is not None:

    @triton.jit
    def _qk_norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, rows, heads, q_heads,
                             x_stride_t, x_stride_h, cs_stride_t, eps,
                             HALF: tl.constexpr, BLOCK_ROWS: tl.constexpr):
        row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        live = row < rows
        t = row // heads
        h = row % heads
        col = tl.arange(0, HALF)
        mask = live[:, None]
        x_at = x_ptr + t[:, None] * x_stride_t + h[:, None] * x_stride_h + col[None, :]
        x1 = tl.load(x_at, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_at + HALF, mask=mask, other=0.0).to(tl.float32)
        scale = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
        w_at = w_ptr + h[:, None] * (2 * HALF) + col[None, :]
        y1 = x1 * scale[:, None] * tl.load(w_at, mask=mask, other=0.0).to(tl.float32)
        y2 = x2 * scale[:, None] * tl.load(w_at + HALF, mask=mask, other=0.0).to(tl.float32)
        cs_at = t[:, None] * cs_stride_t + col[None, :]
        c = tl.load(cos_ptr + cs_at, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + cs_at, mask=mask, other=0.0).to(tl.float32)
        o1 = (y1 * c - y2 * s).to(q_ptr.dtype.element_ty)
        o2 = (y2 * c + y1 * s).to(q_ptr.dtype.element_ty)
        # q heads go to q [T, q_heads, D], k heads to k [T, heads - q_heads, D], both contiguous.
        is_q = (h < q_heads)[:, None]
        q_at = q_ptr + (t[:, None] * q_heads + h[:, None]) * (2 * HALF) + col[None, :]
        k_at = k_ptr + (t[:, None] * (heads - q_heads) + h[:, None] - q_heads) * (2 * HALF) + col[None, :]
        tl.store(q_at, o1, mask=mask & is_q)
        tl.store(q_at + HALF, o2, mask=mask & is_q)
        tl.store(k_at, o1, mask=mask & ~is_q)
        tl.store(k_at + HALF, o2, mask=mask & ~is_q)


def _triton_qk_norm_rope(qk: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         eps: float, q_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    t, heads, d = qk.shape
    q = torch.empty((t, q_heads, d), dtype=qk.dtype, device=qk.device)
    k = torch.empty((t, heads - q_heads, d), dtype=qk.dtype, device=qk.device)
    rows = t * heads
    if rows == 0:
        return q, k
    if qk.stride(2) != 1:
        qk = qk.contiguous()
    weight = weight.contiguous()
    cos2, sin2 = cos.reshape(t, d // 2).contiguous(), sin.reshape(t, d // 2).contiguous()
    block_rows = 16
    _qk_norm_rope_kernel[(triton.cdiv(rows, block_rows),)](
        qk, weight, cos2, sin2, q, k, rows, heads, q_heads, qk.stride(0), qk.stride(1), cos2.stride(0), eps,
        HALF=d // 2, BLOCK_ROWS=block_rows, num_warps=4)
    return q, k


@functools.cache
def _kernel_ok_on(index: int) -> bool:
    """Whether the Triton kernel passed its check on CUDA device `index` (checked once)."""
    return _check(torch.device("cuda", index))


def _kernel_ok(device: torch.device) -> bool:
    return _kernel_ok_on(device.index if device.index is not None else torch.cuda.current_device())


def _check(device: torch.device) -> bool:
    """Run the kernel beside the torch formula on random rows of a Qwen3-like layout."""
    if triton is None:
        log.info("Triton is not installed: Qwen3 q/k norm + rotary runs as torch ops")
        return False
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        t, heads, d = 37, 24, 128
        wide = torch.randn(t, heads * d + 8 * d, generator=gen, device=device, dtype=torch.bfloat16)
        qk = wide[:, : heads * d].view(t, heads, d)  # strided rows, as sliced from the fused projection
        weight = torch.rand(heads, d, generator=gen, device=device, dtype=torch.bfloat16) + 0.5
        angles = torch.rand(t, 1, d // 2, generator=gen, device=device) * 6.0
        cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
        got = torch.cat(_triton_qk_norm_rope(qk, weight, cos, sin, 1e-6, 16), dim=1).float()
        want = qk_norm_rope_reference(qk.float(), weight.float(), cos.float(), sin.float(), 1e-6)
        err = (got - want).abs().max().item()
        if not err < 0.05:  # bf16 output of values up to ~5: a few rounding steps at most
            log.warning("Triton q/k norm + rotary kernel is off by %.3g; using torch ops", err)
            return False
        return True
    except Exception as exc:  # noqa: BLE001 - any Triton failure: serve with torch ops
        log.warning("Triton q/k norm + rotary kernel failed (%s: %s); using torch ops", type(exc).__name__, exc)
        return False


@torch.library.custom_op("fern::qk_norm_rope", mutates_args=())
def qk_norm_rope(qk: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 eps: float, q_heads: int, triton: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, q_heads, D] and k [T, H - q_heads, D], normalized and rotated, each contiguous.

    From qk [T, H, D] (q heads first); see the module doc. Separate contiguous outputs keep
    the attention kernel from copying strided q/k views (two copies a layer on the H200).
    `triton=False` runs the torch formula even where the kernel works.
    """
    if triton and qk.is_cuda and qk.shape[-1] % 2 == 0 and _kernel_ok(qk.device):
        return _triton_qk_norm_rope(qk, weight, cos, sin, eps, q_heads)
    out = qk_norm_rope_reference(qk, weight, cos, sin, eps)
    return out[:, :q_heads].contiguous(), out[:, q_heads:].contiguous()


@qk_norm_rope.register_fake
def _qk_norm_rope_fake(qk: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       eps: float, q_heads: int, triton: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    t, heads, d = qk.shape
    return qk.new_empty((t, q_heads, d)), qk.new_empty((t, heads - q_heads, d))
