"""Transformer blocks sharing one interface: ``block(x, positions=None, routing="topk", cache=None) -> x``.

Legend: B batch, T tokens, D model dim.
``x: [B, T, D]``; ``positions: [B, T]`` original token positions (default ``arange(T)``).

Every block exposes ``delta(x, positions) = f(x)``, the residual update of a pre-norm block
(attention then MLP), so that routing can wrap any block: a MoD block (``mode.layers.mod``)
computes ``x_i + g(r_i) * f(x_i)`` on its chosen tokens and leaves the others exactly ``x_i``.

``routing="causal"`` makes every routing decision per token (no look at later tokens), and
``cache`` (a ``KVCache``) is filled with the keys/values of the tokens that went through the
block; ``decode`` then runs one new token per row against that cache.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import nn

from mode.checks import check_choice, check_hidden, options_object
from mode.experts.moe import MoEConfig, MoELayer, build_moe_layer
from mode.layers.arch import DEFAULT_ARCH, Arch, make_norm
from mode.layers.attention import CausalSelfAttention
from mode.layers.kv_cache import KVCache
from mode.layers.mlp import MLP

RoutingMode = Literal["topk", "causal"]
ROUTING_MODES: tuple[str, ...] = get_args(RoutingMode)


def default_positions(x: torch.Tensor) -> torch.Tensor:
    """[B, T] positions 0..T-1 for x: [B, T, D]."""
    B, T, _ = x.shape
    return torch.arange(T, device=x.device).expand(B, T)


def check_routing(routing: str) -> None:
    check_choice("routing", routing, ROUTING_MODES)


class TransformerBlock(nn.Module):
    """Pre-norm block around any MLP-like module (``[N..., D] -> [N..., D]``); ``arch`` chooses
    the norms and the attention's heads, biases and positions (``mode.layers.arch``)."""

    def __init__(self, d_model: int, n_heads: int, mlp: nn.Module, arch: Arch = DEFAULT_ARCH) -> None:
        super().__init__()
        self.norm1 = make_norm(d_model, arch)
        self.attn = CausalSelfAttention(d_model, n_heads, arch)
        self.norm2 = make_norm(d_model, arch)
        self.mlp = mlp

    def new_cache(self, batch: int, dtype: torch.dtype, device: torch.device) -> KVCache:
        return KVCache(batch, self.attn.n_kv_heads, self.attn.head_dim, dtype, device)

    def delta(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        cache_keep: torch.Tensor | None = None,
        length: int | None = None,
    ) -> torch.Tensor:
        """f(x): the block's residual update, so that ``forward(x) = x + f(x)``. With a
        ``cache``, the keys/values of the tokens marked by ``cache_keep`` ([B, T]; all when
        None) are stored in it. ``positions`` [B, T] (None: 0..T-1) and ``length``, a bound
        on them (a routed block's full sequence length), as in ``CausalSelfAttention.rope``."""
        h, k, v = self.attn.attend(self.norm1(x), positions, length)
        if cache is not None:
            cache.fill(k, v, cache_keep)
        return h + self.mlp(self.norm2(x + h))

    def delta_decode(
        self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache, rows: torch.Tensor
    ) -> torch.Tensor:
        """f(x) for one new token per row: x [b, 1, D], positions [b], cache rows ``rows`` [b]."""
        h = self.attn.decode(self.norm1(x), positions, cache, rows)
        return h + self.mlp(self.norm2(x + h))

    def write_kv_decode(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache, rows: torch.Tensor) -> None:
        """Append the keys/values of x [b, 1, D] (tokens that skip this block's computation,
        e.g. after an early exit) at ``positions`` [b] to cache rows ``rows`` [b]."""
        _, k, v = self.attn.project_qkv(self.norm1(x), positions[:, None])
        cache.append(rows, k, v)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        routing: str = "topk",
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        check_hidden(x, self.norm1.normalized_shape[0])
        check_routing(routing)
        return x + self.delta(x, positions, cache=cache)

    def decode(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """x: [B, 1, D] new tokens at ``positions`` [B] -> [B, 1, D]."""
        rows = torch.arange(x.shape[0], device=x.device)
        return x + self.delta_decode(x, positions, cache, rows)


class DenseBlock(TransformerBlock):
    """The standard block: attention + an MLP (``arch.mlp``) of width ``d_ff`` (default
    ``mlp_ratio * d_model``)."""

    def __init__(
        self, d_model: int, n_heads: int, mlp_ratio: int = 4, arch: Arch = DEFAULT_ARCH, d_ff: int | None = None
    ) -> None:
        super().__init__(d_model, n_heads, MLP(d_model, d_ff or mlp_ratio * d_model, arch), arch)


class MoEBlock(TransformerBlock):
    """Attention on every token, then an MoE layer (``DroplessMoE`` or ``CapacityMoE``) as the MLP."""

    def __init__(self, d_model: int, n_heads: int, moe: MoELayer, arch: Arch = DEFAULT_ARCH) -> None:
        super().__init__(d_model, n_heads, moe, arch)


class IntegratedMoDEBlock(MoEBlock):
    """Integrated MoDE: attention on every token; the MLP router chooses among ``n_experts``
    real experts and ``n_noop`` no-op experts. A token assigned to a no-op expert gets zero
    from it and costs no GEMM (with top-1, its MLP residual is exactly unchanged). The
    load-balance loss targets ``noop_share`` of assignments on the no-op experts.

    ``moe``: the built MoE layer, with ``n_noop`` (``mode.layers.kinds.build_moe``); without
    it, the keyword ``options`` are ``MoEConfig`` fields (defaults here: 8 experts, 8 no-op
    experts, top-1) of a layer built by ``build_moe_layer``, ``d_ff`` wide (default
    ``4 * d_model // top_k``).
    """

    NOOP_DEFAULTS = {"n_experts": 8, "n_noop": 8, "top_k": 1}

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        moe: MoELayer | None = None,
        d_ff: int | None = None,
        arch: Arch = DEFAULT_ARCH,
        **options: object,
    ) -> None:
        if moe is None:
            opts = options_object(MoEConfig, None, options, "MoE", self.NOOP_DEFAULTS)
            moe = build_moe_layer(d_model, opts, d_ff or opts.width(d_model))
        elif options or d_ff is not None:
            raise TypeError(f"a built moe takes no MoE options: {sorted(options) + ['d_ff'] * (d_ff is not None)}")
        super().__init__(d_model, n_heads, moe, arch)
