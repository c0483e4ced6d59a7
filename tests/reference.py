"""Slow, obviously-correct references the fast paths are compared against."""

from __future__ import annotations

import math

import torch


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """q, k, v: [B, H, T, Dh]; allowed: [B, T, T] bool (query i may see key j)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def topk_reference(scores: torch.Tensor, k: int) -> list[list[int]]:
    """Per row: the k highest scores, ties to the lower position, returned in position order."""
    out = []
    for row in scores.tolist():
        order = sorted(range(len(row)), key=lambda i: (-row[i], i))
        out.append(sorted(order[:k]))
    return out


def mod_block_reference(block, x: torch.Tensor) -> torch.Tensor:
    """MoDBlock forward, one sequence at a time with Python lists of chosen positions."""
    from mode.layers.blocks import GATES
    from mode.routing.expert_choice import capacity_to_k

    B, T, D = x.shape
    k = capacity_to_k(block.capacity, T)
    rows = []
    for b in range(B):
        scores = block.router(x[b]).squeeze(-1).float()
        chosen = topk_reference(scores.detach()[None], k)[0]
        out = x[b].clone()
        if chosen:
            idx = torch.tensor(chosen)
            delta = block.block.delta(x[b, idx][None], idx[None])[0]
            g = GATES[block.gate](scores[idx])
            for j, pos in enumerate(chosen):
                out[pos] = x[b, pos] + g[j] * delta[j]
        rows.append(out)
    return torch.stack(rows)
