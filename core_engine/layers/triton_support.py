"""Fern's own Triton kernels: whether one may serve, decided by checking it against its torch formula.

A kernel serves only where Triton is installed, FERN_TRITON_KERNELS is not 0 and, on the
device at hand, its output matched the formula's on random rows. Otherwise the formula
serves (logged once per kernel and device), so a broken kernel can cost speed, never vectors.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

try:
    import triton
except ImportError:  # the CPU install has no Triton; the torch formulas serve
    triton = None


def check_kernel(name: str, device: torch.device, compare: Callable[[torch.device], float],
                 tolerance: float) -> bool:
    """Whether kernel `name` may serve on `device`: `compare(device)` (its largest difference from
    the formula) runs unless Triton is off or missing, and must stay under `tolerance`."""
    if os.environ.get("FERN_TRITON_KERNELS") == "0":
        log.info("FERN_TRITON_KERNELS=0: %s runs as torch ops", name)
        return False
    if triton is None:
        log.info("Triton is not installed: %s runs as torch ops", name)
        return False
    try:
        err = compare(device)
    except Exception as exc:  # noqa: BLE001 - any Triton failure: serve with torch ops
        log.warning("Triton %s kernel failed (%s: %s); using torch ops", name, type(exc).__name__, exc)
        return False
    if not err < tolerance:
        log.warning("Triton %s kernel is off by %.3g; using torch ops", name, err)
        return False
    return True
