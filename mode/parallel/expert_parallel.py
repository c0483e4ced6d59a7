"""Expert parallelism: experts sharded over the "ep" group, tokens moved by all-to-all.

Legend: P ranks in the ep group, E experts (E_l = E / P per rank), M assignments this rank
routed (sorted by global expert id, so contiguous by destination rank), R rows received.

``parallelize(model, ctx)`` keeps the model code single-device: it slices every
``DroplessMoE``'s expert weights to this rank's ``E_l`` experts and swaps the layer's local
dispatcher for an ``ExpertParallelDispatcher``. Routing, no-op experts and MoD skipping
happen before dispatch, so skipped tokens and no-op assignments are never sent.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mode.experts.dispatch import Dispatcher
from mode.experts.mlp import ExpertMLP
from mode.experts.moe import CapacityMoE, MoELayer
from mode.parallel.all_to_all import all_to_all, exchange_counts
from mode.parallel.mesh import ParallelContext
from mode.routed import recomputing


class ExpertParallelDispatcher(Dispatcher):
    """``(x_sorted [M, D], counts [E], local experts) -> y_sorted [M, D]`` across the ep group.

    Counts are exchanged first (an all-to-all of [P, E_l]), then tokens with an uneven
    all-to-all; received rows are regrouped by local expert for one grouped GEMM, then sent
    back the same way. ``stats`` accumulates the rows and bytes sent to other ranks.
    """

    def __init__(self, group: dist.ProcessGroup, n_experts: int) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if n_experts % self.size:
            raise ValueError(f"n_experts={n_experts} is not divisible by the ep group size {self.size}")
        self.local_experts = n_experts // self.size
        self.stats = {"calls": 0, "rows_sent": 0, "bytes_sent": 0}

    def __call__(self, x_sorted: torch.Tensor, counts: torch.Tensor, experts: ExpertMLP) -> torch.Tensor:
        P, El = self.size, self.local_experts
        counts_pe = counts.view(P, El)
        recv_counts = exchange_counts(counts_pe, self.group)  # [P, E_l]: from rank p for my expert e
        send_splits = counts_pe.sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()
        rows = x_sorted.shape[0]
        # NOTE: a static-size dispatch (no-op experts) has scratch rows past every expert's:
        # they stay here (the splits are host values already) and come back as zeros.
        x_sorted = x_sorted[: sum(send_splits)]
        x_recv = all_to_all(x_sorted, send_splits, recv_splits, self.group)  # [R, D] by (source, expert)
        # Regroup (source, expert) -> (expert, source) for the grouped GEMM, and back after it.
        expert_of_row = torch.repeat_interleave(
            torch.arange(El, device=x_sorted.device).repeat(P), recv_counts.view(-1)
        )
        order = torch.sort(expert_of_row, stable=True).indices
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        y_local = experts(x_recv.index_select(0, order), recv_counts.sum(0))
        y_recv = y_local.index_select(0, inverse)
        self._count(send_splits, recv_splits, x_sorted)
        y_sorted = all_to_all(y_recv, recv_splits, send_splits, self.group)
        return torch.nn.functional.pad(y_sorted, (0, 0, 0, rows - y_sorted.shape[0]))

    def _count(self, send_splits: list[int], recv_splits: list[int], x: torch.Tensor) -> None:
        if recomputing():
            return  # activation checkpointing re-sends the same rows: count them once
        remote = sum(s for p, s in enumerate(send_splits) if p != self.rank)
        remote_back = sum(s for p, s in enumerate(recv_splits) if p != self.rank)
        row_bytes = x.shape[-1] * x.element_size()
        self.stats["calls"] += 1
        self.stats["rows_sent"] += remote + remote_back
        self.stats["bytes_sent"] += (remote + remote_back) * row_bytes


def moe_layers(model: nn.Module) -> list[MoELayer]:
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The sharded expert weights (not shared experts, which are replicated)."""
    return [p for m in moe_layers(model) for p in m.experts.parameters()]


@torch.no_grad()
def parallelize(model: nn.Module, ctx: ParallelContext) -> nn.Module:
    """Shard every MoE layer's experts over the ep group and attach the all-to-all dispatcher.
    The model must hold the full (identically initialised) weights on every rank."""
    if ctx.ep_size == 1:
        return model
    for layer in moe_layers(model):
        if isinstance(layer, CapacityMoE):
            raise ValueError("expert parallelism supports DroplessMoE layers; CapacityMoE is a single-device baseline")
        dispatcher = ExpertParallelDispatcher(ctx.ep_group, layer.n_experts)
        lo = dispatcher.rank * dispatcher.local_experts
        hi = lo + dispatcher.local_experts
        for name, p in list(layer.experts.named_parameters(recurse=False)):
            if p.shape[0] != layer.n_experts:
                raise ValueError(f"expert weight {name} has {p.shape[0]} experts, expected {layer.n_experts}")
            setattr(layer.experts, name, nn.Parameter(p[lo:hi].clone()))
        layer.dispatcher = dispatcher
    return model


def dispatch_stats(model: nn.Module) -> dict[str, int]:
    """Rows and bytes this rank sent to other ranks, summed over layers, since the last reset."""
    total = {"calls": 0, "rows_sent": 0, "bytes_sent": 0}
    for layer in moe_layers(model):
        stats = getattr(layer.dispatcher, "stats", None)
        if stats:
            for k in total:
                total[k] += stats[k]
    return total


def reset_dispatch_stats(model: nn.Module) -> None:
    for layer in moe_layers(model):
        stats = getattr(layer.dispatcher, "stats", None)
        if stats:
            for k in stats:
                stats[k] = 0


def set_balance_group(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """The ranks whose micro-batches form the global batch of every MoE layer's balance loss
    with ``lb_scope="global_batch"`` (None: this rank's tokens alone)."""
    for layer in moe_layers(model):
        layer.balance_group = group
