"""Mixture-of-Depths token moves: the chosen tokens out of ``[B, T, D]`` and ``x + g * y`` back
in, as fused autograd functions over a row backend (``TorchRows`` here, or the Triton kernels
of ``mode.kernels.mod_tokens``). The MoD blocks (``mode.layers.mod``) are their user; which
tokens move is decided in ``mode.routing.mod_topk``.

Legend: B batch, T sequence length, D model dim, k tokens chosen per sequence.
"""

from __future__ import annotations

import torch


def token_rows(indices: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[B, k] positions -> [B * k] rows of the flattened ``[B * T, D]`` token matrix."""
    offsets = torch.arange(indices.shape[0], device=indices.device).unsqueeze(1) * seq_len
    return (indices + offsets).flatten()


def gather_tokens(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """x: [B, T, D], indices: [B, k] -> [B, k, D]. Public on purpose: the plain gather that
    ``take_tokens``' fused autograd function equals (the tests compare against it)."""
    B, T, D = x.shape
    return x.reshape(B * T, D).index_select(0, token_rows(indices, T)).view(B, -1, D)


class TorchRows:
    """The row primitives of the MoD token moves in torch ops (any device, any dtype). A
    backend is any object with these three functions: ``mode.kernels.mod_tokens`` is the
    Triton one. Rows are distinct (top-k per sequence makes them)."""

    @staticmethod
    def gather_rows(src: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """src: [R, D], rows: [n] -> src[rows] [n, D]."""
        return src.index_select(0, rows)

    @staticmethod
    def add_rows_(
        dst: torch.Tensor, rows: torch.Tensor, update: torch.Tensor, gate: torch.Tensor | None = None
    ) -> None:
        """In place: dst[rows[i]] += gate[i] * update[i] (gate None = 1); dst [R, D], update [n, D]."""
        if gate is not None:
            update = update * gate.to(update.dtype).unsqueeze(-1)
        dst.index_add_(0, rows, update.to(dst.dtype))

    @staticmethod
    def gated_rows_backward(
        grad: torch.Tensor,
        rows: torch.Tensor,
        gate: torch.Tensor,
        update: torch.Tensor,
        need_update: bool,
        need_gate: bool,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Gradients of ``dst[rows] += gate * update`` from the output gradient grad [R, D]:
        (grad_update = gate * grad[rows] [n, D], grad_gate = <grad[rows], update> [n]), each
        None unless asked for."""
        grad_rows = grad.index_select(0, rows).to(update.dtype)  # [n, D]
        grad_gate = torch.linalg.vecdot(grad_rows, update).to(gate.dtype) if need_gate else None
        grad_update = grad_rows * gate.to(update.dtype).unsqueeze(-1) if need_update else None
        return grad_update, grad_gate


class _TakeTokens(torch.autograd.Function):
    """(x, rows, ops) -> (x[rows] [B, k, D], alias of x [B, T, D]), rows from ``token_rows``.

    Backward receives the gradient of both outputs at once and returns
    ``grad_alias + scatter(grad_sel)`` with one copy and a k-row add, instead of autograd's
    zero-fill, scatter and full-size add of two separate gradients.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, rows: torch.Tensor, ops):
        B, T, D = x.shape
        ctx.save_for_backward(rows)
        ctx.x_shape, ctx.ops = x.shape, ops
        return ops.gather_rows(x.reshape(B * T, D), rows).view(B, -1, D), x.view_as(x)

    @staticmethod
    def backward(ctx, grad_sel: torch.Tensor | None, grad_x: torch.Tensor | None):
        (rows,) = ctx.saved_tensors
        B, T, D = ctx.x_shape
        if grad_x is not None:
            out = grad_x.clone(memory_format=torch.contiguous_format)
        else:
            out = grad_sel.new_zeros(ctx.x_shape)
        if grad_sel is not None:
            ctx.ops.add_rows_(out.view(B * T, D), rows, grad_sel.reshape(-1, D).contiguous())
        return out, None, None


def take_tokens(
    x: torch.Tensor, indices: torch.Tensor, rows: torch.Tensor | None = None, ops=TorchRows
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather the chosen tokens and an alias of ``x`` for the residual path.

    x: [B, T, D], indices: [B, k] -> (x_sel [B, k, D], x [B, T, D]). Values equal
    ``(gather_tokens(x, indices), x)``; use both outputs so the backward is a single pass.
    ``rows`` = ``token_rows(indices, T)`` when the caller has it already; ``ops``: the row
    primitives (``TorchRows``, or ``mode.kernels.mod_tokens`` for the Triton kernels).
    """
    rows = token_rows(indices, x.shape[1]) if rows is None else rows
    return _TakeTokens.apply(x.contiguous(), rows.contiguous(), ops)


class _AddGatedTokens(torch.autograd.Function):
    """(x [B, T, D], rows [n], gate [n], update [n, D], ops) -> x with ``gate * update`` added at rows.

    One autograd node for the gate multiply and the scatter: the backward reads the k rows
    of the output gradient once and derives both the update's and the gate's gradients from
    them; the residual's gradient is the output gradient itself (no copy).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, rows: torch.Tensor, gate: torch.Tensor, update: torch.Tensor, ops):
        B, T, D = x.shape
        ctx.save_for_backward(rows, gate, update)
        ctx.ops = ops
        out = x.clone(memory_format=torch.contiguous_format)
        ops.add_rows_(out.view(B * T, D), rows, update, gate)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, gate, update = ctx.saved_tensors
        need_gate, need_update = ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        grad_gate = grad_update = None
        if need_gate or need_update:
            grad2 = grad.reshape(-1, grad.shape[-1]).contiguous()
            grad_update, grad_gate = ctx.ops.gated_rows_backward(grad2, rows, gate, update, need_update, need_gate)
        return grad, None, grad_gate, grad_update, None


def add_gated_tokens(
    x: torch.Tensor,
    indices: torch.Tensor,
    gate: torch.Tensor,
    update: torch.Tensor,
    rows: torch.Tensor | None = None,
    ops=TorchRows,
) -> torch.Tensor:
    """Return ``x`` with ``gate * update`` added at ``indices``; other rows are ``x`` bit for bit.

    x: [B, T, D], indices: [B, k], gate: [B, k], update: [B, k, D] -> [B, T, D], out of place,
    differentiable w.r.t. x, gate and update. ``rows`` = ``token_rows(indices, T)`` if known;
    ``ops``: the row primitives (see ``take_tokens``).
    """
    B, T, D = x.shape
    rows = token_rows(indices, T) if rows is None else rows
    return _AddGatedTokens.apply(
        x, rows.contiguous(), gate.reshape(-1).contiguous(), update.reshape(-1, D).contiguous(), ops
    )
