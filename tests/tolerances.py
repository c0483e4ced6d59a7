"""Every tolerance the tests compare with, in one table by what is compared and in which dtype.

A fast path is compared with its reference under the row that names how far apart their
arithmetic is, never under a number picked for one test (xformers keeps its tolerances the
same way). The rows, from the tightest:

- ``exact``: the same operations in the same order; the results are the same bits.
- ``elementwise``: the same sums and products, rounded at other points (a fused kernel
  against the torch ops it replaces, a gather-and-add against a dense reference).
- ``reduction``: a sum or matmul taken in another order or split differently (gradients
  accumulated over micro-batches, across ranks, a kernel's blocked matmul).
- ``layer``: a layer's output through another code path (kernel, backend, block, convert).
- ``layer_grad``: the gradients of such a layer; backward sums over more terms.
- ``model``: a whole model's logits through another path (KV-cache decoding, expert
  parallel reload, a checkpoint format).
- ``training``: values a few optimizer steps later (compiled against eager); differences
  grow through every update.
- ``attention_kernel``: a fused attention kernel (xformers, flash) with its own blocked
  softmax against torch's attention.

Low-precision rows are as wide as one or two roundings of a value of order one in that
dtype (bf16 keeps 8 mantissa bits: a relative step of 2^-8 = 3.9e-3). float64 has rows for
the ops a float64 reference is checked at; its other ops use the float32 row.
"""

from __future__ import annotations

import torch

_F64, _F32, _BF16, _F16 = torch.float64, torch.float32, torch.bfloat16, torch.float16

# (op, dtype) -> (atol, rtol)
TOLERANCES: dict[tuple[str, torch.dtype], tuple[float, float]] = {
    ("exact", _F64): (0.0, 0.0),
    ("exact", _F32): (0.0, 0.0),
    ("exact", _BF16): (0.0, 0.0),
    ("exact", _F16): (0.0, 0.0),
    ("elementwise", _F64): (1e-12, 1e-12),
    ("elementwise", _F32): (1e-6, 1e-6),
    ("elementwise", _BF16): (1e-2, 1e-2),
    ("elementwise", _F16): (1e-3, 1e-3),
    ("reduction", _F32): (1e-6, 1e-5),
    ("reduction", _BF16): (2e-2, 2e-2),
    ("reduction", _F16): (2e-3, 2e-3),
    ("layer", _F32): (1e-5, 1e-5),
    ("layer", _BF16): (3e-2, 3e-2),
    ("layer", _F16): (4e-3, 4e-3),
    ("layer_grad", _F32): (1e-5, 1e-4),
    ("layer_grad", _BF16): (5e-2, 5e-2),
    ("layer_grad", _F16): (5e-3, 5e-3),
    ("model", _F32): (1e-4, 1e-4),
    ("model", _BF16): (5e-2, 5e-2),
    ("model", _F16): (1e-2, 1e-2),
    ("training", _F32): (2e-4, 2e-3),
    ("training", _BF16): (1e-1, 1e-1),
    ("training", _F16): (2e-2, 2e-2),
    ("attention_kernel", _F32): (2e-3, 2e-3),
    ("attention_kernel", _BF16): (2e-2, 2e-2),
    ("attention_kernel", _F16): (4e-3, 4e-3),
}

_PRECISION = [_F64, _F32, _F16, _BF16]  # from the most to the least precise


def tolerance(op: str, dtype: torch.dtype = _F32) -> tuple[float, float]:
    """(atol, rtol) of ``op`` in ``dtype``; float64 without a row of its own uses float32's."""
    key = (op, dtype) if (op, dtype) in TOLERANCES or dtype != _F64 else (op, _F32)
    if key not in TOLERANCES:
        ops = sorted({o for o, _ in TOLERANCES})
        raise KeyError(f"no tolerance for {op!r} in {dtype}; the table has ops {ops} in float32, bfloat16, float16")
    return TOLERANCES[key]


def _dtype_of(value) -> torch.dtype:
    return value.dtype if isinstance(value, torch.Tensor) and value.is_floating_point() else _F32


def assert_close(actual, expected, op: str, dtype: torch.dtype | None = None, msg: str | None = None) -> None:
    """``torch.testing.assert_close`` under the table's row for ``op``.

    ``dtype`` is the precision the values were computed in; by default the least precise dtype
    of the two. Tensors of different float dtypes (a bf16 fast path against an fp32 reference)
    are compared in the more precise one at the less precise one's tolerance.
    """
    da, de = _dtype_of(actual), _dtype_of(expected)
    atol, rtol = tolerance(op, dtype or max(da, de, key=_PRECISION.index))
    if da != de and isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor):
        common = min(da, de, key=_PRECISION.index)
        actual, expected = actual.to(common), expected.to(common)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=msg)
