"""Linear layers for few-token steps: one Triton split-K kernel in place of cuBLAS.

A batch-1 query is 16–128 tokens. At that size a projection reads its whole weight to do a
few hundred MFLOP, and cuBLAS picks tiles for it that leave most of the GPU idle: on an H200
(BGE-M3 shape, 1×128 tokens) its kernels tile the [128, N] output into 8–48 blocks for 132
SMs and read the weights at about 1 TB/s, 5.5–7 µs a projection, 96 projections a query.

This kernel splits K as well as the output, so a projection runs as a few hundred small
blocks. Each block multiplies its slice of K into float32; the blocks of one output tile
meet through a counter: each writes its partial sum to a workspace and increments the
tile's counter, and the block that arrives last adds the partials, the bias and the
activation, writes the tile in the model's dtype and sets the counter back to zero for the
next launch (so a CUDA graph can replay it). With one split there is no workspace at all.

Calls on one device share one workspace and counter array. That is safe because they never
overlap: Fern's engines launch on their device's default stream (graph replays included),
so the kernels of all models on a GPU run one after another.

`linear(x, weight, bias, gelu)` is the op the models call. It takes this kernel for CUDA
steps of at most `SMALL_ROWS` tokens and cuBLAS otherwise; FERN_SMALL_LINEAR=0 turns the
kernel off. Like the q/k norm kernel, its first CUDA call checks it against cuBLAS on
random inputs, and a failed check (or no Triton) leaves cuBLAS serving, logged once.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install has no Triton; cuBLAS / the CPU matmul serves
    triton = None

SMALL_ROWS = 256  # steps of at most this many tokens take the kernel
_WORKSPACE_FLOATS = 8 << 20  # 32 MB of float32 partial sums per device
_COUNTERS = 1 << 16  # one per output tile


class Config(NamedTuple):
    """One launch shape: output tile BM × BN, K in steps of BK, K split `split` ways."""

    bm: int
    bn: int
    bk: int
    split: int
    warps: int = 4
    stages: int = 3


def pick_config(m: int, n: int, k: int) -> Config:
    """The launch shape for an [m, k] × [k, n] projection (m ≤ SMALL_ROWS).

    The split is a runtime argument of the kernel, so only the tile shape, bias and GELU
    make Triton compile another variant (the engine's warm-up meets them all).
    """
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    bn = 64
    tiles = triton_cdiv(m, bm) * triton_cdiv(n, bn)
    # Enough blocks to cover the SMs a few times over, each with at least two K steps.
    split = 1
    while tiles * split < 264 and k // (split * 2) >= 2 * 128:
        split *= 2
    return Config(bm, bn, 128, split)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def workspace_floats(m: int, n: int, cfg: Config) -> int:
    """Float32 partial sums a launch needs (none without a split)."""
    return 0 if cfg.split == 1 else cfg.split * m * n


if triton is not None:

    @triton.jit
    def _finish(acc, b_ptr, y_ptr, rm, rn, M, N, stride_ym, HAS_BIAS: tl.constexpr, GELU: tl.constexpr):
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        if GELU:  # GELU's tanh form, as cuBLASLt's epilogue: x * sigmoid(2 * sqrt(2 / pi) * (x + 0.044715 x^3))
            acc = acc * tl.sigmoid(1.5957691216057308 * (acc + 0.044715 * acc * acc * acc))
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _small_linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, N, K,
                             stride_xm, stride_wn, stride_ym,
                             SPLIT, HAS_BIAS: tl.constexpr, GELU: tl.constexpr, BM: tl.constexpr,
                             BN: tl.constexpr, BK: tl.constexpr):
        tile = tl.program_id(0)
        split = tl.program_id(1)
        tiles_n = tl.cdiv(N, BN)
        rm = (tile // tiles_n) * BM + tl.arange(0, BM)
        rn = (tile % tiles_n) * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        k_len = tl.cdiv(tl.cdiv(K, SPLIT), BK) * BK
        k_start = split * k_len
        k_end = tl.minimum(k_start + k_len, K)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(k_start, k_end, BK):
            kk = k + rk
            a = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :],
                        mask=(rm[:, None] < M) & (kk[None, :] < k_end), other=0.0)
            b = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None],
                        mask=(rn[None, :] < N) & (kk[:, None] < k_end), other=0.0)
            acc = tl.dot(a, b, acc)
        if SPLIT == 1:
            _finish(acc, b_ptr, y_ptr, rm, rn, M, N, stride_ym, HAS_BIAS, GELU)
        else:
            mask = (rm[:, None] < M) & (rn[None, :] < N)
            tl.store(part_ptr + (split * M + rm[:, None]) * N + rn[None, :], acc, mask=mask)
            tl.debug_barrier()  # every thread's partial is written before the counter moves
            arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
            if arrived == SPLIT - 1:  # the last block of this tile: add the partials up
                total = tl.zeros((BM, BN), dtype=tl.float32)
                for s in range(SPLIT):
                    total += tl.load(part_ptr + (s * M + rm[:, None]) * N + rn[None, :], mask=mask,
                                     other=0.0, cache_modifier=".cg")
                _finish(total, b_ptr, y_ptr, rm, rn, M, N, stride_ym, HAS_BIAS, GELU)
                tl.atomic_xchg(count_ptr + tile, 0)


class _Scratch(NamedTuple):
    partials: torch.Tensor  # float32 partial sums of split launches
    counters: torch.Tensor  # int32 arrivals per output tile, zero between launches


@functools.cache
def _scratch(device: torch.device) -> _Scratch:
    # Allocated once, before any graph is captured (the first call checks the kernel eagerly);
    # graphs keep these addresses, so they are never reallocated.
    return _Scratch(torch.empty(_WORKSPACE_FLOATS, dtype=torch.float32, device=device),
                    torch.zeros(_COUNTERS, dtype=torch.int32, device=device))


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gelu: bool = False,
                 cfg: Config | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x Wᵀ (+ b) (then GELU's tanh form) with the split-K kernel; `cfg` overrides the pick."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None else out
    if m == 0:
        return y
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    cfg = cfg or pick_config(m, n, k)
    scratch = _scratch(x.device)
    tiles = triton_cdiv(m, cfg.bm) * triton_cdiv(n, cfg.bn)
    if workspace_floats(m, n, cfg) > scratch.partials.numel() or tiles > scratch.counters.numel():
        cfg = cfg._replace(split=1)
    _small_linear_kernel[(tiles, cfg.split)](
        x, weight, bias if bias is not None else weight, y, scratch.partials, scratch.counters, m, n, k,
        x.stride(0), weight.stride(0), y.stride(0), cfg.split,
        HAS_BIAS=bias is not None, GELU=gelu, BM=cfg.bm, BN=cfg.bn, BK=cfg.bk,
        num_warps=cfg.warps, num_stages=cfg.stages)
    return y


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gelu: bool = False) -> torch.Tensor:
    """What the kernel computes, in torch: cuBLAS (or the CPU matmul), GELU in its tanh form."""
    if gelu:
        if x.is_cuda and bias is not None:
            return torch._addmm_activation(bias, x, weight.t(), use_gelu=True)
        return F.gelu(F.linear(x, weight, bias), approximate="tanh")
    return F.linear(x, weight, bias)


_checked: dict[int, bool] = {}  # CUDA device index -> whether the kernel passed its check there


def kernel_ok(device: torch.device) -> bool:
    """Whether the kernel passed its check on this CUDA device (checked at the first call).

    A call made while a CUDA graph is being captured cannot run the check (it synchronizes),
    so it answers no, uncached, and that graph records cuBLAS.
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _checked:
        if torch.cuda.is_current_stream_capturing():
            return False
        _checked[index] = _check(torch.device("cuda", index))
    return _checked[index]


def forget_checks() -> None:
    """Check again at the next call (after FERN_SMALL_LINEAR changed)."""
    _checked.clear()


def _check(device: torch.device) -> bool:
    """Run the kernel beside cuBLAS on random inputs, split and unsplit, with and without GELU."""
    if os.environ.get("FERN_SMALL_LINEAR", "1") == "0" or os.environ.get("FERN_TRITON_KERNELS") == "0":
        log.info("FERN_SMALL_LINEAR=0: few-token steps run their projections on cuBLAS")
        return False
    if triton is None:
        log.info("Triton is not installed: few-token steps run their projections on cuBLAS")
        return False
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        for m, n, k, gelu in ((50, 96, 64, False), (100, 200, 1024, True), (128, 384, 4096, False)):
            x = torch.randn(m, k, generator=gen, device=device, dtype=torch.bfloat16)
            w = torch.randn(n, k, generator=gen, device=device, dtype=torch.bfloat16) / k ** 0.5
            b = torch.randn(n, generator=gen, device=device, dtype=torch.bfloat16)
            for _ in range(3):  # again and again: the tile counters must come back to zero
                got = small_linear(x, w, b, gelu).float()
            want = reference(x.float(), w.float(), b.float(), gelu)
            err = (got - want).abs().max().item()
            if not err < 0.05:  # bf16 outputs of magnitude ~1-4: a few rounding steps at most
                log.warning("Triton small-linear kernel is off by %.3g at [%d, %d] x [%d, %d]; using cuBLAS",
                            err, m, k, k, n)
                return False
        if _scratch(device).counters.any().item():
            log.warning("Triton small-linear kernel left its tile counters set; using cuBLAS")
            return False
        return True
    except Exception as exc:  # noqa: BLE001 - any Triton failure: serve with cuBLAS
        log.warning("Triton small-linear kernel failed (%s: %s); using cuBLAS", type(exc).__name__, exc)
        return False


@torch.library.custom_op("fern::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gelu: bool) -> torch.Tensor:
    """x Wᵀ + b, then GELU's tanh form if `gelu`: the split-K kernel for few-token CUDA steps.

    An opaque op, so torch.compile keeps it whole and the choice is made per call, by the
    step's token count (CUDA graphs record whichever ran).
    """
    if x.is_cuda and 0 < x.shape[0] <= SMALL_ROWS and x.dtype != torch.float32 and kernel_ok(x.device):
        return small_linear(x, weight, bias, gelu)
    return reference(x, weight, bias, gelu)


@linear.register_fake
def _linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gelu: bool) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))

