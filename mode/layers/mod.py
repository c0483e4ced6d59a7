"""Mixture-of-Depths blocks: ``MoDBlock`` (expert choice over the sequence around any block)
and ``StagedMoDEBlock`` (MoD around a block whose MLP is an MoE).

Legend: B batch, T tokens, D model dim, k tokens chosen per sequence by the router.
``RoutingConfig`` is the one place a MoD block's options are written and validated (a block
takes one as ``opts`` or builds one from its keywords); ``capacity_to_k`` is the one k rule.
"""

from __future__ import annotations

import math
from dataclasses import InitVar, dataclass, fields, replace
from typing import ClassVar, Literal, get_args

import torch

from mode.checks import check_choice, check_hidden, check_int, check_positive, check_range, options_object
from mode.experts.moe import MoEConfig, MoELayer, build_moe_layer
from mode.kernels import triton_missing_reason, triton_unavailable_reason
from mode.layers.arch import DEFAULT_ARCH, Arch
from mode.layers.blocks import DenseBlock, MoEBlock, TransformerBlock, check_routing, default_positions
from mode.layers.kv_cache import KVCache
from mode.layers.mod_moves import TorchRows, add_gated_tokens, take_tokens, token_rows
from mode.layers.predictor import RoutingPredictor
from mode.routed import Routed, Router, measuring
from mode.routing.causal import causal_decisions, decision_metrics, membership_bce
from mode.routing.counting import count_ids
from mode.routing.mod_topk import capacity_to_k, expert_choice_topk

# g in ``x + g(r) * f(x)``; "none" is g = 1 (no router gradient: ablations, equivalence tests).
Gate = Literal["sigmoid", "identity", "none"]
# How a token decides alone at sampling time (``mode.routing.causal``, ``RoutingPredictor``).
CausalMethod = Literal["none", "router_bce", "predictor"]
# Who moves the chosen tokens out and back: "torch" (index_select / index_add_ autograd
# functions, any device), "triton" (``mode.kernels.mod_tokens``: CUDA, or CPU under
# TRITON_INTERPRET=1), "auto" = torch: on an H200 (2026-12-04, RESULTS.md) the Triton gated
# scatter measured 1.43x torch's but its gather 0.77x, so the pair stays opt-in.
TokenKernels = Literal["auto", "torch", "triton"]
TOKEN_KERNELS: tuple[str, ...] = get_args(TokenKernels)
GATES = {"sigmoid": torch.sigmoid, "identity": lambda r: r, "none": torch.ones_like}
CAUSAL_METHODS: tuple[str, ...] = get_args(CausalMethod)
POSITION_BUCKETS = 10  # routed share per tenth of the positions (a health metric)
assert tuple(GATES) == get_args(Gate)


@dataclass
class RoutingConfig:
    """Mixture-of-Depths routing around a block (expert choice over the sequence): the one
    place these options are written and validated (``model.mod`` in a config; the MoD blocks
    take one as ``opts``, or build one from their keywords).

    capacity: share of each sequence's tokens that go through a routed block, k = floor(capacity*T).
    gate: g(r) in ``x + g(r) * f(x)``; "sigmoid" (default), "identity" (the paper), "none" (g = 1:
        no router gradient; for ablations and equivalence tests).
    causal: how a token decides alone at sampling time: "none", "router_bce" trains the router
        logit toward top-k membership, "predictor" applies the top-k rule to the tokens so far
        (the detached router score against the k-th largest score of the prefix), corrected by a
        small MLP on ``x.detach()`` trained by BCE (``mode.layers.predictor``).
    causal_coef: coefficient of that BCE loss. predictor_hidden: the predictor MLP's width.
    kernels: who moves the chosen tokens: "auto" (= torch), "torch", or "triton"
        (``mode.kernels.mod_tokens``; CUDA, or CPU under TRITON_INTERPRET=1).

    ``field_prefix`` (not a field) is how errors name an option: ``model.mod.`` for a config,
    "" for a block's keyword arguments.
    """

    capacity: float = 0.125
    gate: str = "sigmoid"
    causal: str = "none"
    causal_coef: float = 0.01
    predictor_hidden: int = 64
    kernels: str = "auto"
    field_prefix: InitVar[str] = "model.mod."

    def __post_init__(self, field_prefix: str) -> None:
        check_range(field_prefix + "capacity", self.capacity, 0.0, 1.0)
        check_choice(field_prefix + "kernels", self.kernels, TOKEN_KERNELS)
        check_choice(field_prefix + "gate", self.gate, GATES)
        check_choice(field_prefix + "causal", self.causal, CAUSAL_METHODS)
        check_positive(field_prefix + "causal_coef", self.causal_coef, allow_zero=True)
        check_int(field_prefix + "predictor_hidden", self.predictor_hidden)
        check_positive(field_prefix + "predictor_hidden", self.predictor_hidden)


ROUTING_FIELDS = frozenset(f.name for f in fields(RoutingConfig))


class MoDBlock(Routed):
    """Mixture-of-Depths: a router picks ``k = floor(capacity * T)`` tokens per sequence; only
    they run through the inner block. Output ``x_i + g(r_i) * f(x_i)`` for chosen tokens and
    exactly ``x_i`` for the rest.

    ``MoDBlock(d_model, n_heads, capacity, **options)`` or ``MoDBlock(d_model, n_heads,
    opts=RoutingConfig(...))``: every routing option (``capacity``, ``gate``, ``causal``,
    ``causal_coef``, ``predictor_hidden``, ``kernels``) is a ``RoutingConfig`` field, documented
    there, and ``opts`` keeps them. "triton" kernels raise at construction where Triton is not
    installed and at forward on a device it cannot run on.

    Args:
        mlp_ratio, arch: the default inner block's width ratio and its norms, attention and MLP
            (``mode.layers.arch``).
        inner: the block to route around (default: a ``DenseBlock``); must have ``delta``.
    """

    FIXED_OPTIONS: ClassVar[dict[str, str]] = {}  # routing options a subclass decides for itself

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        capacity: float | None = None,
        mlp_ratio: int = 4,
        *,
        opts: RoutingConfig | None = None,
        arch: Arch = DEFAULT_ARCH,
        inner: TransformerBlock | None = None,
        **options: object,
    ) -> None:
        super().__init__()
        given = {"capacity": capacity} if capacity is not None else {}
        opts = options_object(RoutingConfig, opts, {**given, **options}, "routing")
        if self.FIXED_OPTIONS:
            opts = replace(opts, **self.FIXED_OPTIONS, field_prefix="")
        self.opts = opts
        if opts.kernels == "triton" and (missing := triton_missing_reason()) is not None:
            raise RuntimeError(f"MoD kernels='triton' (model.mod.kernels) cannot be used: {missing}")
        self.capacity, self.gate, self.causal = opts.capacity, opts.gate, opts.causal
        self.causal_coef, self.kernels = opts.causal_coef, opts.kernels
        self.router = Router(d_model, 1, bias=True)  # the bias offsets the gate, not the choice
        self.predictor = (
            RoutingPredictor(d_model, opts.capacity, opts.predictor_hidden) if opts.causal == "predictor" else None
        )
        self.block = inner if inner is not None else DenseBlock(d_model, n_heads, mlp_ratio, arch)

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
        kernels = f", kernels={self.kernels!r}" if self.kernels != "auto" else ""
        return f"capacity={self.capacity}, gate={self.gate!r}, causal={self.causal!r}{kernels}"

    def uses_triton(self, device: torch.device) -> bool:
        """Whether the token gather/scatter runs the Triton kernels on ``device`` ("auto" does
        not: on an H200 the Triton gather was slower than torch's, RESULTS.md); RuntimeError
        saying why when "triton" was asked for and cannot run there."""
        if self.kernels != "triton":
            return False
        reason = triton_unavailable_reason(device)
        if reason is not None:
            raise RuntimeError(f"MoD kernels='triton' (model.mod.kernels) cannot run: {reason}")
        return True

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, D] -> [B, T] router scores, projected in at least float32 (bf16 ties are common)."""
        return self.router(x).squeeze(-1)

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
        check_hidden(x, self.router.in_features)
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
        if measuring():
            self._record_health(scores, plan.indices)
        if k == 0:
            return x
        if x.shape[0] == 0:
            # NOTE: an empty local batch still runs the inner block (on no rows), connected to
            # the output: under expert parallelism its all-to-alls must see every rank.
            return x + 0 * self.block.delta(x[:, :k], None if positions is None else positions[:, :k]).sum()
        rows = token_rows(plan.indices, x.shape[1])  # [B * k] rows of x.view(B * T, D)
        ops = mod_tokens() if self.uses_triton(x.device) else TorchRows  # the row primitives
        x_sel, x = take_tokens(x, plan.indices, rows, ops)  # [B, k, D] and the residual stream
        weights = plan.weights if scores.requires_grad else self.router_logits(x_sel)  # [B, k]
        if positions is None:  # RoPE rows: one gather from the cached table of the T positions
            delta = self.block.delta(x_sel, plan.indices, length=x.shape[1])  # [B, k, D]
        else:
            delta = self.block.delta(x_sel, positions.gather(1, plan.indices))
        gate = GATES[self.gate](weights)
        return add_gated_tokens(x, plan.indices, gate, delta, rows, ops)

    @torch.no_grad()
    def _record_health(self, scores: torch.Tensor, chosen: torch.Tensor) -> None:
        """Router-collapse metrics: ``position_share`` [10], the share of picks in each tenth of
        the positions, and ``score_entropy``, the mean entropy of the softmax of each
        sequence's scores over log T (1 = flat, 0 = one token takes all)."""
        T = scores.shape[1]
        if chosen.numel():
            buckets = torch.div(chosen * POSITION_BUCKETS, T, rounding_mode="floor").reshape(-1)
            self.metrics["position_share"] = count_ids(buckets, POSITION_BUCKETS) / buckets.numel()
        if T > 1 and scores.shape[0]:
            p = torch.softmax(scores.float(), dim=-1)
            entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1).mean()
            self.metrics["score_entropy"] = entropy / math.log(T)

    def _record_causal_losses(self, x: torch.Tensor, scores: torch.Tensor, chosen: torch.Tensor) -> None:
        if self.causal == "none":
            return
        if self.predictor is not None and self.training and capacity_to_k(self.capacity, chosen.shape[1]):
            self.predictor.update_threshold(scores, chosen)
        logits = self.decision_logits(x, scores)
        self.record_aux("causal_bce", membership_bce(logits, chosen), self.causal_coef)
        if measuring():
            for name, value in decision_metrics(logits, chosen).items():
                self.metrics[f"decision_{name}"] = value

    def _forward_causal(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        """Each token decides alone (x: a sequence from its first token); the block runs on the
        routed tokens only and they alone take the update (and enter the cache, which must be
        empty: a forward is the prefill).

        Each row's routed tokens are gathered in position order and padded at the end to the
        longest row: causal attention over that packed sequence is attention over the routed
        keys at earlier positions (padding comes after every real token, so no query sees it),
        with no [T, T] mask and O(n^2) work for n routed tokens instead of O(T^2).
        """
        self.clear_aux()
        B, T, D = x.shape
        scores = self.router_logits(x)  # [B, T]
        routed = causal_decisions(self.decision_logits(x, scores))  # [B, T]
        self.metrics["causal_share"] = routed.float().mean()
        counts = routed.sum(dim=1)  # [B]
        # NOTE: eager mode packs to the longest row (one host read); compiled code packs to T,
        # a static size: no graph break and one graph for every batch (the padding is masked).
        n = T if torch.compiler.is_compiling() else (int(counts.max()) if B else 0)
        out = x  # nothing routed: the block does not run and the cache stays empty
        if n:
            # Routed positions first (stable: in position order), then the skipped ones.
            order = torch.sort((~routed).to(torch.uint8), dim=1, stable=True).indices[:, :n]  # [B, n]
            valid = (torch.arange(n, device=x.device) < counts[:, None]).unsqueeze(-1)  # [B, n, 1]
            index = order.unsqueeze(-1).expand(B, n, D)
            x_picked = x.gather(1, index)
            x_sel = x_picked * valid.to(x.dtype)
            delta = self.block.delta(x_sel, positions.gather(1, order), cache=cache, cache_keep=valid.squeeze(-1))
            g = GATES[self.gate](scores.gather(1, order)).unsqueeze(-1).to(delta.dtype)
            # each row's n picked positions are distinct: padding writes its own value back
            out = x.scatter(1, index, torch.where(valid, x_sel + g * delta, x_picked))
        if cache is not None and self.predictor is not None:
            cache.record_scores(scores)  # the prefix the predictor's decode continues from
        return out

    def decode(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """x: [B, 1, D] one new token per row; rows whose token skips cost nothing and write no KV."""
        scores = self.router_logits(x)  # [B, 1]
        if self.predictor is not None:
            cache.record_scores(scores)
            logits = self.predictor.decode_logits(x, cache.scores_seen(), cache.predictor_state)
        else:
            logits = self.decision_logits(x, scores)
        rows = causal_decisions(logits[:, 0]).nonzero().squeeze(-1)
        if rows.numel() == 0:
            return x
        x_r = x.index_select(0, rows)
        delta = self.block.delta_decode(x_r, positions.index_select(0, rows), cache, rows)
        g = GATES[self.gate](scores.index_select(0, rows)).unsqueeze(-1).to(delta.dtype)
        return x.index_copy(0, rows, x_r + g * delta)


def mod_tokens():
    """``mode.kernels.mod_tokens`` (imports Triton; only called once a block uses it)."""
    from mode.kernels import mod_tokens as module  # noqa: PLC0415

    return module


class RandomMoDBlock(MoDBlock):
    """The stochastic-routing control of the MoD paper: the same block, but each sequence's
    ``k = floor(capacity * T)`` routed tokens are drawn uniformly at random (scores from
    ``torch.rand``, no gradient) and take the update ungated (g = 1). Its router weights are
    unused and frozen."""

    # random scores decide, ungated, with no per-token rule: the gate and causal options of
    # ``opts`` (a model's shared ``model.mod``) do not apply to this block
    FIXED_OPTIONS: ClassVar[dict[str, str]] = {"gate": "none", "causal": "none"}

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.router.requires_grad_(False)

    # NOTE: traced into compiled graphs (fullgraph); ``mode.compile`` compiles with inductor's
    # ``fallback_random`` so that a compiled model draws what the eager one draws.
    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, D] -> [B, T] uniform random scores, no gradient: from the global torch RNG
        in training, from a generator seeded 0 at every forward in evaluation, so that an
        evaluated model is a fixed function of its input (repeatable validation losses)."""
        if self.training:
            return torch.rand(x.shape[:2], device=x.device)
        gen = torch.Generator(x.device).manual_seed(0)
        return torch.rand(x.shape[:2], device=x.device, generator=gen)

    def non_causal_reason(self) -> str | None:
        return "random routing draws k tokens of the whole sequence: sample without the cache (use_cache=False)"

    def extra_repr(self) -> str:
        return f"capacity={self.capacity}, routing='random'"


class StagedMoDEBlock(MoDBlock):
    """Staged MoDE: a MoD router picks ``floor(capacity * T)`` tokens per sequence around the
    whole block; only they go through attention and a (dropless by default) MoE MLP. Output
    ``x + g(r) * f(x)`` on chosen tokens; skipping tokens never reach the experts.

    ``moe``: the built MoE layer (``mode.layers.kinds.build_moe``); without it, the keyword
    ``options`` that are ``RoutingConfig`` fields route and the rest are ``MoEConfig`` fields
    (``n_experts``, ``top_k``, ``mlp``, ``lb_coef``, ...) of a layer built by the same
    ``build_moe_layer``, ``d_ff`` wide (default ``4 * d_model // top_k``).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        capacity: float | None = None,
        *,
        opts: RoutingConfig | None = None,
        moe: MoELayer | None = None,
        d_ff: int | None = None,
        arch: Arch = DEFAULT_ARCH,
        **options: object,
    ) -> None:
        routing = {k: v for k, v in options.items() if k in ROUTING_FIELDS}
        experts = {k: v for k, v in options.items() if k not in ROUTING_FIELDS}
        if moe is None:
            moe_opts = options_object(MoEConfig, None, experts, "MoE")
            moe = build_moe_layer(d_model, moe_opts, d_ff or moe_opts.width(d_model))
        elif experts or d_ff is not None:
            raise TypeError(f"a built moe takes no MoE options: {sorted(experts) + ['d_ff'] * (d_ff is not None)}")
        inner = MoEBlock(d_model, n_heads, moe, arch)
        super().__init__(d_model, n_heads, capacity, opts=opts, arch=arch, inner=inner, **routing)
