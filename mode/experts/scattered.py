"""The scattered expert GEMMs as autograd functions over the Triton launchers of
``mode.kernels.scatter_gemm`` (ScatterMoE's layout): the first GEMM reads token rows through
the expert-sorted assignment index, the second writes back to token order with the router
weights applied, and their backward passes are grouped GEMMs of the same launchers.

Importing this module imports Triton: ``ExpertMLP`` and the ``triton`` grouped-GEMM backend
import it only when they use it.

Legend: N tokens, K experts per token, M assignments computed (expert order), E experts,
D model dim, F expert hidden.
"""

from __future__ import annotations

import torch

from mode.kernels.scatter_gemm import rows_gemm, rows_wgrad


def _slot_buffer(like: torch.Tensor, n_tokens: int, top_k: int, width: int, n_rows: int) -> torch.Tensor:
    """[N * K, width] buffer of per-assignment rows; zero-filled only when some assignments
    are absent (M < N * K, or a static-size dispatch's N * K + 1 rows, some of which no
    expert computes), since then some slots are never written."""
    make = torch.zeros if n_rows != n_tokens * top_k else torch.empty
    return make(n_tokens * top_k, width, dtype=like.dtype, device=like.device)


def _sum_slots(buffer: torch.Tensor, n_tokens: int, top_k: int) -> torch.Tensor:
    """[N * K, W] -> [N, W], each token's K slots summed (a view when K = 1)."""
    if top_k == 1:
        return buffer
    return buffer.view(n_tokens, top_k, -1).sum(1)


class _ScatteredGemm(torch.autograd.Function):
    """h[m] = x[rows[m]] @ w[e(m)] (see ``scattered_gemm``)."""

    @staticmethod
    def forward(ctx, x, w, rows, slots, counts, top_k: int):
        ctx.save_for_backward(x, w, rows, slots, counts)
        ctx.top_k = top_k
        # NOTE: a static-size dispatch has rows past every expert's (no tile writes them):
        # zeros there, so the rows stay finite through the activation and the combine.
        padded = rows.numel() > x.shape[0] * top_k
        out = (x.new_zeros if padded else x.new_empty)(rows.numel(), w.shape[2])
        return rows_gemm(x, w, counts, out, src_rows=rows)

    @staticmethod
    def backward(ctx, grad):
        x, w, rows, slots, counts = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            N, K = x.shape[0], ctx.top_k
            buffer = _slot_buffer(grad, N, K, x.shape[1], rows.numel())
            rows_gemm(grad, w.transpose(1, 2), counts, buffer, dst_rows=slots)
            grad_x = _sum_slots(buffer, N, K)
        if ctx.needs_input_grad[1]:
            grad_w = rows_wgrad(x, grad, counts, a_rows=rows)
        return grad_x, grad_w, None, None, None, None


class _GemmCombine(torch.autograd.Function):
    """out[n] = sum over n's assignments m of weights[m] * h[m] @ w[e(m)] (see ``gemm_combine``)."""

    @staticmethod
    def forward(ctx, h, w, weights, rows, slots, counts, top_k: int, n_tokens: int):
        ctx.save_for_backward(h, w, weights, rows, counts)
        ctx.top_k = top_k
        buffer = _slot_buffer(h, n_tokens, top_k, w.shape[2], rows.numel())
        rows_gemm(h, w, counts, buffer, dst_rows=slots, scale=weights)
        return _sum_slots(buffer, n_tokens, top_k)

    @staticmethod
    def backward(ctx, grad):
        h, w, weights, rows, counts = ctx.saved_tensors
        grad = grad.contiguous()
        grad_h = grad_w = grad_weights = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[2]:
            # d(out)/d(h[m]) before the weight: grad[rows[m]] @ w[e]^T, read through rows.
            padded = rows.numel() > grad.shape[0] * ctx.top_k  # rows no expert computes: zeros
            buffer = h.new_zeros(h.shape) if padded else h.new_empty(h.shape)
            grad_h_raw = rows_gemm(grad, w.transpose(1, 2), counts, buffer, src_rows=rows)
            if ctx.needs_input_grad[2]:  # <grad[rows[m]], h[m] @ w[e]> = <grad_h_raw[m], h[m]>
                grad_weights = torch.linalg.vecdot(grad_h_raw.float(), h.float()).to(weights.dtype)
            if ctx.needs_input_grad[0]:
                grad_h = grad_h_raw * weights.to(h.dtype).unsqueeze(-1)
        if ctx.needs_input_grad[1]:
            grad_w = rows_wgrad(h, grad, counts, b_rows=rows, scale=weights)
        return grad_h, grad_w, grad_weights, None, None, None, None, None


class _GroupedMM(torch.autograd.Function):
    """out = x @ w[e] per group of rows (see ``grouped_mm``)."""

    @staticmethod
    def forward(ctx, x, w, counts):
        ctx.save_for_backward(x, w, counts)
        return rows_gemm(x, w, counts, x.new_empty(x.shape[0], w.shape[2]))

    @staticmethod
    def backward(ctx, grad):
        x, w, counts = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = rows_gemm(grad, w.transpose(1, 2), counts, torch.empty_like(x)) if ctx.needs_input_grad[0] else None
        grad_w = rows_wgrad(x, grad, counts) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


def scattered_gemm(
    x: torch.Tensor, w: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor, top_k: int
) -> torch.Tensor:
    """First expert GEMM with the gather fused: x [N, D] in token order, w [E, D, F], rows,
    slots [M] (expert order), counts [E] -> h [M, F] with ``h[m] = x[rows[m]] @ w[e(m)]``.
    The backward writes dx through ``slots`` and sums each token's K rows."""
    return _ScatteredGemm.apply(x.contiguous(), w, rows.contiguous(), slots.contiguous(), counts, top_k)


def gemm_combine(
    h: torch.Tensor,
    w: torch.Tensor,
    weights: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    counts: torch.Tensor,
    top_k: int,
    n_tokens: int,
) -> torch.Tensor:
    """Second expert GEMM with the combine fused: h [M, F] (expert order), w [E, F, D],
    weights [M] -> out [N, D] with ``out[n] = sum of weights[m] * h[m] @ w[e(m)]`` over n's
    assignments (tokens with none get 0). Gradients for h, w and weights."""
    return _GemmCombine.apply(
        h.contiguous(), w, weights.contiguous(), rows.contiguous(), slots.contiguous(), counts, top_k, n_tokens
    )


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Plain grouped GEMM: x [M, K] sorted by expert, w [E, K, N], counts [E] -> [M, N]."""
    return _GroupedMM.apply(x.contiguous(), w, counts)
