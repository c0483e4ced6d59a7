"""Router auxiliary losses and aux-loss-free balancing.

Legend: N tokens, E experts (real + no-op), K experts per token.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

# Over which tokens the load-balance loss is computed: the whole batch, or each sequence.
LbScope = Literal["batch", "sequence"]
LB_SCOPES: tuple[str, ...] = get_args(LbScope)


def target_shares(n_experts: int, n_noop: int = 0, noop_share: float = 0.0) -> torch.Tensor:
    """[E + n_noop] target share of assignments: uniform over real experts, with
    ``noop_share`` of the total spread uniformly over the no-op experts."""
    if n_noop == 0:
        return torch.full((n_experts,), 1.0 / n_experts)
    real = torch.full((n_experts,), (1.0 - noop_share) / n_experts)
    noop = torch.full((n_noop,), noop_share / n_noop)
    return torch.cat([real, noop])


def load_balance_loss(probs: torch.Tensor, experts: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
    """Switch load-balance loss ``sum_e f_e * P_e / t_e`` (= ``E * sum_e f_e P_e`` for a uniform
    target), where f_e is the share of the N*K assignments routed to e and P_e the mean router
    probability. Equals 1 at perfect balance; gradient flows through P only.

    probs: [N, E] or [B, N, E] (then computed per sequence and averaged);
    experts: [N, K] or [B, N, K].
    """
    E = probs.shape[-1]
    if target is None:
        target = torch.full((E,), 1.0 / E)
    target = target.to(probs.device, torch.float32)
    if probs.dim() == 3:
        return torch.stack([load_balance_loss(p, e, target) for p, e in zip(probs, experts, strict=True)]).mean()
    counts = torch.zeros(E, device=probs.device).index_add_(
        0, experts.reshape(-1), torch.ones(experts.numel(), device=probs.device)
    )
    f = counts / max(1, experts.numel())
    P = probs.float().sum(dim=0) / max(1, probs.shape[0])  # an empty batch gives 0, not NaN
    return (f * P / target).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss: ``mean(logsumexp(logits)^2)`` over tokens (0 for N = 0). logits: [N, E]."""
    return torch.logsumexp(logits.float(), dim=-1).pow(2).sum() / max(1, logits.shape[0])


def expert_load(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """[E] share of assignments per expert (sums to 1)."""
    counts = torch.bincount(experts.reshape(-1), minlength=n_experts).float()
    return counts / counts.sum().clamp_min(1)


@torch.no_grad()
def update_selection_bias(
    bias: torch.Tensor, load: torch.Tensor, rate: float, target: torch.Tensor | None = None
) -> None:
    """Aux-loss-free balancing, in place: ``bias += rate * sign(target - load)``
    (target defaults to the mean load), so overloaded experts are chosen less often."""
    target = load.mean() if target is None else target.to(load)
    bias.add_(rate * torch.sign(target - load))
