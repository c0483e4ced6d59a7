"""Slow, obviously-correct references the fast paths are compared against."""

from __future__ import annotations

import math

import torch


def rope_cos_sin_reference(positions: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [B, T] integer -> cos, sin: [B, 1, T, Dh/2] float32 of each pair's angle
    ``position * base^(-2i / Dh)`` (GPT-NeoX layout)."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq  # [B, T, Dh/2]
    return angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)


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
    from mode.layers.mod import GATES
    from mode.routing.mod_topk import capacity_to_k

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


def expert_mlp_reference(experts, e: int, x: torch.Tensor) -> torch.Tensor:
    """One expert's MLP on x: [n, D]."""
    import torch.nn.functional as F

    h = x @ experts.w1[e]
    h = F.silu(h) * (x @ experts.w3[e]) if experts.w3 is not None else F.gelu(h)
    return h @ experts.w2[e]


def token_choice_reference(layer, x: torch.Tensor) -> list[list[tuple[int, torch.Tensor]]]:
    """Per token: [(expert, combine weight)] by descending selection score, no-ops included."""
    logits = layer.router(x).float()
    probs = torch.softmax(logits, dim=-1)
    scores = (logits + layer.selection_bias) if layer.bias_rate else logits
    out = []
    for n in range(x.shape[0]):
        chosen = sorted(range(logits.shape[1]), key=lambda e: -scores[n, e].item())[: layer.top_k]
        w = [probs[n, e] for e in chosen]
        if layer.renormalize and layer.top_k > 1:
            total = sum(w)
            w = [wi / total for wi in w]
        out.append(list(zip(chosen, w, strict=True)))
    return out


def moe_reference(layer, x: torch.Tensor, capacity: int | None = None, policy: str = "position") -> torch.Tensor:
    """MoE forward one token at a time. With ``capacity``, assignments are served in the
    documented priority order and those beyond ``capacity`` per expert are dropped."""
    N = x.shape[0]
    routes = token_choice_reference(layer, x)
    kept = {(n, j) for n in range(N) for j in range(layer.top_k)}
    if capacity is not None:
        if policy == "position":
            queue = [(n, j) for j in range(layer.top_k) for n in range(N)]
        else:
            flat = [(n, j) for j in range(layer.top_k) for n in range(N)]
            queue = sorted(flat, key=lambda a: -routes[a[0]][a[1]][1].item())  # stable: rank, then position
        used = [0] * (layer.n_experts + layer.n_noop)
        kept = set()
        for n, j in queue:
            e = routes[n][j][0]
            if used[e] < capacity:
                used[e] += 1
                kept.add((n, j))
    rows = []
    for n in range(N):
        acc = torch.zeros_like(x[n])
        for j, (e, w) in enumerate(routes[n]):
            if e < layer.n_experts and (n, j) in kept:
                acc = acc + w.to(x.dtype) * expert_mlp_reference(layer.experts, e, x[n : n + 1])[0]
        rows.append(acc)
    return torch.stack(rows)
