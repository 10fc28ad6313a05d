"""Percentiles of latency samples, as every benchmark JSON reports them (numpy only: no torch import)."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def percentiles(samples: Sequence[float], unit: str = "ms", digits: int | None = None) -> dict[str, float] | None:
    """p50/p90/p99/mean of `samples` (already in `unit`, rounded to `digits` if given) and their
    count; None when there are none."""
    if len(samples) == 0:
        return None
    a = np.asarray(samples, dtype=np.float64)
    values = {"p50": np.percentile(a, 50), "p90": np.percentile(a, 90), "p99": np.percentile(a, 99), "mean": a.mean()}
    out: dict[str, float] = {f"{k}_{unit}": float(v) if digits is None else round(float(v), digits)
                             for k, v in values.items()}
    out["n"] = int(a.size)
    return out
