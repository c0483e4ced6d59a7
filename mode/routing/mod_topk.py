"""Mixture-of-Depths routing: expert choice over the sequence (the decision only; moving the
chosen tokens out and back is ``mode.layers.mod_moves``).

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


def capacity_to_k_tensor(capacity: float, seq_lens: torch.Tensor) -> torch.Tensor:
    """``capacity_to_k`` of each length in ``seq_lens`` (int64, any shape), on their device: the
    same float64 arithmetic, without a host copy of the lengths (no device sync)."""
    if not 0.0 <= capacity <= 1.0:
        raise ValueError(f"capacity={capacity!r} is invalid: must be in [0.0, 1.0]")
    return torch.floor(seq_lens.double() * capacity + 1e-9).long().minimum(seq_lens)


def expert_choice_topk(scores: torch.Tensor, capacity: float) -> RoutePlan:
    """Choose the top-k tokens of each row of ``scores`` ([B, T]).

    Exactly k = floor(capacity * T) tokens per row. Ties are broken by lower position, so
    the choice is deterministic (the same as a stable descending sort), and NaN scores count
    as +inf, so they never break exact-k. The returned indices are sorted by position so that
    causal attention over the chosen tokens is causal by original position.

    Cost: one ``topk`` for the k-th largest score, a few elementwise passes over [B, T] for
    the tie-break, and a ``nonzero_static`` that lists the chosen positions in order; no sort
    of the sequence (a stable sort of [B, T] costs ~10x more on CPU) and no data-dependent
    shape, so it runs under ``torch.compile(fullgraph=True)`` and without a host sync.
    """
    if scores.dim() != 2:
        raise ValueError(f"scores must be [B, T], got shape {tuple(scores.shape)}")
    B, T = scores.shape
    k = capacity_to_k(capacity, T)
    s = torch.nan_to_num(scores.detach(), nan=float("inf"))
    if k == 0:
        mask = torch.zeros(B, T, dtype=torch.bool, device=scores.device)
    else:
        kth = torch.topk(s, k, dim=-1).values[:, -1:]  # [B, 1] k-th largest score
        above = s > kth
        tied = s == kth
        # NOTE: torch.topk gives no tie-breaking guarantee: of the tokens tied at the k-th
        # score, take the lowest positions until the row has exactly k.
        missing = k - above.sum(dim=-1, keepdim=True)
        mask = above | (tied & (tied.cumsum(dim=-1) <= missing))
    indices = torch.nonzero_static(mask, size=B * k)[:, 1].view(B, k)  # row-major: ascending
    return RoutePlan(indices, scores.gather(1, indices), mask)
