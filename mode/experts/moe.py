"""MoE layers: ``DroplessMoE`` (grouped GEMM, every assignment computed) and ``CapacityMoE``
(the classic capacity-factor baseline with padded per-expert buffers and token dropping).

Both have the same parameters, so one checkpoint loads in either. ``forward(x [..., D]) ->
[..., D]``; auxiliary losses and metrics of the last forward stay on the module (see
``mode.routed``). No-op experts (``n_noop``) output zero and cost no GEMM: the integrated MoDE
block uses them.

Legend: N tokens, D model dim, F expert hidden, E real experts, E0 = E + n_noop router
outputs, K experts per token, C slots per expert, M assignments computed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mode.experts.mlp import ExpertMLP
from mode.experts.permute import Dispatch, combine, permute, sort_by_expert, sorted_weights, unpermute
from mode.routed import Routed
from mode.routing.losses import (
    expert_load,
    load_balance_loss,
    router_z_loss,
    target_shares,
    update_selection_bias,
)
from mode.routing.token_choice import (
    TokenChoice,
    capacity_keep,
    expert_capacity,
    expert_choice_tokens,
    jitter,
    token_choice_topk,
)

# (x_sorted [M, D], counts [E], experts) -> y_sorted [M, D]; expert parallelism swaps this.
Dispatcher = Callable[[torch.Tensor, torch.Tensor, ExpertMLP], torch.Tensor]


def local_dispatch(x_sorted: torch.Tensor, counts: torch.Tensor, experts: ExpertMLP) -> torch.Tensor:
    """All experts live on this device: run the grouped GEMM directly."""
    return experts(x_sorted, counts)


class MoELayer(Routed):
    """Router + experts + losses shared by ``DroplessMoE`` and ``CapacityMoE``.

    Args:
        d_model, d_ff: model and per-expert hidden sizes.
        n_experts, top_k: real experts and experts per token.
        mlp: "gelu" or "swiglu".
        backend: "auto", "chunked", "torch", "loop" or "megablocks" (``mode.experts.grouped_gemm``).
        router: "token_choice" (top-k experts per token) or "expert_choice" (each expert takes
            its top-C tokens, C = ceil(capacity_factor * N * K / E)).
        renormalize: top-k combine weights sum to one. jitter: router input noise (training).
        capacity_factor, drop_policy: capacity MoE / expert-choice slots.
        shared_expert: add a dense MLP of width d_ff that every token goes through.
        n_noop, noop_share: no-op experts and their target share in the balance loss.
        lb_coef, lb_scope, z_coef: load-balance ("batch" or "sequence") and z-loss coefficients.
        bias_rate: aux-loss-free balancing rate (per-expert selection bias, fp32 buffer).
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        n_experts: int,
        top_k: int = 2,
        mlp: str = "gelu",
        backend: str = "auto",
        router: str = "token_choice",
        renormalize: bool = True,
        jitter: float = 0.0,
        capacity_factor: float = 1.25,
        drop_policy: str = "position",
        shared_expert: bool = False,
        n_noop: int = 0,
        noop_share: float = 0.5,
        lb_coef: float = 0.01,
        lb_scope: str = "batch",
        z_coef: float = 0.001,
        bias_rate: float = 0.0,
    ) -> None:
        super().__init__()
        from mode.config import MoEConfig  # noqa: PLC0415  (one place validates the values)

        MoEConfig(
            n_experts=n_experts,
            top_k=top_k,
            d_ff=d_ff,
            mlp=mlp,
            backend=backend,
            router=router,
            jitter=jitter,
            capacity_factor=capacity_factor,
            drop_policy=drop_policy,
            n_noop=n_noop,
            noop_share=noop_share,
            lb_coef=lb_coef,
            lb_scope=lb_scope,
            z_coef=z_coef,
            bias_rate=bias_rate,
        )
        if router == "expert_choice" and n_noop:
            raise ValueError("router='expert_choice' does not support no-op experts (n_noop must be 0)")
        self.n_experts, self.top_k, self.n_noop = n_experts, top_k, n_noop
        self.router_kind, self.renormalize, self.jitter = router, renormalize, jitter
        self.capacity_factor, self.drop_policy = capacity_factor, drop_policy
        self.lb_coef, self.lb_scope, self.z_coef, self.bias_rate = lb_coef, lb_scope, z_coef, bias_rate
        self.router = nn.Linear(d_model, n_experts + n_noop, bias=False)
        self.experts = ExpertMLP(n_experts, d_model, d_ff, mlp, backend)
        real_share = 1.0 - (noop_share if n_noop else 0.0)
        self.experts.active_fraction = min(1.0, top_k * real_share / n_experts)
        self.shared = ExpertMLP(1, d_model, d_ff, mlp, backend) if shared_expert else None
        self.register_buffer("target", target_shares(n_experts, n_noop, noop_share), persistent=False)
        self.register_buffer("selection_bias", torch.zeros(n_experts + n_noop))
        self.register_buffer("_load_sum", torch.zeros(n_experts + n_noop), persistent=False)
        self.dispatcher: Dispatcher = local_dispatch

    def non_causal_reason(self) -> str | None:
        if self.router_kind == "expert_choice":
            return (
                "expert-choice experts pick their tokens among the whole batch: use "
                "router='token_choice' (config: model.moe.router), or sample without the cache "
                "(generate(use_cache=False))"
            )
        return None

    def extra_repr(self) -> str:
        parts = [f"n_experts={self.n_experts}", f"top_k={self.top_k}", f"router={self.router_kind!r}"]
        if self.n_noop:
            parts.append(f"n_noop={self.n_noop}")
        if self.router_kind == "expert_choice" or isinstance(self, CapacityMoE):
            parts.append(f"capacity_factor={self.capacity_factor}")
        if isinstance(self, CapacityMoE):
            parts.append(f"drop_policy={self.drop_policy!r}")
        return ", ".join(parts)

    # -- routing -----------------------------------------------------------------------------
    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, D] -> [N, E0] float32 (with input jitter in training)."""
        if self.training and self.jitter:
            x = jitter(x, self.jitter)
        return self.router(x).float()

    def route(self, x: torch.Tensor, seq_shape: tuple[int, ...]) -> tuple[TokenChoice, torch.Tensor]:
        """Top-k token choice on x: [N, D]; records losses and load. Returns the choice and logits."""
        logits = self.router_logits(x)
        bias = self.selection_bias if self.bias_rate else None
        choice = token_choice_topk(logits, self.top_k, self.renormalize, bias)
        if self.lb_scope == "sequence" and len(seq_shape) == 3:
            B, T = seq_shape[:2]
            lb = load_balance_loss(choice.probs.view(B, T, -1), choice.experts.view(B, T, -1), self.target)
        else:
            lb = load_balance_loss(choice.probs, choice.experts, self.target)
        load = expert_load(choice.experts, self.n_experts + self.n_noop)
        self.record_aux("lb_loss", lb, self.lb_coef)
        self.metrics["load"] = load
        if self.n_noop:
            self.metrics["noop_share"] = load[self.n_experts :].sum()
        if self.training and self.bias_rate:
            self._load_sum += load
        return choice, logits

    def after_optimizer_step(self) -> None:
        """Aux-loss-free balancing: move the selection bias toward the target load."""
        if self.bias_rate and self._load_sum.sum() > 0:
            load = self._load_sum / self._load_sum.sum()
            target = self.target if self.n_noop else None
            update_selection_bias(self.selection_bias, load, self.bias_rate, target)
            self._load_sum.zero_()

    # -- forward -----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        D = x.shape[-1]
        x2 = x.reshape(-1, D)
        self.clear_aux()
        if self.router_kind == "expert_choice":
            out = self._expert_choice(x2)
        else:
            choice, logits = self.route(x2, tuple(x.shape))
            self.record_aux("z_loss", router_z_loss(logits), self.z_coef)
            out = self._compute(x2, choice)
        if self.shared is not None:
            out = out + self.shared(x2, torch.tensor([x2.shape[0]], device=x.device))
        return out.view_as(x)

    def _expert_choice(self, x2: torch.Tensor) -> torch.Tensor:
        N = x2.shape[0]
        logits = self.router_logits(x2)
        self.record_aux("z_loss", router_z_loss(logits), self.z_coef)
        C = expert_capacity(N, self.top_k, self.n_experts, self.capacity_factor)
        tokens, weights = expert_choice_tokens(torch.softmax(logits, dim=-1), C)  # [E, C]
        counts = torch.full((self.n_experts,), tokens.shape[1], device=x2.device, dtype=torch.long)
        token_idx = tokens.reshape(-1)
        y = self.dispatcher(x2.index_select(0, token_idx), counts, self.experts)
        self.metrics["dispatched"] = token_idx.numel()
        self.metrics["unrouted_tokens"] = 1.0 - torch.unique(token_idx).numel() / max(1, N)
        return unpermute(y, token_idx, weights.reshape(-1), N)

    def _compute(self, x2: torch.Tensor, choice: TokenChoice) -> torch.Tensor:
        raise NotImplementedError

    def _run_dispatch(self, x2: torch.Tensor, choice: TokenChoice, dispatch: Dispatch) -> torch.Tensor:
        if self.dispatcher is local_dispatch and self.experts.runs_chunked(x2, dispatch.token_idx.numel()):
            weights = sorted_weights(choice.weights, dispatch)
            return self.experts(x2, dispatch.counts, token_idx=dispatch.token_idx, weights=weights)
        y = self.dispatcher(permute(x2, dispatch), dispatch.counts, self.experts)
        return combine(y, dispatch, choice.weights)


class DroplessMoE(MoELayer):
    """Every assignment to a real expert is computed (MegaBlocks-style grouped GEMM over
    tokens sorted by expert); assignments to no-op experts cost nothing."""

    def __init__(self, d_model: int, d_ff: int, n_experts: int, top_k: int = 2, **kwargs) -> None:
        super().__init__(d_model, d_ff, n_experts, top_k, **kwargs)

    def _compute(self, x2: torch.Tensor, choice: TokenChoice) -> torch.Tensor:
        dispatch = sort_by_expert(choice.experts, self.n_experts, has_noop=self.n_noop > 0)
        self.metrics["dispatched"] = dispatch.order.numel()
        self.metrics["drop_fraction"] = 0.0
        return self._run_dispatch(x2, choice, dispatch)


class CapacityMoE(MoELayer):
    """The Switch/GShard baseline: each expert has ``C = ceil(capacity_factor * N * K / E)``
    slots in a padded buffer ``[E, C, D]`` computed with batched matmuls; assignments beyond
    C are dropped by ``drop_policy`` and contribute zero (the token keeps its residual)."""

    def __init__(self, d_model: int, d_ff: int, n_experts: int, top_k: int = 2, **kwargs) -> None:
        super().__init__(d_model, d_ff, n_experts, top_k, **kwargs)

    def capacity(self, n_tokens: int) -> int:
        return expert_capacity(n_tokens, self.top_k, self.n_experts, self.capacity_factor)

    def non_causal_reason(self) -> str | None:
        return (
            "a capacity MoE drops assignments by their rank in the whole batch: use the dropless "
            "MoE (layout 'moe' instead of 'moe_capacity'), or sample without the cache "
            "(generate(use_cache=False))"
        )

    def _compute(self, x2: torch.Tensor, choice: TokenChoice) -> torch.Tensor:
        N, D = x2.shape
        E, C = self.n_experts, self.capacity(N)
        keep = capacity_keep(choice.experts, choice.weights, E, C, self.drop_policy)
        dispatch = sort_by_expert(choice.experts, E, keep, has_noop=self.n_noop > 0)
        real = (choice.experts < E).sum().clamp_min(1)
        self.metrics["dispatched"] = dispatch.order.numel()
        self.metrics["drop_fraction"] = 1.0 - dispatch.order.numel() / real
        # Slot of each kept assignment: expert * C + rank inside its expert.
        expert_sorted = choice.experts.reshape(-1).index_select(0, dispatch.order)
        starts = torch.cumsum(dispatch.counts, 0) - dispatch.counts
        rank = torch.arange(dispatch.order.numel(), device=x2.device) - starts[expert_sorted]
        slot = expert_sorted * C + rank
        buffer = x2.new_zeros(E * C, D).index_copy(0, slot, permute(x2, dispatch))
        y = self.experts.forward_padded(buffer.view(E, C, D)).reshape(E * C, D).index_select(0, slot)
        return combine(y, dispatch, choice.weights)
