"""A model made what a training config asks for, in torchtitan's order (``parallelize_llama``):
experts split over "ep" and the balance group set, activation recompute, per-block compile,
FSDP2 over the (dp, ep) mesh. ``init_parallel`` makes the mesh from the torchrun environment."""

from __future__ import annotations

import os

import torch.distributed as dist

from mode.compile import compile_blocks, compile_enabled
from mode.config import Config
from mode.devices import resolve_device
from mode.layers.kinds import any_kind
from mode.layers.recompute import checkpoint_blocks
from mode.parallel.expert_parallel import parallelize, set_balance_group
from mode.parallel.fsdp import shard_model
from mode.parallel.mesh import ONE_PROCESS, ParallelContext, init_mesh


def init_parallel(cfg: Config) -> ParallelContext:
    """The ranks' ``ParallelContext`` when launched by torchrun (or asked for dp/ep > 1), else
    one process's, on ``train.device``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    p = cfg.parallel
    if world == 1 and p.dp_size * p.ep_size == 1:
        return ParallelContext(local_device=resolve_device(cfg.train.device))
    has_experts = any_kind(cfg.model.block_kinds(), "holds_experts")
    ctx = init_mesh(p.dp_size, p.ep_size, cfg.model.moe.n_experts if has_experts else None, timeout_s=p.timeout_s)
    if cfg.train.batch_size % ctx.world_size:
        raise ValueError(
            f"train.batch_size={cfg.train.batch_size} (the global batch) must be divisible by the world size "
            f"{ctx.world_size}"
        )
    return ctx


def parallelize_model(model, cfg: Config, ctx: ParallelContext = ONE_PROCESS, precision: str = "fp32"):
    """Make ``model`` (a ``MoDETransformer``, whole and identical on every rank) what
    ``cfg.train`` and ``ctx`` ask for: experts split over "ep" with every rank in the
    global-batch balance group, activation recompute (``train.activation_checkpoint``),
    per-block ``torch.compile`` (``train.compile``), FSDP2 (``mode.parallel.fsdp``). Build the
    optimizer after this; ``mode.checkpoint.load`` loads a checkpoint of any layout into it."""
    tc = cfg.train
    if ctx.distributed:
        parallelize(model, ctx)
        set_balance_group(model, dist.group.WORLD)  # every rank reads different rows
    checkpoint_blocks(model.blocks, tc.activation_checkpoint, tc.activation_checkpoint_every)
    if compile_enabled(tc.compile, next(model.parameters()).device):
        compile_blocks(model)
    if ctx.distributed:
        shard_model(model, ctx, precision)
    return model
