"""Mixture-of-Depths routing: expert choice over the sequence.

Legend: B batch, T sequence length, k = floor(capacity * T) tokens chosen per sequence.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


class RoutePlan(NamedTuple):
    """Which tokens of each sequence go through a routed block.

    indices: [B, k] int64 positions of the chosen tokens, sorted ascending (by position).
    weights: [B, k] router scores at those positions (differentiable w.r.t. the scores).
    mask:    [B, T] bool, True where a token is chosen.
    """

    indices: torch.Tensor
    weights: torch.Tensor
    mask: torch.Tensor


def capacity_to_k(capacity: float, seq_len: int) -> int:
    """k = floor(capacity * T), with a small epsilon so that e.g. 0.125 * 1024 gives 128."""
    if not 0.0 <= capacity <= 1.0:
        raise ValueError(f"capacity={capacity!r} is invalid: must be in [0.0, 1.0]")
    return min(seq_len, int(math.floor(capacity * seq_len + 1e-9)))


def expert_choice_topk(scores: torch.Tensor, capacity: float) -> RoutePlan:
    """Choose the top-k tokens of each row of ``scores`` ([B, T]).

    Exactly k = floor(capacity * T) tokens per row. Ties are broken by lower position
    (a stable descending sort), so the choice is deterministic. The returned indices are
    sorted by position so that causal attention over the chosen tokens is causal by
    original position.
    """
    if scores.dim() != 2:
        raise ValueError(f"scores must be [B, T], got shape {tuple(scores.shape)}")
    B, T = scores.shape
    k = capacity_to_k(capacity, T)
    # NOTE: torch.topk gives no tie-breaking guarantee; a stable sort does (lower index first).
    order = torch.sort(scores.detach(), dim=-1, descending=True, stable=True).indices
    indices = torch.sort(order[:, :k], dim=-1).values  # [B, k], ascending positions
    weights = scores.gather(1, indices)
    mask = torch.zeros(B, T, dtype=torch.bool, device=scores.device)
    mask.scatter_(1, indices, True)
    return RoutePlan(indices, weights, mask)


def gather_tokens(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """x: [B, T, D], indices: [B, k] -> [B, k, D]."""
    return x.gather(1, indices.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


class _TakeTokens(torch.autograd.Function):
    """(x, indices) -> (x[indices] [B, k, D], alias of x [B, T, D]).

    Backward receives the gradient of both outputs at once and returns
    ``grad_alias + scatter(grad_sel)`` with one copy and a k-row ``scatter_add_``, instead of
    autograd's zero-fill, scatter and full-size add of two separate gradients.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, indices: torch.Tensor):
        ctx.save_for_backward(indices)
        ctx.x_shape = x.shape
        return gather_tokens(x, indices), x.view_as(x)

    @staticmethod
    def backward(ctx, grad_sel: torch.Tensor | None, grad_x: torch.Tensor | None):
        (indices,) = ctx.saved_tensors
        out = grad_x.clone() if grad_x is not None else grad_sel.new_zeros(ctx.x_shape)
        if grad_sel is not None:
            out.scatter_add_(1, indices.unsqueeze(-1).expand(-1, -1, out.shape[-1]), grad_sel)
        return out, None


def take_tokens(x: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather the chosen tokens and an alias of ``x`` for the residual path.

    x: [B, T, D], indices: [B, k] -> (x_sel [B, k, D], x [B, T, D]). Values equal
    ``(gather_tokens(x, indices), x)``; use both outputs so the backward is a single pass.
    """
    return _TakeTokens.apply(x, indices)


def scatter_add_tokens(x: torch.Tensor, indices: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """Return ``x`` with ``update`` ([B, k, D]) added at ``indices`` ([B, k]); other rows are ``x``
    bit for bit (out of place, differentiable w.r.t. both)."""
    return x.scatter_add(1, indices.unsqueeze(-1).expand(-1, -1, x.shape[-1]), update.to(x.dtype))
