"""Autograd all-to-all with uneven splits (backward = the reverse all-to-all).

Legend: P ranks in the group, R rows received, S rows sent, D feature dim.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def exchange_counts(send_counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """send_counts: [P, C] int64 (row p goes to rank p) -> [P, C] (row p came from rank p)."""
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv.view(-1), send_counts.contiguous().view(-1), group=group)
    return recv


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_splits: list[int], recv_splits: list[int], group):
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        out = x.new_empty(sum(recv_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad_in = grad_out.new_empty(sum(ctx.send_splits), *grad_out.shape[1:])
        dist.all_to_all_single(grad_in, grad_out.contiguous(), ctx.send_splits, ctx.recv_splits, group=ctx.group)
        return grad_in, None, None, None


def all_to_all(
    x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """x: [S, ...] with ``send_splits[p]`` rows for rank p -> [R, ...] with ``recv_splits[p]``
    rows from rank p. Differentiable: the gradient takes the reverse route."""
    return _AllToAll.apply(x, send_splits, recv_splits, group)
