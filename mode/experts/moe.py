"""MoE layers: ``DroplessMoE`` (grouped GEMM, every assignment computed), ``CapacityMoE``
(the classic capacity-factor baseline with padded per-expert buffers and token dropping) and
``ExpertChoiceMoE`` (each expert takes its top-C tokens of the batch).

All have the same parameters, so one checkpoint loads in any of them. ``forward(x [..., D])
-> [..., D]``; auxiliary losses and metrics of the last forward stay on the module (see
``mode.routed``). No-op experts (``n_noop``) output zero and cost no GEMM: the integrated
MoDE block uses them. ``MoEConfig`` is the one place the options are written and
validated; a layer takes one (``opts``) or builds one from its keywords, and
``build_moe_layer`` is how blocks get theirs.

Legend: N tokens, D model dim, F expert hidden, E real experts, E0 = E + n_noop router
outputs, K experts per token, C slots per expert, M assignments computed.
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass

import torch
from torch import nn

from mode.checks import check_choice, check_hidden, check_int, check_positive, check_range, fail, options_object
from mode.experts.dispatch import Dispatcher, LocalDispatcher
from mode.experts.grouped_gemm import BACKEND_NAMES
from mode.experts.mlp import MLP_KINDS, ExpertMLP, mlp_flops
from mode.experts.permute import (
    TOKEN_MOVES,
    computed,
    padded_combine,
    padded_dispatch,
    sort_by_expert,
    unpermute,
)
from mode.routed import Routed, Router, measuring, recomputing
from mode.routing.losses import (
    LB_SCOPES,
    expert_load,
    load_balance_loss,
    router_z_loss,
    target_shares,
    update_selection_bias,
)
from mode.routing.token_choice import (
    DROP_POLICIES,
    MOE_ROUTERS,
    TokenChoice,
    capacity_rank,
    expert_capacity,
    expert_choice_tokens,
    jitter,
    token_choice_topk,
)


def expert_width(d_model: int, top_k: int, mlp_ratio: int = 4) -> int:
    """Default per-expert hidden size ``mlp_ratio * d_model // top_k``: a token's active expert
    FLOPs then match a dense MLP of width ``mlp_ratio * d_model``."""
    return max(1, mlp_ratio * d_model // top_k)


@dataclass
class MoEConfig:
    """Experts in the MLP: routing, capacity, losses, backend; the one place these options are
    written and validated (``model.moe`` in a config; the MoE layers take one as ``opts``, or
    build one from their keywords).

    n_experts, top_k: real experts and experts per token (expert choice: the average).
    d_ff: hidden size of each expert; 0 means ``mlp_ratio * d_model // top_k`` (``width``) so
        that the active FLOPs per token match the dense MLP.
    mlp: "gelu" or "swiglu". backend: "auto", "chunked", "torch", "loop" or "megablocks"
        (``mode.experts.grouped_gemm``). router: "token_choice" or "expert_choice".
    renormalize: top-k combine weights sum to one. jitter: router input noise (training).
    capacity_factor, drop_policy: capacity MoE / expert-choice slots.
    shared_expert: add a dense MLP that every token goes through, ``shared_d_ff`` wide (0:
        d_ff); ``shared_gate`` scales it by ``sigmoid(x @ w)``, one learned projection (Qwen2-MoE).
    n_noop: no-op experts of the integrated MoDE block (output zero, cost nothing).
    noop_share: target share of assignments to the no-op experts in the load-balance loss.
    lb_coef, z_coef: load-balance and z-loss coefficients.
    lb_scope: the tokens the balance loss sees: "micro_batch" (this forward's), "sequence"
        (each sequence, averaged) or "global_batch" (this forward's on every rank of the
        layer's ``balance_group``, set by ``mode.parallel.expert_parallel.set_balance_group``;
        the micro-batch in a single process).
    bias_rate: aux-loss-free balancing (per-expert selection bias) update rate; 0 disables it.
    token_moves: "auto", "embedding_bag" or "index": how the dropless path moves token rows
        around its grouped GEMMs (``mode.experts.permute``).

    ``field_prefix`` (not a field) is how errors name an option: ``model.moe.`` for a config,
    "" for a layer's keyword arguments.
    """

    n_experts: int = 8
    top_k: int = 2
    d_ff: int = 0
    mlp: str = "gelu"
    backend: str = "auto"
    router: str = "token_choice"
    renormalize: bool = True
    jitter: float = 0.0
    capacity_factor: float = 1.25
    drop_policy: str = "position"
    shared_expert: bool = False
    shared_d_ff: int = 0
    shared_gate: bool = False
    n_noop: int = 0
    noop_share: float = 0.5
    lb_coef: float = 0.01
    lb_scope: str = "micro_batch"
    z_coef: float = 0.001
    bias_rate: float = 0.0
    token_moves: str = "auto"
    field_prefix: InitVar[str] = "model.moe."

    def __post_init__(self, field_prefix: str) -> None:
        def name(field: str) -> str:
            return field_prefix + field

        for field in ("n_experts", "n_noop", "top_k", "d_ff", "shared_d_ff"):
            check_int(name(field), getattr(self, field))
        check_positive(name("n_experts"), self.n_experts)
        check_positive(name("n_noop"), self.n_noop, allow_zero=True)
        if not 1 <= self.top_k <= self.n_experts + self.n_noop:
            fail(name("top_k"), self.top_k, f"must be in [1, n_experts + n_noop = {self.n_experts + self.n_noop}]")
        check_positive(name("d_ff"), self.d_ff, allow_zero=True)
        check_choice(name("mlp"), self.mlp, MLP_KINDS)
        check_choice(name("backend"), self.backend, (*BACKEND_NAMES, "auto"))
        check_choice(name("router"), self.router, MOE_ROUTERS)
        check_positive(name("jitter"), self.jitter, allow_zero=True)
        check_positive(name("capacity_factor"), self.capacity_factor)
        check_choice(name("drop_policy"), self.drop_policy, DROP_POLICIES)
        check_range(name("noop_share"), self.noop_share, 0.0, 1.0)
        check_positive(name("lb_coef"), self.lb_coef, allow_zero=True)
        check_choice(name("lb_scope"), self.lb_scope, LB_SCOPES)
        check_positive(name("z_coef"), self.z_coef, allow_zero=True)
        check_positive(name("bias_rate"), self.bias_rate, allow_zero=True)
        check_choice(name("token_moves"), self.token_moves, TOKEN_MOVES)
        check_positive(name("shared_d_ff"), self.shared_d_ff, allow_zero=True)
        for field in ("shared_d_ff", "shared_gate"):
            if getattr(self, field) and not self.shared_expert:
                fix = "applies to the shared expert: set shared_expert=true, or leave it unset"
                fail(name(field), getattr(self, field), fix)
        if self.router == "expert_choice" and self.n_noop:
            fail(name("n_noop"), self.n_noop, "expert-choice experts take no no-op experts: use 0")

    def width(self, d_model: int, mlp_ratio: int = 4) -> int:
        """Each expert's hidden size: ``d_ff``, or ``expert_width(d_model, top_k, mlp_ratio)``."""
        return self.d_ff or expert_width(d_model, self.top_k, mlp_ratio)


def moe_flops(
    n: int,
    d_model: int,
    d_ff: int,
    cfg: MoEConfig,
    layer: str = "dropless",
    real_share: float = 1.0,
    n_noop: int = 0,
) -> int:
    """Forward FLOPs of an MoE layer (``layer`` a key of ``MOE_CLASSES``) on n tokens: the
    router over E (+ no-op) experts, the expert GEMMs on the rows computed (dropless: n *
    top_k * real_share assignments; capacity / expert choice: E padded or chosen slots), and
    the shared expert."""
    router = 2 * n * d_model * (cfg.n_experts + n_noop)
    if layer == "dropless":
        rows = round(n * cfg.top_k * real_share)
    else:
        rows = cfg.n_experts * expert_capacity(n, cfg.top_k, cfg.n_experts, cfg.capacity_factor)
    shared = mlp_flops(n, d_model, cfg.shared_d_ff or d_ff, cfg.mlp) + 2 * n * d_model * cfg.shared_gate
    shared = shared if cfg.shared_expert else 0
    return router + mlp_flops(rows, d_model, d_ff, cfg.mlp) + shared


class MoELayer(Routed):
    """Router + experts + losses shared by the MoE layers.

    ``MoELayer(d_model, d_ff, n_experts, top_k, **options)`` or ``MoELayer(d_model, d_ff,
    opts=MoEConfig(...))``: ``d_model`` and ``d_ff`` (the resolved per-expert width) are sizes;
    every other option is a ``MoEConfig`` field (documented there) and ``opts`` keeps them
    (``opts.d_ff`` and ``opts.router`` are the config's: the width is the argument, the router
    kind the class). ``balance_group`` (runtime only) holds the ranks of the global batch for
    ``lb_scope="global_batch"``.
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        n_experts: int | None = None,
        top_k: int | None = None,
        *,
        opts: MoEConfig | None = None,
        **options: object,
    ) -> None:
        super().__init__()
        given = {k: v for k, v in (("n_experts", n_experts), ("top_k", top_k)) if v is not None}
        self.opts = opts = options_object(MoEConfig, opts, {**given, **options}, "MoE")
        self.n_experts, self.top_k, self.n_noop = opts.n_experts, opts.top_k, opts.n_noop
        self.renormalize, self.jitter = opts.renormalize, opts.jitter
        self.capacity_factor, self.drop_policy = opts.capacity_factor, opts.drop_policy
        self.lb_coef, self.lb_scope, self.z_coef = opts.lb_coef, opts.lb_scope, opts.z_coef
        self.bias_rate, self.token_moves = opts.bias_rate, opts.token_moves
        E0 = opts.n_experts + opts.n_noop
        self.router = Router(d_model, E0)
        self.experts = ExpertMLP(opts.n_experts, d_model, d_ff, opts.mlp, opts.backend)
        real_share = 1.0 - (opts.noop_share if opts.n_noop else 0.0)
        self.experts.active_fraction = min(1.0, opts.top_k * real_share / opts.n_experts)
        shared_d_ff = opts.shared_d_ff or d_ff
        self.shared = ExpertMLP(1, d_model, shared_d_ff, opts.mlp, opts.backend) if opts.shared_expert else None
        self.shared_gate = nn.Linear(d_model, 1, bias=False) if opts.shared_gate else None
        self.register_buffer("target", target_shares(opts.n_experts, opts.n_noop, opts.noop_share), persistent=False)
        self.register_buffer("selection_bias", torch.zeros(E0))
        self.register_buffer("_load_sum", torch.zeros(E0), persistent=False)
        self.dispatcher: Dispatcher = LocalDispatcher()
        self.balance_group = None

    def non_causal_reason(self) -> str | None:
        return None  # token choice: each token picks its experts from its own logits

    def extra_repr(self) -> str:
        parts = [f"n_experts={self.n_experts}", f"top_k={self.top_k}"]
        if self.n_noop:
            parts.append(f"n_noop={self.n_noop}")
        return ", ".join(parts)

    # -- routing -----------------------------------------------------------------------------
    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, D] -> [N, E0], projected in at least float32 (with input jitter in training)."""
        if self.training and self.jitter:
            x = jitter(x, self.jitter)
        return self.router(x)

    def route(self, x: torch.Tensor, seq_shape: tuple[int, ...]) -> tuple[TokenChoice, torch.Tensor]:
        """Top-k token choice on x: [N, D]; records the balance and z-losses and the load.
        Returns the choice and logits."""
        logits = self.router_logits(x)
        bias = self.selection_bias if self.bias_rate else None
        choice = token_choice_topk(logits, self.top_k, self.renormalize, bias)
        # NOTE: tokens with non-finite logits (NaN/inf input) are left out of the losses, so
        # one bad token does not poison the whole batch's balance and z-losses.
        finite = torch.isfinite(logits).all(dim=-1)  # [N]
        if self.lb_scope == "sequence" and len(seq_shape) == 3:
            B, T = seq_shape[:2]
            lb = load_balance_loss(
                choice.probs.view(B, T, -1), choice.experts.view(B, T, -1), self.target, finite.view(B, T)
            )
        else:
            # Training only: evaluation needs no balance loss, nor a collective per layer.
            group = self.balance_group if self.lb_scope == "global_batch" and self.training else None
            lb = load_balance_loss(choice.probs, choice.experts, self.target, finite, group)
        self.record_aux("lb_loss", lb, self.lb_coef)
        if measuring() or self.bias_rate:
            load = expert_load(choice.experts, self.n_experts + self.n_noop)
        if measuring():
            self.metrics["load"] = load
            real = load[: self.n_experts]  # share of all assignments on each real expert
            self.metrics["load_max"] = real.max()
            self.metrics["load_max_over_mean"] = real.max() / real.mean().clamp_min(1e-9)
            if self.n_noop:
                self.metrics["noop_share"] = load[self.n_experts :].sum()
        if self.training and self.bias_rate and not recomputing():
            self._load_sum += load
        self.record_aux("z_loss", router_z_loss(logits, finite), self.z_coef)
        return choice, logits

    def step_records(self) -> list[torch.Tensor]:
        """The expert load summed since the last step (aux-loss-free balancing reads it)."""
        return [self._load_sum] if self.bias_rate else []

    def after_optimizer_step(self, apply: bool | torch.Tensor = True) -> None:
        """Aux-loss-free balancing: move the selection bias toward the target load (with the
        load recorded since the last step; ``apply=False`` only clears it; a 0-dim bool tensor
        decides on the device)."""
        if self.bias_rate and apply is not False:  # no host read: a step with no load moves nothing
            total = self._load_sum.sum()
            moved = self.selection_bias.clone()
            target = self.target if self.n_noop else None
            update_selection_bias(moved, self._load_sum / total.clamp_min(1e-12), self.bias_rate, target)
            take = (total > 0) & torch.as_tensor(apply, device=total.device)
            self.selection_bias.copy_(torch.where(take, moved, self.selection_bias))
        self._load_sum.zero_()

    # -- forward -----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, D] or [B, T, D] -> the same shape (an empty N is allowed)."""
        check_hidden(x, self.router.in_features, ranks=(2, 3))
        D = x.shape[-1]
        x2 = x.reshape(-1, D)
        self.clear_aux()
        out = self._routed(x2, tuple(x.shape))
        if self.shared is not None:
            shared = self.shared(x2, torch.tensor([x2.shape[0]], device=x.device))
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x2)) * shared
            out = out + shared
        return out.view_as(x)

    def _routed(self, x2: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """The routed experts' output for x2 [N, D] -> [N, D] (``shape``: x's own shape)."""
        choice, _ = self.route(x2, shape)
        return self._compute(x2, choice)

    def _compute(self, x2: torch.Tensor, choice: TokenChoice) -> torch.Tensor:
        raise NotImplementedError


class DroplessMoE(MoELayer):
    """Every assignment to a real expert is computed (MegaBlocks-style grouped GEMM over
    tokens sorted by expert); assignments to no-op experts cost nothing."""

    def _compute(self, x2: torch.Tensor, choice: TokenChoice) -> torch.Tensor:
        dispatch = sort_by_expert(choice.experts, self.n_experts, has_noop=self.n_noop > 0)
        if measuring():
            self.metrics["dispatched"] = computed(dispatch)
            self.metrics["drop_fraction"] = 0.0
        return self.dispatcher.token_choice(x2, dispatch, choice.weights, self.experts, self.token_moves)


class CapacityMoE(MoELayer):
    """The Switch/GShard baseline: each expert has ``C = ceil(capacity_factor * N * K / E)``
    slots in a padded buffer ``[E, C, D]`` computed with batched matmuls; assignments beyond
    C are dropped by ``drop_policy`` and contribute zero (the token keeps its residual)."""

    def capacity(self, n_tokens: int) -> int:
        return expert_capacity(n_tokens, self.top_k, self.n_experts, self.capacity_factor)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, capacity_factor={self.capacity_factor}, drop_policy={self.drop_policy!r}"

    def non_causal_reason(self) -> str | None:
        return (
            "a capacity MoE drops assignments by their rank in the whole batch: use the dropless "
            "MoE (layout 'moe' instead of 'moe_capacity'), or sample without the cache "
            "(generate(use_cache=False))"
        )

    def _compute(self, x2: torch.Tensor, choice: TokenChoice) -> torch.Tensor:
        N, D = x2.shape
        E, C = self.n_experts, self.capacity(N)
        # Slot of each assignment in the [E * C] buffer: expert * C + its rank in serving order.
        # No sort by expert and no [N*K, D] gathered copies: rows go straight from x into the
        # buffer and the combine reads the buffer's output rows by slot (``padded_dispatch``,
        # ``padded_combine``); the zero-padded buffer and its batched GEMMs are what it costs.
        rank = capacity_rank(choice.experts, choice.weights, self.drop_policy)  # [N, K]
        placed = (rank < C) & (choice.experts < E)
        slots = choice.experts * C + rank
        if measuring():
            kept = placed.sum()
            self.metrics["dispatched"] = kept
            self.metrics["drop_fraction"] = 1.0 - kept / (choice.experts < E).sum().clamp_min(1)
        buffer = padded_dispatch(x2, slots, placed, E * C)  # [E * C, D]
        y = self.experts.forward_padded(buffer.view(E, C, D)).reshape(E * C, D)
        return padded_combine(y, slots, placed, choice.weights)


class ExpertChoiceMoE(MoELayer):
    """Expert choice (Zhou et al. 2022): each expert takes the ``C = ceil(capacity_factor * N *
    top_k / E)`` tokens of the batch with the highest router probability for it and weights its
    output by that probability; a token may get any number of experts, or none."""

    def __init__(self, d_model: int, d_ff: int, *args: int, **kwargs: object) -> None:
        super().__init__(d_model, d_ff, *args, **kwargs)
        if self.n_noop:
            fail("n_noop", self.n_noop, "expert-choice experts take no no-op experts: use 0")

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, capacity_factor={self.capacity_factor}"

    def non_causal_reason(self) -> str | None:
        return (
            "expert-choice experts pick their tokens among the whole batch: use "
            "router='token_choice' (config: model.moe.router), or sample without the cache "
            "(generate(use_cache=False))"
        )

    def _routed(self, x2: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        N = x2.shape[0]
        logits = self.router_logits(x2)
        self.record_aux("z_loss", router_z_loss(logits, torch.isfinite(logits).all(dim=-1)), self.z_coef)
        C = expert_capacity(N, self.top_k, self.n_experts, self.capacity_factor)
        tokens, weights = expert_choice_tokens(torch.softmax(logits, dim=-1), C)  # [E, C]
        counts = torch.full((self.n_experts,), tokens.shape[1], device=x2.device, dtype=torch.long)
        token_idx = tokens.reshape(-1)
        y = self.dispatcher(x2.index_select(0, token_idx), counts, self.experts)
        self.metrics["dispatched"] = token_idx.numel()
        self.metrics["unrouted_tokens"] = 1.0 - torch.unique(token_idx).numel() / max(1, N)
        return unpermute(y, token_idx, weights.reshape(-1), N)


MOE_CLASSES: dict[str, type[MoELayer]] = {
    "dropless": DroplessMoE,
    "capacity": CapacityMoE,
    "expert_choice": ExpertChoiceMoE,
}


def moe_layer_kind(opts: MoEConfig, capacity: bool = False) -> str:
    """The ``MOE_CLASSES`` key of the layer ``opts`` describes (``capacity``: the capacity MoE)."""
    if capacity:
        return "capacity"
    return "expert_choice" if opts.router == "expert_choice" else "dropless"


def build_moe_layer(d_model: int, opts: MoEConfig, d_ff: int, capacity: bool = False) -> MoELayer:
    """The one way a block gets its MoE: the layer of ``moe_layer_kind(opts, capacity)`` with
    per-expert width ``d_ff`` (``opts.width(...)`` resolves the default)."""
    return MOE_CLASSES[moe_layer_kind(opts, capacity)](d_model, d_ff, opts=opts)
