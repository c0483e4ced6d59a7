"""One evaluation loop, shared by training's validation (``mode.train.evaluate``) and
``mode-eval`` (``mode.eval.evaluate_split``): they differ only in which windows they read.

- ``sampled_windows(split, batch_size, n_batches)``: ``n_batches`` batches of windows drawn
  from a generator seeded 0 (the same windows for every model and every evaluation);
- ``consecutive_windows(tokens, seq_len, batch_size, max_batches)``: every token predicted
  once, in consecutive ``seq_len`` windows (the last partial window left out);
- ``evaluate_batches(model, batches, routing, *, ctx, precision)``: the mean cross-entropy per
  token over the batches (each batch weighted by its tokens; under ``ctx`` each rank reads its
  rows of every batch and the loss is averaged over ranks), the tokens predicted, and each
  scalar routing metric's mean over the batches.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from mode.data import TokenSplit
from mode.parallel.mesh import ONE_PROCESS, ParallelContext, mean_over_ranks
from mode.precision import autocast
from mode.routed import routing_metrics

__all__ = ["Evaluation", "consecutive_windows", "evaluate_batches", "rank_rows", "sampled_windows"]

Batch = tuple[torch.Tensor, torch.Tensor]  # x, y: [B, T] int64, y = x shifted by one


def rank_rows(batch_size: int, ctx: ParallelContext = ONE_PROCESS) -> slice:
    """This rank's rows of a global batch of ``batch_size`` rows (all of them in one process)."""
    rank, world = ctx.rank, ctx.world_size
    return slice(rank * batch_size // world, (rank + 1) * batch_size // world)


def sampled_windows(split: TokenSplit, batch_size: int, n_batches: int) -> Iterator[Batch]:
    gen = torch.Generator().manual_seed(0)
    for _ in range(n_batches):
        yield split.batch(batch_size, gen)


def consecutive_windows(tokens, seq_len: int, batch_size: int, max_batches: int = 0) -> Iterator[Batch]:
    """``tokens``: a 1-D id array; ``max_batches > 0`` stops early. ``ValueError`` when it
    holds no whole window."""
    n_windows = (len(tokens) - 1) // seq_len
    if n_windows < 1:
        raise ValueError(f"the validation split has {len(tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}")
    for i, first in enumerate(range(0, n_windows, batch_size)):
        if max_batches and i >= max_batches:
            return
        rows = range(first, min(first + batch_size, n_windows))
        window = [np.asarray(tokens[r * seq_len : r * seq_len + seq_len + 1], dtype=np.int64) for r in rows]
        xy = torch.from_numpy(np.stack(window))
        yield xy[:, :-1], xy[:, 1:]


@dataclass
class Evaluation:
    loss: float  # mean cross-entropy, nats per token
    tokens: int  # tokens predicted
    metrics: dict[str, float]  # each scalar routing metric's mean over the batches


@torch.no_grad()
def evaluate_batches(
    model: nn.Module,
    batches: Iterable[Batch],
    routing: str = "topk",
    *,
    ctx: ParallelContext = ONE_PROCESS,
    precision: str = "fp32",
) -> Evaluation:
    """``model`` (in eval mode for the loop, then as it was) on ``batches``; see the module docstring."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count, sums, n_batches = 0.0, 0, {}, 0
    try:
        for x, y in batches:
            rows = rank_rows(x.shape[0], ctx)
            with autocast(precision, device):
                _, loss = model(x[rows].to(device), y[rows].to(device), routing=routing)
            n = y.numel()
            total, count, n_batches = total + mean_over_ranks(loss.item(), ctx) * n, count + n, n_batches + 1
            for key, value in routing_metrics(model).items():
                if isinstance(value, float | int):
                    sums[key] = sums.get(key, 0.0) + value
    finally:
        model.train(was_training)
    if not n_batches:
        raise ValueError("evaluation needs at least one batch")
    return Evaluation(total / count, count, {k: v / n_batches for k, v in sums.items()})
