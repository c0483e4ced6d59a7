"""Mixture-of-Experts routing: token choice (top-k experts per token), capacity dropping,
and expert choice (top-C tokens per expert).

Legend: N tokens, E experts (real + no-op), K experts per token (top_k), C slots per expert.
Router math is done in float32.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple, get_args

import torch

# How an MoE layer assigns tokens to experts (token choice: top-k experts per token; expert
# choice: each expert takes its top-C tokens of the batch) and which assignments a full
# expert drops (``capacity_keep``).
MoERouter = Literal["token_choice", "expert_choice"]
DropPolicy = Literal["position", "probs"]
MOE_ROUTERS: tuple[str, ...] = get_args(MoERouter)
DROP_POLICIES: tuple[str, ...] = get_args(DropPolicy)


class TokenChoice(NamedTuple):
    """experts: [N, K] int64 chosen expert ids (by descending score);
    weights: [N, K] float32 combine weights; probs: [N, E] softmax of the logits."""

    experts: torch.Tensor
    weights: torch.Tensor
    probs: torch.Tensor


def jitter(x: torch.Tensor, eps: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Switch-style multiplicative input noise ``x * U(1 - eps, 1 + eps)`` (training only)."""
    if eps <= 0:
        return x
    noise = torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps, generator=generator)
    return x * noise


def token_choice_topk(
    logits: torch.Tensor, top_k: int, renormalize: bool = True, selection_bias: torch.Tensor | None = None
) -> TokenChoice:
    """Top-k experts per token from router logits ``[N, E]``.

    ``selection_bias`` ([E], aux-loss-free balancing) is added to the logits for choosing
    experts only; the combine weights are the softmax probabilities of the chosen experts,
    renormalized to sum to one per token when ``renormalize``.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, E], got {tuple(logits.shape)}")
    if not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"top_k={top_k} is invalid: must be in [1, n_experts={logits.shape[1]}]")
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    scores = logits if selection_bias is None else logits + selection_bias.float()
    experts = torch.topk(scores.detach(), top_k, dim=-1).indices  # [N, K]
    weights = probs.gather(1, experts)
    if renormalize and top_k > 1:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return TokenChoice(experts, weights, probs)


def expert_capacity(n_tokens: int, top_k: int, n_experts: int, capacity_factor: float) -> int:
    """Slots per expert: ``ceil(capacity_factor * N * K / E)``."""
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor={capacity_factor} is invalid: must be > 0")
    return int(math.ceil(capacity_factor * n_tokens * top_k / n_experts))


def capacity_keep(
    experts: torch.Tensor, weights: torch.Tensor, n_experts: int, capacity: int, policy: DropPolicy = "position"
) -> torch.Tensor:
    """Which assignments ([N, K]) fit in ``capacity`` slots per expert -> keep: [N, K] bool
    (the rank inside its expert, ``capacity_rank``, below ``capacity``; never a no-op expert).
    Public on purpose: the plain statement of the capacity rule that ``CapacityMoE``'s fused
    slots implement, for users and the tests that check them against it."""
    return (capacity_rank(experts, weights, policy) < capacity) & (experts < n_experts)


def capacity_rank(experts: torch.Tensor, weights: torch.Tensor, policy: DropPolicy = "position") -> torch.Tensor:
    """Each assignment's rank among its expert's assignments in serving order -> [N, K] int64
    (0 = served first; an assignment fits when its rank is below the capacity).

    policy "position": assignments are served by choice rank, then token position (every
    token's first choice before any second choice; earlier tokens first), as GShard/Switch.
    policy "probs": within each expert, the highest combine weights keep their slot
    (ties: earlier choice rank, then earlier token; a NaN weight ranks last, so a token with
    NaN logits never takes another token's slot).
    """
    N, K = experts.shape
    # Priority of each assignment in the order [k][n] (choice rank major, position minor).
    rank_major = experts.t().reshape(-1)  # [K*N]
    if policy == "position":
        priority = torch.arange(K * N, device=experts.device)
    elif policy == "probs":
        w = weights.detach().t().reshape(-1).nan_to_num(nan=-torch.inf)
        priority = torch.empty_like(rank_major)
        priority[torch.sort(-w, stable=True).indices] = torch.arange(K * N, device=experts.device)
    else:
        raise ValueError(f"drop_policy={policy!r} is invalid: choose one of {list(DROP_POLICIES)}")
    # Sort by (expert, priority); an assignment's slot is its rank inside its expert.
    key = rank_major * (K * N) + priority
    order = torch.sort(key).indices
    sorted_expert = rank_major[order]
    # The first sorted position of each assignment's expert (a search, not a bincount: no
    # host read of the largest id, so no device sync).
    starts = torch.searchsorted(sorted_expert, sorted_expert)
    rank_sorted = torch.arange(K * N, device=experts.device) - starts
    rank = torch.empty_like(rank_sorted)
    rank[order] = rank_sorted
    return rank.view(K, N).t()


def expert_choice_tokens(probs: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert choice for experts: each expert takes its top-``capacity`` tokens by probability.

    probs: [N, E] -> (tokens [E, C] int64 token ids sorted by position, weights [E, C]).
    Ties go to the earlier token. A token may be taken by several experts or by none. NaN
    probabilities rank last (a token with NaN logits never takes another token's slot).
    """
    N, E = probs.shape
    C = min(capacity, N)
    ranked = probs.detach().t().nan_to_num(nan=-torch.inf)
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[:, :C]
    tokens = torch.sort(order, dim=-1).values  # [E, C]
    return tokens, probs.t().gather(1, tokens)
