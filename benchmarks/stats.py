"""Statistics for comparisons over seeds: mean, standard deviation, and a verdict on a claim
from paired differences with a 95% Student-t interval.

A claim "A's metric < B's" is evaluated on the per-seed differences d_s = A_s - B_s (the
same seed gives both runs the same data order and initialisation: a paired design):
``holds`` when the whole interval is below 0, ``reversed`` when it is above 0, ``not shown``
when it contains 0 (or with fewer than two seeds).
"""

from __future__ import annotations

import math
import statistics

# Two-sided 95% Student-t quantiles t_{0.975, df} for df = 1..30 (beyond: the normal 1.96).
T975 = [
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
]  # fmt: skip


def t_quantile_975(df: int) -> float:
    if df < 1:
        raise ValueError(f"df={df}: a t interval needs at least two samples")
    return T975[df - 1] if df <= len(T975) else 1.96


def summarize(values: list[float]) -> dict[str, float | int]:
    """``{"mean", "sd", "n"}`` of ``values`` (sd 0 for one value)."""
    n = len(values)
    return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if n > 1 else 0.0, "n": n}


def paired_interval(a: list[float], b: list[float]) -> dict[str, float | int | None]:
    """Mean of the paired differences ``a_s - b_s`` and its 95% interval ``[lo, hi]``
    (None with fewer than two pairs)."""
    if len(a) != len(b):
        raise ValueError(f"paired samples need equal lengths, got {len(a)} and {len(b)}")
    d = [x - y for x, y in zip(a, b, strict=True)]
    n = len(d)
    mean = statistics.fmean(d)
    if n < 2:
        return {"mean": mean, "lo": None, "hi": None, "n": n}
    half = t_quantile_975(n - 1) * statistics.stdev(d) / math.sqrt(n)
    return {"mean": mean, "lo": mean - half, "hi": mean + half, "n": n}


def verdict(interval: dict, below: float = 0.0) -> str:
    """For the claim "difference < ``below``": holds / reversed / not shown."""
    lo, hi = interval["lo"], interval["hi"]
    if lo is None:
        return "not shown"
    if hi < below:
        return "holds"
    if lo > below:
        return "reversed"
    return "not shown"
