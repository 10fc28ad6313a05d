"""Percentiles of latency samples, as every benchmark JSON reports them (numpy only: no torch import)."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def percentiles(samples: Sequence[float], unit: str = "ms") -> dict[str, float] | None:
    """p50/p90/p99/mean of `samples` (already in `unit`) and their count; None when there are none."""
    if len(samples) == 0:
        return None
    a = np.asarray(samples, dtype=np.float64)
    return {f"p50_{unit}": float(np.percentile(a, 50)), f"p90_{unit}": float(np.percentile(a, 90)),
            f"p99_{unit}": float(np.percentile(a, 99)), f"mean_{unit}": float(a.mean()), "n": int(a.size)}
