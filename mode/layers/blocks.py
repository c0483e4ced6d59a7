"""Transformer blocks sharing one interface: ``block(x, positions=None, routing="topk", cache=None) -> x``.

Legend: B batch, T tokens, D model dim, k tokens chosen per sequence by a MoD router.
``x: [B, T, D]``; ``positions: [B, T]`` original token positions (default ``arange(T)``).

Every block exposes ``delta(x, positions) = f(x)``, the residual update of a pre-norm block
(attention then MLP), so that routing can wrap any block: a MoD block computes
``x_i + g(r_i) * f(x_i)`` on its chosen tokens and leaves the others exactly ``x_i``.

``routing="causal"`` makes every routing decision per token (no look at later tokens), and
``cache`` (a ``KVCache``) is filled with the keys/values of the tokens that went through the
block; ``decode`` then runs one new token per row against that cache.
"""

from __future__ import annotations

import torch
from torch import nn

from mode.config import CAUSAL_METHODS
from mode.experts.moe import CapacityMoE, DroplessMoE, MoELayer
from mode.layers.attention import CausalSelfAttention
from mode.layers.kv_cache import KVCache
from mode.layers.mlp import MLP
from mode.layers.predictor import RoutingPredictor
from mode.routed import Routed
from mode.routing.causal import causal_decisions, decision_metrics, membership_bce
from mode.routing.expert_choice import add_gated_tokens, capacity_to_k, expert_choice_topk, take_tokens, token_rows

GATES = {"sigmoid": torch.sigmoid, "identity": lambda r: r, "none": torch.ones_like}
ROUTING_MODES = ("topk", "causal")


def default_positions(x: torch.Tensor) -> torch.Tensor:
    """[B, T] positions 0..T-1 for x: [B, T, D]."""
    B, T, _ = x.shape
    return torch.arange(T, device=x.device).expand(B, T)


def check_routing(routing: str) -> None:
    if routing not in ROUTING_MODES:
        raise ValueError(f"routing={routing!r} is invalid: choose one of {list(ROUTING_MODES)}")


class TransformerBlock(nn.Module):
    """Pre-norm block around any MLP-like module (``[N..., D] -> [N..., D]``)."""

    def __init__(self, d_model: int, n_heads: int, mlp: nn.Module, rope_base: float = 10000.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model, bias=False)
        self.attn = CausalSelfAttention(d_model, n_heads, rope_base)
        self.norm2 = nn.LayerNorm(d_model, bias=False)
        self.mlp = mlp

    def new_cache(self, batch: int, dtype: torch.dtype, device: torch.device) -> KVCache:
        return KVCache(batch, self.attn.n_heads, self.attn.head_dim, dtype, device)

    def delta(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """f(x): the block's residual update, so that ``forward(x) = x + f(x)``. With
        ``key_mask`` ([B, T]) attention sees only the marked tokens, and only they are cached."""
        if positions is None:
            positions = default_positions(x)
        h, k, v = self.attn.attend(self.norm1(x), positions, key_mask)
        if cache is not None:
            cache.fill(k, v, key_mask)
        return h + self.mlp(self.norm2(x + h))

    def delta_decode(
        self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache, rows: torch.Tensor
    ) -> torch.Tensor:
        """f(x) for one new token per row: x [b, 1, D], positions [b], cache rows ``rows`` [b]."""
        h = self.attn.decode(self.norm1(x), positions, cache, rows)
        return h + self.mlp(self.norm2(x + h))

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        routing: str = "topk",
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        return x + self.delta(x, positions, cache=cache)

    def decode(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """x: [B, 1, D] new tokens at ``positions`` [B] -> [B, 1, D]."""
        rows = torch.arange(x.shape[0], device=x.device)
        return x + self.delta_decode(x, positions, cache, rows)


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
        causal: per-token decision for sampling: "none", "router_bce" (router logit trained by
            BCE toward top-k membership) or "predictor" (``RoutingPredictor``: the detached router
            score minus the top-k threshold of the tokens so far, plus a small MLP on
            ``x.detach()``).
        causal_coef: coefficient of that BCE loss.
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
        causal: str = "none",
        causal_coef: float = 0.01,
        predictor_hidden: int = 64,
    ) -> None:
        super().__init__()
        capacity_to_k(capacity, 1)  # validates the range
        if gate not in GATES:
            raise ValueError(f"gate={gate!r} is invalid: choose one of {list(GATES)}")
        if causal not in CAUSAL_METHODS:
            raise ValueError(f"causal={causal!r} is invalid: choose one of {list(CAUSAL_METHODS)}")
        self.capacity, self.gate, self.causal, self.causal_coef = capacity, gate, causal, causal_coef
        self.router = nn.Linear(d_model, 1, bias=False)
        self.predictor = RoutingPredictor(d_model, capacity, predictor_hidden) if causal == "predictor" else None
        self.block = inner if inner is not None else DenseBlock(d_model, n_heads, mlp_ratio, rope_base)

    def new_cache(self, batch: int, dtype: torch.dtype, device: torch.device) -> KVCache:
        return self.block.new_cache(batch, dtype, device)

    def non_causal_reason(self) -> str | None:
        if self.causal != "none":
            return None
        return (
            "a MoD block with causal='none' picks its top-k over the whole sequence: build it with "
            "causal='router_bce' or causal='predictor' (config: model.mod.causal)"
        )

    def extra_repr(self) -> str:
        return f"capacity={self.capacity}, gate={self.gate!r}, causal={self.causal!r}"

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, D] -> [B, T] router scores in at least float32 (bf16 ties are common)."""
        scores = self.router(x).squeeze(-1)
        return scores.to(torch.promote_types(scores.dtype, torch.float32))

    def decision_logits(self, x: torch.Tensor, scores: torch.Tensor | None = None) -> torch.Tensor:
        """Per-token routing logit used in causal mode (x: [B, T, D], a sequence from its first
        token -> [B, T]); routed when > 0. ``scores`` = ``router_logits(x)`` if already known."""
        if self.causal == "none":
            raise ValueError(f"routing='causal' needs a causal decision method: {self.non_causal_reason()}")
        scores = self.router_logits(x) if scores is None else scores
        return self.predictor(x, scores) if self.predictor is not None else scores

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        routing: str = "topk",
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        check_routing(routing)
        if routing == "causal":
            return self._forward_causal(x, default_positions(x) if positions is None else positions, cache)
        if cache is not None:
            raise ValueError("a KV cache needs routing='causal' (top-k routing looks at later tokens)")
        return self._forward_topk(x, positions)

    def _forward_topk(self, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        self.clear_aux()
        if self.causal == "router_bce":
            scores = self.router_logits(x)  # every token's score gets the BCE gradient
        else:
            # NOTE: selection needs every token's score but only chosen tokens get gradient, so
            # the scores are computed without autograd and recomputed on the k chosen tokens:
            # the router's backward then costs k*D instead of T*D per sequence.
            with torch.no_grad():
                scores = self.router_logits(x)  # [B, T]
        plan = expert_choice_topk(scores, self.capacity)
        self._record_causal_losses(x, scores, plan.mask)
        k = plan.indices.shape[1]
        self.metrics["routed_share"] = k / x.shape[1]
        if k == 0:
            return x
        rows = token_rows(plan.indices, x.shape[1])  # [B * k] rows of x.view(B * T, D)
        x_sel, x = take_tokens(x, plan.indices, rows)  # [B, k, D] and the residual stream
        weights = plan.weights if scores.requires_grad else self.router_logits(x_sel)  # [B, k]
        chosen_positions = plan.indices if positions is None else positions.gather(1, plan.indices)
        delta = self.block.delta(x_sel, chosen_positions)  # [B, k, D]
        return add_gated_tokens(x, plan.indices, GATES[self.gate](weights), delta, rows)

    def _record_causal_losses(self, x: torch.Tensor, scores: torch.Tensor, chosen: torch.Tensor) -> None:
        if self.causal == "none":
            return
        if self.predictor is not None and self.training and capacity_to_k(self.capacity, chosen.shape[1]):
            self.predictor.update_threshold(scores, chosen)
        logits = self.decision_logits(x, scores)
        self.record_aux("causal_bce", membership_bce(logits, chosen), self.causal_coef)
        for name, value in decision_metrics(logits, chosen).items():
            self.metrics[f"decision_{name}"] = value

    def _forward_causal(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        """Each token decides alone (x: a sequence from its first token); the block runs on all
        tokens with attention restricted to routed keys, and only routed tokens take the update
        (and enter the cache, which must be empty: a forward is the prefill)."""
        self.clear_aux()
        scores = self.router_logits(x)  # [B, T]
        routed = causal_decisions(self.decision_logits(x, scores))  # [B, T]
        self.metrics["causal_share"] = routed.float().mean()
        delta = self.block.delta(x, positions, key_mask=routed, cache=cache)
        if cache is not None and self.predictor is not None:
            cache.record_scores(scores)  # the prefix the predictor's decode continues from
        g = GATES[self.gate](scores).unsqueeze(-1).to(delta.dtype)
        return torch.where(routed.unsqueeze(-1), x + g * delta, x)

    def decode(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """x: [B, 1, D] one new token per row; rows whose token skips cost nothing and write no KV."""
        scores = self.router_logits(x)  # [B, 1]
        if self.predictor is not None:
            cache.record_scores(scores)
            logits = self.predictor.decode_logits(x, cache.scores_seen(), cache.memo)
        else:
            logits = self.decision_logits(x, scores)
        rows = causal_decisions(logits[:, 0]).nonzero().squeeze(-1)
        if rows.numel() == 0:
            return x
        x_r = x.index_select(0, rows)
        delta = self.block.delta_decode(x_r, positions.index_select(0, rows), cache, rows)
        g = GATES[self.gate](scores.index_select(0, rows)).unsqueeze(-1).to(delta.dtype)
        return x.index_copy(0, rows, x_r + g * delta)


class MoEBlock(TransformerBlock):
    """Attention on every token, then an MoE layer (``DroplessMoE`` or ``CapacityMoE``) as the MLP."""

    def __init__(self, d_model: int, n_heads: int, moe: MoELayer, rope_base: float = 10000.0) -> None:
        super().__init__(d_model, n_heads, moe, rope_base)


class StagedMoDEBlock(MoDBlock):
    """Staged MoDE: a MoD router picks ``floor(capacity * T)`` tokens per sequence around the
    whole block; only they go through attention and a (dropless by default) MoE MLP. Output
    ``x + g(r) * f(x)`` on chosen tokens; skipping tokens never reach the experts.

    ``moe_kwargs`` go to the MoE layer (``mlp``, ``backend``, ``lb_coef``, ...); ``d_ff``
    defaults to ``4 * d_model // top_k``. Pass a built MoE layer as ``moe`` to use it instead.
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
        causal: str = "none",
        causal_coef: float = 0.01,
        predictor_hidden: int = 64,
        moe: MoELayer | None = None,
        **moe_kwargs,
    ) -> None:
        if moe is None:
            cls = DroplessMoE if dropless else CapacityMoE
            moe = cls(d_model, d_ff or 4 * d_model // top_k, n_experts, top_k, **moe_kwargs)
        super().__init__(
            d_model,
            n_heads,
            capacity,
            gate=gate,
            rope_base=rope_base,
            inner=MoEBlock(d_model, n_heads, moe, rope_base),
            causal=causal,
            causal_coef=causal_coef,
            predictor_hidden=predictor_hidden,
        )


class IntegratedMoDEBlock(MoEBlock):
    """Integrated MoDE: attention on every token; the MLP router chooses among ``n_experts``
    real experts and ``n_noop`` no-op experts. A token assigned to a no-op expert gets zero
    from it and costs no GEMM (with top-1, its MLP residual is exactly unchanged). The
    load-balance loss targets ``noop_share`` of assignments on the no-op experts. Pass a built
    ``DroplessMoE`` (with ``n_noop``) as ``moe`` to use it instead.
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
        moe: MoELayer | None = None,
        **moe_kwargs,
    ) -> None:
        if moe is None:
            d_ff = d_ff or 4 * d_model // top_k
            moe = DroplessMoE(d_model, d_ff, n_experts, top_k, n_noop=n_noop, noop_share=noop_share, **moe_kwargs)
        super().__init__(d_model, n_heads, moe, rope_base)
