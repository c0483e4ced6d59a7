"""Training precision: ``fp32``, ``bf16`` (autocast) or ``auto`` (bf16 where it is faster).

Under ``bf16`` the forward runs in ``torch.autocast(dtype=bfloat16)``: parameters, gradients
and optimizer state stay fp32; matmuls (attention, MLPs, experts) run in bf16; router
projections, softmax/top-k, MoD scores, auxiliary losses and the LM loss are fp32
(``mode.routed.router_projection``, the losses' own ``.float()``, ``F.cross_entropy`` on
fp32 logits).

``auto`` decides by measurement, once per process and device: a 512 x 512 x 512 matmul timed
in fp32 and in bf16 (best of 5 after a warm-up); bf16 when it is at least 1.3x faster
(on CPUs with AMX or AVX512-BF16 it is ~3x; on CPUs that emulate bf16 it is slower; on CUDA
GPUs with bf16 tensor cores it is faster).
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Literal, get_args

import torch

Precision = Literal["fp32", "bf16", "auto"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
PRECISION_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}  # resolved names
BF16_MIN_SPEEDUP = 1.3


def matmul_seconds(
    n: int,
    dtype: torch.dtype,
    device: torch.device,
    reps: int,
    per_rep: int = 1,
    warmup: int = 1,
    min_seconds: float = 0.0,
) -> tuple[float, int]:
    """Best time of one ``[n, n] @ [n, n]`` matmul in ``dtype`` on ``device``: ``warmup``
    untimed, then timings of ``per_rep`` matmuls each, at least ``reps`` of them and until
    ``min_seconds`` were spent. Returns (seconds per matmul, timings taken)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    for _ in range(warmup):
        a @ b
    sync()
    best, spent, taken = float("inf"), 0.0, 0
    while taken < reps or spent < min_seconds:
        t0 = time.perf_counter()
        for _ in range(per_rep):
            a @ b
        sync()
        dt = time.perf_counter() - t0
        best, spent, taken = min(best, dt), spent + dt, taken + 1
    return best / per_rep, taken


@functools.cache
def bf16_speedup(device: str = "cpu") -> float:
    """fp32 time / bf16 time of a 512^3 matmul on ``device`` (best of 5 timings of 4 after a
    warm-up)."""
    dev = torch.device(device)
    try:
        fp32, _ = matmul_seconds(512, torch.float32, dev, reps=5, per_rep=4)
        return fp32 / matmul_seconds(512, torch.bfloat16, dev, reps=5, per_rep=4)[0]
    except RuntimeError:  # no bf16 matmul on this device
        return 0.0


def resolve(precision: str, device: torch.device | str = "cpu") -> str:
    """``fp32`` or ``bf16``: ``auto`` becomes bf16 where ``bf16_speedup`` >= 1.3."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is invalid: choose one of {list(PRECISIONS)}")
    if precision != "auto":
        return precision
    return "bf16" if bf16_speedup(str(torch.device(device))) >= BF16_MIN_SPEEDUP else "fp32"


def autocast(precision: str, device: torch.device | str = "cpu") -> contextlib.AbstractContextManager:
    """The forward's context for a resolved ``precision`` (a no-op for fp32)."""
    dev = torch.device(device)
    if precision == "bf16":
        return torch.autocast(dev.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
