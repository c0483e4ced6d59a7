"""Mixture-of-Depths token movement in Triton: the chosen rows out, ``x + g * y`` back in.

Legend: B batch, T tokens, D model dim, n = B * k chosen rows of the flattened ``[B * T, D]``
token matrix (``rows``: distinct, as top-k per sequence makes them).

The three row primitives of the MoD token moves, as launchers without autograd: the autograd
functions that use them live once, in ``mode.layers.mod_moves``, which takes this module as
its ``ops`` (``TorchRows`` there is the torch backend the tests compare against):

- ``gather_rows(src [R, D], rows [n]) -> src[rows] [n, D]``: one program per row.
- ``add_rows_(dst [R, D], rows [n], update [n, D], gate [n] | None)``: in place
  ``dst[rows[i]] += gate[i] * update[i]``, computed in float32 and rounded once.
- ``gated_rows_backward(grad, rows, gate, update, need_update, need_gate)``: reads the chosen
  rows of the output gradient once and writes both ``grad_update = gate * grad[rows]`` and
  ``grad_gate = <grad[rows], update>``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAX_BLOCK_D = 1024


def _block_d(d: int) -> int:
    return min(triton.next_power_of_2(max(d, 1)), _MAX_BLOCK_D)


@triton.jit
def _gather_rows_kernel(src_ptr, rows_ptr, out_ptr, D, stride_src, stride_out, BLOCK_D: tl.constexpr):
    """out[i, :] = src[rows[i], :]; one program per row."""
    i = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + i).to(tl.int64)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        ok = cols < D
        tl.store(out_ptr + i * stride_out + cols, tl.load(src_ptr + row * stride_src + cols, mask=ok), mask=ok)


@triton.jit
def _add_rows_kernel(
    dst_ptr, rows_ptr, gate_ptr, upd_ptr, D, stride_dst, stride_upd, HAS_GATE: tl.constexpr, BLOCK_D: tl.constexpr
):
    """dst[rows[i], :] += gate[i] * upd[i, :] in float32, in place (rows distinct)."""
    i = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + i).to(tl.int64)
    if HAS_GATE:
        g = tl.load(gate_ptr + i).to(tl.float32)
    else:
        g = 1.0
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        ok = cols < D
        dst = dst_ptr + row * stride_dst + cols
        u = tl.load(upd_ptr + i * stride_upd + cols, mask=ok).to(tl.float32)
        x = tl.load(dst, mask=ok).to(tl.float32)
        tl.store(dst, (x + g * u).to(dst_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gated_rows_backward_kernel(
    grad_ptr,
    rows_ptr,
    gate_ptr,
    upd_ptr,
    grad_upd_ptr,
    grad_gate_ptr,
    D,
    stride_grad,
    stride_upd,
    NEED_UPD: tl.constexpr,
    NEED_GATE: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """grad_upd[i] = gate[i] * grad[rows[i]]; grad_gate[i] = <grad[rows[i]], upd[i]> (float32)."""
    i = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + i).to(tl.int64)
    g = tl.load(gate_ptr + i).to(tl.float32)
    dot = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        ok = cols < D
        gr = tl.load(grad_ptr + row * stride_grad + cols, mask=ok, other=0.0).to(tl.float32)
        if NEED_UPD:
            tl.store(grad_upd_ptr + i * stride_upd + cols, (g * gr).to(grad_upd_ptr.dtype.element_ty), mask=ok)
        if NEED_GATE:
            dot += gr * tl.load(upd_ptr + i * stride_upd + cols, mask=ok, other=0.0).to(tl.float32)
    if NEED_GATE:
        tl.store(grad_gate_ptr + i, tl.sum(dot, axis=0).to(grad_gate_ptr.dtype.element_ty))


def gather_rows(src: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """src: [R, D] (rows contiguous), rows: [n] -> src[rows] [n, D] (no autograd)."""
    out = src.new_empty(rows.numel(), src.shape[1])
    if out.numel():
        _gather_rows_kernel[(rows.numel(),)](
            src, rows, out, src.shape[1], src.stride(0), out.stride(0), BLOCK_D=_block_d(src.shape[1])
        )
    return out


def add_rows_(dst: torch.Tensor, rows: torch.Tensor, update: torch.Tensor, gate: torch.Tensor | None = None) -> None:
    """In place: dst[rows[i]] += gate[i] * update[i] (gate None = 1); dst [R, D], update [n, D],
    rows distinct (no autograd)."""
    if update.numel():
        _add_rows_kernel[(rows.numel(),)](
            dst,
            rows,
            update if gate is None else gate,
            update,
            dst.shape[1],
            dst.stride(0),
            update.stride(0),
            HAS_GATE=gate is not None,
            BLOCK_D=_block_d(dst.shape[1]),
        )


def gated_rows_backward(
    grad: torch.Tensor, rows: torch.Tensor, gate: torch.Tensor, update: torch.Tensor, need_update: bool, need_gate: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """From the output gradient grad [R, D] (rows contiguous) of ``dst[rows] += gate * update``:
    (grad_update = gate * grad[rows] [n, D], grad_gate = <grad[rows], update> [n]) in one
    kernel reading each chosen row once, each None unless asked for (no autograd)."""
    grad_gate = torch.empty_like(gate) if need_gate else None
    grad_update = torch.empty_like(update) if need_update else None
    if (need_gate or need_update) and rows.numel():
        _gated_rows_backward_kernel[(rows.numel(),)](
            grad,
            rows,
            gate,
            update,
            grad_update if need_update else update,
            grad_gate if need_gate else gate,
            grad.shape[1],
            grad.stride(0),
            update.stride(0),
            NEED_UPD=need_update,
            NEED_GATE=need_gate,
            BLOCK_D=_block_d(grad.shape[1]),
        )
    return grad_update, grad_gate
