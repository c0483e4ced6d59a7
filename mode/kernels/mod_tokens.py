"""Mixture-of-Depths token movement in Triton: the chosen rows out, ``x + g * y`` back in.

Legend: B batch, T tokens, D model dim, n = B * k chosen rows of the flattened ``[B * T, D]``
token matrix (``rows``: distinct, as top-k per sequence makes them).

- ``take_tokens(x [B, T, D], rows [n]) -> (x[rows] [B, k, D], alias of x)``: one kernel
  gathers the rows; the backward is the incoming residual gradient plus the chosen rows'
  gradient added in place at ``rows`` (one copy, one n-row kernel).
- ``add_gated_tokens(x [B, T, D], rows [n], gate [n], update [n, D]) -> [B, T, D]``: ``x`` with
  ``gate[i] * update[i]`` added at row ``rows[i]`` (computed in float32, rounded once), other
  rows bit for bit ``x``. The backward reads the chosen rows of the output gradient once and
  writes both ``grad_update = gate * grad[rows]`` and ``grad_gate = <grad[rows], update>``.

Same contracts as ``mode.routing.mod_topk.take_tokens`` / ``add_gated_tokens`` (the torch
path, which the tests compare against).
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


class _TakeTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, rows: torch.Tensor):
        B, T, D = x.shape
        ctx.save_for_backward(rows)
        ctx.x_shape = x.shape
        return gather_rows(x.reshape(B * T, D), rows).view(B, -1, D), x.view_as(x)

    @staticmethod
    def backward(ctx, grad_sel: torch.Tensor | None, grad_x: torch.Tensor | None):
        (rows,) = ctx.saved_tensors
        B, T, D = ctx.x_shape
        if grad_x is not None:
            out = grad_x.clone(memory_format=torch.contiguous_format)
        else:
            out = grad_sel.new_zeros(ctx.x_shape)
        if grad_sel is not None:
            add_rows_(out.view(B * T, D), rows, grad_sel.reshape(-1, D).contiguous())
        return out, None


class _AddGatedTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, rows: torch.Tensor, gate: torch.Tensor, update: torch.Tensor):
        B, T, D = x.shape
        ctx.save_for_backward(rows, gate, update)
        out = x.clone(memory_format=torch.contiguous_format)
        add_rows_(out.view(B * T, D), rows, update, gate)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, gate, update = ctx.saved_tensors
        need_gate, need_update = ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        grad_gate = torch.empty_like(gate) if need_gate else None
        grad_update = torch.empty_like(update) if need_update else None
        if (need_gate or need_update) and rows.numel():
            grad2 = grad.reshape(-1, grad.shape[-1]).contiguous()
            _gated_rows_backward_kernel[(rows.numel(),)](
                grad2,
                rows,
                gate,
                update,
                grad_update if need_update else update,
                grad_gate if need_gate else gate,
                grad2.shape[1],
                grad2.stride(0),
                update.stride(0),
                NEED_UPD=need_update,
                NEED_GATE=need_gate,
                BLOCK_D=_block_d(grad2.shape[1]),
            )
        return grad, None, grad_gate, grad_update


def take_tokens(x: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [B, T, D], rows: [B * k] distinct rows of ``x.view(B * T, D)`` -> (x_sel [B, k, D],
    an alias of x for the residual path: use both, so the backward is one pass)."""
    return _TakeTokens.apply(x.contiguous(), rows.contiguous())


def add_gated_tokens(x: torch.Tensor, rows: torch.Tensor, gate: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """x: [B, T, D] with ``gate[i] * update[i]`` added at ``rows[i]`` ([n], distinct), out of
    place; gate: [n], update: [n, D]. Differentiable w.r.t. x, gate and update."""
    return _AddGatedTokens.apply(x, rows.contiguous(), gate.contiguous(), update.contiguous())
