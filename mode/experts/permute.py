"""Sort assignments by expert, gather tokens, and scatter expert outputs back.

Legend: N tokens, D model dim, K experts per token, E experts, M assignments computed
(M = N*K dropless; fewer when some are dropped or go to no-op experts).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Dispatch(NamedTuple):
    """Assignments sorted by expert (stable: ties keep token order).

    order:     [M] index into the flattened [N*K] assignments, sorted by expert.
    token_idx: [M] token row each sorted assignment reads (``order // K``).
    counts:    [E] assignments per expert (grouped-GEMM group sizes).
    """

    order: torch.Tensor
    token_idx: torch.Tensor
    counts: torch.Tensor


def sort_by_expert(
    experts: torch.Tensor, n_experts: int, keep: torch.Tensor | None = None, has_noop: bool = False
) -> Dispatch:
    """experts: [N, K] expert ids; keep: [N, K] bool (None = all). With ``has_noop``, ids >=
    ``n_experts`` (no-op experts) are left out, as are assignments whose ``keep`` is False.
    Without either, M = N*K and no shape depends on the data (compile-friendly)."""
    N, K = experts.shape
    flat = experts.reshape(-1)
    valid = flat < n_experts
    if keep is not None:
        valid = valid & keep.reshape(-1)
    # NOTE: invalid assignments get key E and sort to the end, where they are cut off.
    key = torch.where(valid, flat, torch.full_like(flat, n_experts))
    counts = torch.bincount(key, minlength=n_experts + 1)[:n_experts]
    order = torch.sort(key, stable=True).indices
    if keep is not None or has_noop:
        order = order[: int(counts.sum())]
    return Dispatch(order, torch.div(order, K, rounding_mode="floor"), counts)


def permute(x: torch.Tensor, dispatch: Dispatch) -> torch.Tensor:
    """x: [N, D] -> [M, D], the token rows in expert order."""
    return x.index_select(0, dispatch.token_idx)


def sorted_weights(weights: torch.Tensor, dispatch: Dispatch) -> torch.Tensor:
    """weights: [N, K] combine weights -> [M] in the dispatch's expert order."""
    return weights.reshape(-1).index_select(0, dispatch.order)


def unpermute(y: torch.Tensor, token_idx: torch.Tensor, weights: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """Combine expert outputs back to tokens: ``out[n] = sum of w[m] * y[m] over m with token_idx[m] = n``.

    y: [M, D] in expert order; token_idx, weights: [M] -> [N, D]. Tokens that received no
    assignment get zeros.
    """
    out = y.new_zeros(n_tokens, y.shape[-1])
    return out.index_add(0, token_idx, y * weights.unsqueeze(-1).to(y.dtype))


class _Combine(torch.autograd.Function):
    """out[n] = sum_k w[n, k] * y[inverse[n, k]], as one gather and one batched matvec.

    y: [M, D] expert order; weights: [N, K] (zero where not dispatched); inverse: [N*K] row
    of y for each assignment (0 where not dispatched); order/token_idx: [M] (see Dispatch).
    Compared with ``y * w`` + ``index_add``, this writes one [M, D] temporary instead of two
    and needs no zero-filled output; the backward gathers and scales in place.
    """

    @staticmethod
    def forward(ctx, y, weights, inverse, order, token_idx, dispatched):
        N, K = weights.shape
        y_tok = y.index_select(0, inverse).view(N, K, -1)  # [N, K, D] token order
        w = weights.to(y.dtype)
        ctx.save_for_backward(y_tok, w, order, token_idx, dispatched)
        return torch.bmm(w.unsqueeze(1), y_tok).squeeze(1)

    @staticmethod
    def backward(ctx, grad_out):
        y_tok, w, order, token_idx, dispatched = ctx.saved_tensors
        grad_y = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_y = grad_out.index_select(0, token_idx)  # [M, D]
            grad_y.mul_(w.reshape(-1).index_select(0, order).unsqueeze(-1))
        if ctx.needs_input_grad[1]:
            grad_w = torch.bmm(y_tok, grad_out.unsqueeze(-1)).squeeze(-1)  # [N, K]
            grad_w = grad_w * dispatched if dispatched.numel() else grad_w
        return grad_y, grad_w, None, None, None, None


def combine(y: torch.Tensor, dispatch: Dispatch, weights: torch.Tensor) -> torch.Tensor:
    """Token-choice combine: y [M, D] in expert order, weights [N, K] -> [N, D].

    Equals ``unpermute(y, dispatch.token_idx, sorted_weights(weights, dispatch), N)``;
    assignments not in the dispatch (dropped, no-op) contribute zero.
    """
    N, K = weights.shape
    if dispatch.order.numel() == 0:
        return y.new_zeros(N, y.shape[-1]) + 0 * weights.sum()  # keeps the graph to the router
    inverse = torch.zeros(N * K, dtype=torch.long, device=y.device)
    inverse[dispatch.order] = torch.arange(dispatch.order.numel(), device=y.device)
    dispatched = weights.new_zeros(0)  # empty: every assignment is dispatched
    if dispatch.order.numel() < N * K:
        dispatched = weights.new_zeros(N * K)
        dispatched[dispatch.order] = 1.0
        dispatched = dispatched.view(N, K)
        weights = weights * dispatched
    return _Combine.apply(y, weights, inverse, dispatch.order, dispatch.token_idx, dispatched.to(y.dtype))
