"""Checkpoints: one ``save`` / ``load`` for single-process and expert-parallel runs.

Two on-disk kinds, chosen by the run, read by the same ``load``:

- single process: one file (``ckpt.pt``, ``torch.save`` of model, optimizer, progress and
  config), readable with plain ``torch.load`` and memory-mapped by ``checkpoint_config``;
- under a process group: a ``torch.distributed.checkpoint`` (DCP) directory (``ckpt/``) of
  the FSDP2-sharded model and optimizer state (``{"model": ..., "optim": {param name:
  AdamW state}}``), each rank writing its shards. Expert weights (and their optimizer
  state) are saved as DTensors of the global shape ``[E, ...]`` placed ``[Shard(1) over dp,
  Shard(0) over ep]``, every other tensor as FSDP shards it, so a checkpoint loads into any
  other ``dp`` x ``ep`` layout, and into a plain single process (model and optimizer);
  progress + config sit in ``extra.pt``.

NOTE: two kinds rather than DCP for both: a single-process user gets one portable file
that ``torch.load`` reads without a process group, DCP's planner or a directory layout.

Both are atomic: written under a temporary name, flushed to disk (fsync), then renamed over
the last good checkpoint, so a crash mid-save leaves that one in place. Progress is the
step, the elapsed training time (the ``max_seconds`` budget's clock), and the torch and data
RNG states; routing state (aux-loss-free biases, predictor thresholds) is in the model's
buffers.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from mode.config import Config, from_dict, to_dict
from mode.parallel.expert_parallel import expert_parameters
from mode.parallel.mesh import ParallelContext


class Progress(NamedTuple):
    """Where a run stands: optimizer steps taken and training seconds spent."""

    step: int
    elapsed: float = 0.0


def save(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    progress: Progress | None = None,
    cfg: Config | None = None,
    data_rng: torch.Generator | None = None,
    ctx: ParallelContext | None = None,
    keep: int = 1,
) -> None:
    """Save model, optimizer, progress, RNG states and config atomically: one file when
    ``ctx`` is None, else a DCP directory written by every rank of ``ctx``. With ``keep`` > 1
    the checkpoint it replaces stays as ``<path>.step<N>`` and the ``keep - 1`` newest of those
    are kept."""
    progress = progress or Progress(0)
    extra = {
        "step": progress.step,
        "elapsed": progress.elapsed,
        "rng": torch.get_rng_state(),
        "data_rng": data_rng.get_state() if data_rng is not None else None,
    }
    if cfg is not None:
        extra["config"] = to_dict(cfg)
    if ctx is not None:
        save_sharded(path, model, ctx, extra, optimizer, keep)
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict() if optimizer else None, **extra}
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    if keep > 1 and path.exists():
        os.link(path, _history_name(path))  # the old file stays reachable under its step
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    _prune_history(path, keep)


def load(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    data_rng: torch.Generator | None = None,
    ctx: ParallelContext | None = None,
) -> Progress:
    """Restore model (and optimizer, RNG states) from either kind; returns the progress.

    A DCP directory loads on any ``dp`` x ``ep`` layout, and into a single process (``ctx``
    None), model and optimizer; the optimizer must be an AdamW over ``model``'s parameters.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    if path.is_dir():
        return _restore(load_sharded(path, model, ctx, optimizer), data_rng)
    state = torch.load(path, map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    return _restore(state, data_rng)


def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    data_rng: torch.Generator | None = None,
) -> int:
    """``load`` in this process; returns the step to continue from."""
    return load(path, model, optimizer, data_rng).step


def checkpoint_config(path: str | Path) -> Config:
    """The config a checkpoint was trained with (a ``ckpt.pt`` file or a ``ckpt/`` directory)."""
    path = Path(path)
    state = _progress_state(path)
    if "config" not in state:
        raise ValueError(f"{path} holds no training config (it was not written by mode.train)")
    return from_dict(state["config"])


def _restore(state: dict, data_rng: torch.Generator | None) -> Progress:
    """Restore the RNG states a checkpoint kept (a DCP one written outside mode.train may keep
    none) and return its progress (elapsed 0 for checkpoints written before it was saved)."""
    if state.get("rng") is not None:
        torch.set_rng_state(state["rng"])
    if data_rng is not None and state.get("data_rng") is not None:
        data_rng.set_state(state["data_rng"])
    return Progress(int(state["step"]), float(state.get("elapsed", 0.0)))


def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (POSIX; a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- the DCP directory kind ------------------------------------------------------------------
def _global_view(t: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """An expert tensor of this rank (its ep slice ``[E_l, ...]``, FSDP-sharded over dp along
    dim 1) as a DTensor of the global ``[E, ...]`` over the (dp, ep) mesh, sharing storage."""
    local = t.to_local() if isinstance(t, DTensor) else t
    shape = (t.shape[0] * ctx.ep_size, *t.shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, ctx.mesh, [Shard(1), Shard(0)], run_check=False, shape=shape, stride=stride)


def _expert_names(model: nn.Module, ctx: ParallelContext | None) -> set[str]:
    if ctx is None or ctx.ep_size == 1:
        return set()  # experts are whole on every rank (or FSDP-sharded like any weight)
    ids = {id(p) for p in expert_parameters(model)}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def sharded_state_dict(model: nn.Module, ctx: ParallelContext | None) -> dict[str, torch.Tensor]:
    """The model's state dict (FSDP2: DTensor shards) with expert shards as global DTensors;
    its tensors share storage with the model, so ``dcp.load`` into it loads the model."""
    experts = _expert_names(model, ctx)
    return {k: _global_view(v, ctx) if k in experts else v for k, v in model.state_dict().items()}


def optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, ctx: ParallelContext | None
) -> dict[str, dict[str, torch.Tensor]]:
    """``{parameter name: AdamW state}`` (tensors shared with the optimizer; expert state as
    global DTensors). A parameter without state yet gets AdamW's initial one (step 0, zero
    moments), so that a fresh optimizer has tensors for ``dcp.load`` to fill."""
    names = {id(p): n for n, p in model.named_parameters()}
    experts = _expert_names(model, ctx)
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not optimizer.state.get(p):
                zeros = torch.zeros_like(p, memory_format=torch.preserve_format)
                optimizer.state[p] = {"step": torch.zeros(()), "exp_avg": zeros, "exp_avg_sq": zeros.clone()}
            name = names[id(p)]
            out[name] = {
                k: _global_view(v, ctx) if name in experts and v.dim() else v for k, v in optimizer.state[p].items()
            }
    return out


def _dcp_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, ctx: ParallelContext | None) -> dict:
    """What a DCP checkpoint holds, as tensors sharing storage with the model and optimizer:
    ``dcp.save`` writes them, ``dcp.load`` fills them in place."""
    state = {"model": sharded_state_dict(model, ctx)}
    if optimizer is not None:
        state["optim"] = optimizer_state_dict(model, optimizer, ctx)
    return state


def save_sharded(
    path: str | Path,
    model: nn.Module,
    ctx: ParallelContext | None,
    extra: dict | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    keep: int = 1,
) -> None:
    """Save the model and optimizer state (sharded) and ``extra`` (rank 0) atomically
    (``keep``: see ``save``)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0 and tmp.exists():
        shutil.rmtree(tmp)
    _barrier()
    dcp.save(_dcp_state(model, optimizer, ctx), checkpoint_id=str(tmp))
    if rank == 0 and extra is not None:
        torch.save(extra, tmp / "extra.pt")
    _barrier()
    if rank == 0:
        for f in tmp.iterdir():
            with open(f, "rb") as handle:
                os.fsync(handle.fileno())
        # The last good checkpoint is moved aside (kept under its step when keep > 1), never
        # deleted before the new one is in place: a kill between the two renames leaves it.
        old = None
        if path.exists():
            old = _history_name(path) if keep > 1 else path.with_name(path.name + ".old")
            path.replace(old)
        tmp.replace(path)
        _fsync_dir(path.parent)
        if old is not None and keep == 1:
            shutil.rmtree(old)
        _prune_history(path, keep)
    _barrier()


def load_sharded(
    path: str | Path, model: nn.Module, ctx: ParallelContext | None, optimizer: torch.optim.Optimizer | None = None
) -> dict:
    """Load a checkpoint saved by ``save_sharded`` into ``model`` (and ``optimizer``) on any
    dp x ep layout, in place; returns ``extra``."""
    path = Path(path)
    dcp.load(_dcp_state(model, optimizer, ctx), checkpoint_id=str(path))
    extra = path / "extra.pt"
    return torch.load(extra, weights_only=False) if extra.exists() else {}


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def latest(path: str | Path) -> Path | None:
    """The checkpoint to resume from at ``path``: ``path`` itself, or, when a save was killed
    between moving the last good directory aside and renaming the new one in, that
    ``<path>.old`` directory or the newest ``<path>.step<N>``; None when there is none."""
    path = Path(path)
    if path.exists():
        return path
    old = path.with_name(path.name + ".old")
    if old.is_dir():
        return old
    history = _history(path)
    return history[-1] if history else None


def _progress_state(path: Path) -> dict:
    """The step, progress and config a checkpoint of either kind keeps (a ``ckpt.pt``'s whole
    state, memory-mapped so that its tensors are not read; a directory's ``extra.pt``)."""
    file = path / "extra.pt" if path.is_dir() else path
    return torch.load(file, map_location="cpu", weights_only=False, mmap=True)


def _history_name(path: Path) -> Path:
    return path.with_name(f"{path.name}.step{int(_progress_state(path)['step'])}")


def _history(path: Path) -> list[Path]:
    """Older checkpoints kept beside ``path`` (``<name>.step<N>``), oldest first."""
    found = []
    for p in path.parent.glob(path.name + ".step*"):
        suffix = p.name[len(path.name) + len(".step") :]
        if suffix.isdigit():
            found.append((int(suffix), p))
    return [p for _, p in sorted(found)]


def _prune_history(path: Path, keep: int) -> None:
    history = _history(path)
    for old in history[: max(0, len(history) - (keep - 1))]:
        shutil.rmtree(old) if old.is_dir() else old.unlink()
