"""Transformer blocks sharing one interface: ``block(x, positions=None) -> x``.

Legend: B batch, T tokens, D model dim, k tokens chosen per sequence by a MoD router.
``x: [B, T, D]``; ``positions: [B, T]`` original token positions (default ``arange(T)``).

Every block exposes ``delta(x, positions) = f(x)``, the residual update of a pre-norm block
(attention then MLP), so that routing can wrap any block: a MoD block computes
``x_i + g(r_i) * f(x_i)`` on its chosen tokens and leaves the others exactly ``x_i``.
"""

from __future__ import annotations

import torch
from torch import nn

from mode.aux import Routed
from mode.experts.moe import CapacityMoE, DroplessMoE, MoELayer
from mode.layers.attention import CausalSelfAttention
from mode.layers.mlp import MLP
from mode.routing.expert_choice import (
    capacity_to_k,
    expert_choice_topk,
    scatter_add_tokens,
    take_tokens,
)

GATES = {"sigmoid": torch.sigmoid, "identity": lambda r: r, "none": torch.ones_like}


def default_positions(x: torch.Tensor) -> torch.Tensor:
    """[B, T] positions 0..T-1 for x: [B, T, D]."""
    B, T, _ = x.shape
    return torch.arange(T, device=x.device).expand(B, T)


class TransformerBlock(nn.Module):
    """Pre-norm block around any MLP-like module (``[N..., D] -> [N..., D]``)."""

    def __init__(self, d_model: int, n_heads: int, mlp: nn.Module, rope_base: float = 10000.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model, bias=False)
        self.attn = CausalSelfAttention(d_model, n_heads, rope_base)
        self.norm2 = nn.LayerNorm(d_model, bias=False)
        self.mlp = mlp

    def delta(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """f(x): the block's residual update, so that ``forward(x) = x + f(x)``."""
        if positions is None:
            positions = default_positions(x)
        h = self.attn(self.norm1(x), positions)
        return h + self.mlp(self.norm2(x + h))

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return x + self.delta(x, positions)


class DenseBlock(TransformerBlock):
    """The standard block: attention + GELU MLP of width ``mlp_ratio * d_model``."""

    def __init__(self, d_model: int, n_heads: int, mlp_ratio: int = 4, rope_base: float = 10000.0) -> None:
        super().__init__(d_model, n_heads, MLP(d_model, mlp_ratio * d_model), rope_base)


class MoDBlock(Routed):
    """Mixture-of-Depths: a router picks ``k = floor(capacity * T)`` tokens per sequence; only
    they run through the inner block. Output ``x_i + g(r_i) * f(x_i)`` for chosen tokens and
    exactly ``x_i`` for the rest.

    Args:
        capacity: share of tokens routed through the block, in [0, 1].
        gate: g in ``x + g(r) f(x)``: "sigmoid" (default), "identity" (the paper) or "none" (g = 1).
        inner: the block to route around (default: a ``DenseBlock``); must have ``delta``.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        capacity: float = 0.125,
        mlp_ratio: int = 4,
        gate: str = "sigmoid",
        rope_base: float = 10000.0,
        inner: TransformerBlock | None = None,
    ) -> None:
        super().__init__()
        capacity_to_k(capacity, 1)  # validates the range
        if gate not in GATES:
            raise ValueError(f"gate={gate!r} is invalid: choose one of {list(GATES)}")
        self.capacity = capacity
        self.gate = gate
        self.router = nn.Linear(d_model, 1, bias=False)
        self.block = inner if inner is not None else DenseBlock(d_model, n_heads, mlp_ratio, rope_base)

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, D] -> [B, T] router scores in at least float32 (bf16 ties are common)."""
        scores = self.router(x).squeeze(-1)
        return scores.to(torch.promote_types(scores.dtype, torch.float32))

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if positions is None:
            positions = default_positions(x)
        # NOTE: selection needs every token's score but only chosen tokens get gradient, so the
        # scores are computed without autograd and recomputed with it on the k chosen tokens:
        # the router's backward then costs k*D instead of T*D per sequence.
        with torch.no_grad():
            scores = self.router_logits(x)  # [B, T]
        plan = expert_choice_topk(scores, self.capacity)
        k = plan.indices.shape[1]
        self.metrics = {"routed_share": k / x.shape[1]}
        if k == 0:
            return x
        x_sel, x = take_tokens(x, plan.indices)  # [B, k, D] and the residual stream
        weights = self.router_logits(x_sel)  # [B, k], differentiable
        delta = self.block.delta(x_sel, positions.gather(1, plan.indices))  # [B, k, D]
        g = GATES[self.gate](weights).unsqueeze(-1)  # [B, k, 1]
        return scatter_add_tokens(x, plan.indices, g.to(delta.dtype) * delta)


class MoEBlock(TransformerBlock):
    """Attention on every token, then an MoE layer (``DroplessMoE`` or ``CapacityMoE``) as the MLP."""

    def __init__(self, d_model: int, n_heads: int, moe: MoELayer, rope_base: float = 10000.0) -> None:
        super().__init__(d_model, n_heads, moe, rope_base)


class StagedMoDEBlock(MoDBlock):
    """Staged MoDE: a MoD router picks ``floor(capacity * T)`` tokens per sequence around the
    whole block; only they go through attention and a (dropless by default) MoE MLP. Output
    ``x + g(r) * f(x)`` on chosen tokens; skipping tokens never reach the experts.

    ``moe_kwargs`` go to the MoE layer (``mlp``, ``backend``, ``lb_coef``, ...); ``d_ff``
    defaults to ``4 * d_model // top_k``.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        capacity: float = 0.125,
        n_experts: int = 8,
        top_k: int = 2,
        d_ff: int | None = None,
        gate: str = "sigmoid",
        dropless: bool = True,
        rope_base: float = 10000.0,
        **moe_kwargs,
    ) -> None:
        cls = DroplessMoE if dropless else CapacityMoE
        moe = cls(d_model, d_ff or 4 * d_model // top_k, n_experts, top_k, **moe_kwargs)
        inner = MoEBlock(d_model, n_heads, moe, rope_base)
        super().__init__(d_model, n_heads, capacity, gate=gate, rope_base=rope_base, inner=inner)


class IntegratedMoDEBlock(MoEBlock):
    """Integrated MoDE: attention on every token; the MLP router chooses among ``n_experts``
    real experts and ``n_noop`` no-op experts. A token assigned to a no-op expert gets zero
    from it and costs no GEMM (with top-1, its MLP residual is exactly unchanged). The
    load-balance loss targets ``noop_share`` of assignments on the no-op experts.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_experts: int = 8,
        n_noop: int = 8,
        top_k: int = 1,
        d_ff: int | None = None,
        noop_share: float = 0.5,
        rope_base: float = 10000.0,
        **moe_kwargs,
    ) -> None:
        moe = DroplessMoE(
            d_model, d_ff or 4 * d_model // top_k, n_experts, top_k, n_noop=n_noop, noop_share=noop_share, **moe_kwargs
        )
        super().__init__(d_model, n_heads, moe, rope_base)
