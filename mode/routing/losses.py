"""Router auxiliary losses and aux-loss-free balancing.

Legend: N tokens, E experts (real + no-op), K experts per token.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
import torch.distributed as dist

from mode.routing.counting import count_ids

# Over which tokens the load-balance loss is computed: this rank's micro-batch, each sequence,
# or the micro-batches of every data-parallel rank together (statistics all-reduced).
LbScope = Literal["micro_batch", "sequence", "global_batch"]
LB_SCOPES: tuple[str, ...] = get_args(LbScope)


def target_shares(n_experts: int, n_noop: int = 0, noop_share: float = 0.0) -> torch.Tensor:
    """[E + n_noop] target share of assignments: uniform over real experts, with
    ``noop_share`` of the total spread uniformly over the no-op experts."""
    if n_noop == 0:
        return torch.full((n_experts,), 1.0 / n_experts)
    real = torch.full((n_experts,), (1.0 - noop_share) / n_experts)
    noop = torch.full((n_noop,), noop_share / n_noop)
    return torch.cat([real, noop])


def load_balance_loss(
    probs: torch.Tensor,
    experts: torch.Tensor,
    target: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Switch load-balance loss ``sum_e f_e * P_e / t_e`` (= ``E * sum_e f_e P_e`` for a uniform
    target), where f_e is the share of the N*K assignments routed to e and P_e the mean router
    probability. Equals 1 at perfect balance; gradient flows through P only.

    probs: [N, E] or [B, N, E] (then computed per sequence and averaged);
    experts: [N, K] or [B, N, K]; valid: [N] or [B, N] bool, the tokens to count (None: all),
    so that a token with NaN logits does not make the loss NaN for the whole batch.

    ``group`` (2-D inputs only): the ranks whose tokens form the global batch. The assignment
    counts and token totals are all-reduced over it (no gradient), so ``f`` is the global
    batch's; each rank returns ``W * sum_e f_e * S_e / (N_global * t_e)`` with ``S_e`` its own
    probability sums, whose mean over the W ranks is the global-batch loss and whose gradient,
    averaged over the ranks as data parallelism does, is the global-batch loss's gradient.
    """
    E = probs.shape[-1]
    if target is None:
        target = torch.full((E,), 1.0 / E)
    target = target.to(probs.device, torch.float32)
    if probs.dim() == 3:
        rows = valid if valid is not None else [None] * len(probs)
        return torch.stack(
            [load_balance_loss(p, e, target, v) for p, e, v in zip(probs, experts, rows, strict=True)]
        ).mean()
    probs = probs.float()
    ones = torch.ones(experts.shape, device=probs.device)  # [N, K]: one per counted assignment
    if valid is not None:
        probs = torch.where(valid.unsqueeze(-1), probs, 0.0)
        ones = ones * valid.unsqueeze(-1)
    counts = torch.zeros(E, device=probs.device).index_add_(0, experts.reshape(-1), ones.reshape(-1))
    totals = torch.stack([ones.sum(), ones[:, 0].sum()])  # assignments, tokens counted
    scale = 1.0
    if group is not None:
        stats = torch.cat([counts, totals])
        dist.all_reduce(stats, group=group)
        counts, totals = stats[:E], stats[E:]
        scale = dist.get_world_size(group)
    f = counts / totals[0].clamp_min(1)
    P = probs.sum(dim=0) / totals[1].clamp_min(1)  # over the counted tokens; empty batch: 0
    return scale * (f * P / target).sum()


def router_z_loss(logits: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """ST-MoE router z-loss: ``mean(logsumexp(logits)^2)`` over tokens (0 for N = 0).
    logits: [N, E]; valid: [N] bool, the tokens to count (None: all)."""
    z = torch.logsumexp(logits.float(), dim=-1).pow(2)
    if valid is None:
        return z.sum() / max(1, logits.shape[0])
    return torch.where(valid, z, 0.0).sum() / valid.sum().clamp_min(1)


def expert_load(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """[E] share of assignments per expert (sums to 1)."""
    counts = count_ids(experts, n_experts).float()
    return counts / counts.sum().clamp_min(1)


@torch.no_grad()
def update_selection_bias(
    bias: torch.Tensor, load: torch.Tensor, rate: float, target: torch.Tensor | None = None
) -> None:
    """Aux-loss-free balancing, in place: ``bias += rate * sign(target - load)``
    (target defaults to the mean load), so overloaded experts are chosen less often."""
    target = load.mean() if target is None else target.to(load)
    bias.add_(rate * torch.sign(target - load))
