"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP).

Expert shards are saved as DTensors placed ``[Replicate() over dp, Shard(0) over ep]``, so a
checkpoint written with one ``ep_size`` loads into another (1 included, in a plain single
process). Replicated parameters are plain tensors, written once. Writes are atomic: the
checkpoint is written to ``<dir>.tmp`` and renamed over ``<dir>`` only when every rank is done,
so a crash mid-save leaves the last good checkpoint in place.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from mode.parallel.expert_parallel import expert_parameters
from mode.parallel.mesh import ParallelContext


def sharded_state_dict(model: nn.Module, ctx: ParallelContext | None) -> dict[str, torch.Tensor]:
    """The model's state dict with expert shards wrapped as DTensors of the global shape."""
    state = model.state_dict()
    if ctx is None or ctx.ep_size == 1:
        return state
    expert_ids = {id(p) for p in expert_parameters(model)}
    names = {n for n, p in model.named_parameters() if id(p) in expert_ids}
    return {
        k: DTensor.from_local(v, ctx.mesh, [Replicate(), Shard(0)], run_check=False) if k in names else v
        for k, v in state.items()
    }


def save(
    path: str | Path,
    model: nn.Module,
    ctx: ParallelContext | None,
    extra: dict | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> None:
    """Save the model (sharded), per-rank optimizer state and ``extra`` (rank 0) atomically."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0 and tmp.exists():
        shutil.rmtree(tmp)
    _barrier()
    dcp.save(sharded_state_dict(model, ctx), checkpoint_id=str(tmp))
    if optimizer is not None:
        torch.save(optimizer.state_dict(), tmp / f"optimizer_rank{rank}.pt")
    if rank == 0 and extra is not None:
        torch.save(extra, tmp / "extra.pt")
    _barrier()
    if rank == 0:
        old = path.with_name(path.name + ".old")
        if path.exists():
            path.replace(old)
        tmp.replace(path)
        if old.exists():
            shutil.rmtree(old)
    _barrier()


def load(
    path: str | Path, model: nn.Module, ctx: ParallelContext | None, optimizer: torch.optim.Optimizer | None = None
) -> dict:
    """Load a checkpoint saved by ``save`` into ``model`` on any ep layout; returns ``extra``.
    The optimizer state is per rank, so it loads only on the layout it was saved with."""
    path = Path(path)
    state = sharded_state_dict(model, ctx)
    dcp.load(state, checkpoint_id=str(path))
    local = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in state.items()}
    model.load_state_dict(local)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(path / f"optimizer_rank{rank}.pt", weights_only=False))
    extra = path / "extra.pt"
    return torch.load(extra, weights_only=False) if extra.exists() else {}


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
