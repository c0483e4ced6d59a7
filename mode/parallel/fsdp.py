"""FSDP2 over the ("dp", "ep") mesh: torchtitan's dp2ep layout.

- Non-expert parameters are ``fully_shard``ed over all ``dp * ep`` ranks (a flat mesh): each
  rank holds 1 / world of every such weight and its optimizer state.
- Expert weights are first split over "ep" (``expert_parallel.parallelize``: rank e holds
  experts ``e * E_l .. (e + 1) * E_l - 1``), then ``fully_shard``ed over "dp" along their
  hidden dimension (``Shard(1)``, so that ``E_l < dp`` still shards evenly enough). Their
  gradients hold the sum over the ep group's tokens: FSDP averages them over dp and
  ``scale_expert_grads`` divides them by ``ep`` after the backward, so they are averaged
  over the world like every other gradient. (FSDP2's own ``set_gradient_divide_factor``
  needs a PREMUL_SUM reduction, which gloo lacks.)
- Each block is one FSDP unit (its weights gathered before its forward and freed after).
  With ``precision="bf16"`` it is gathered and computed in bf16
  (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``), except for a second,
  float32 unit per block: its routers, routing predictor and LayerNorms, so that router
  scores come from float32 weights and the norms see float32 parameters (CPU autocast runs
  ``layer_norm`` in the input's dtype and refuses bf16 weights on a float32 input). The
  embedding, final norm and LM head form the root unit (float32; autocast casts the head's
  matmul).

NOTE: FSDP2 replaced DDP + a hand-written expert all-reduce: one mechanism for every layout,
sharded optimizer state, and sharded checkpoints through ``torch.distributed.checkpoint``.
Inputs are not cast by FSDP (``cast_forward_inputs=False``): the residual stream stays
float32 and autocast does the casts, exactly as in a single process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from mode.parallel.expert_parallel import expert_parameters, moe_layers
from mode.parallel.mesh import ParallelContext
from mode.routed import keeps_float32


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """The blocks' policy: bf16 gathers and compute with fp32 gradient reduction, or fp32."""
    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    return MixedPrecisionPolicy(cast_forward_inputs=False)


def float32_modules(module: nn.Module) -> list[nn.Module]:
    """The modules of a block kept in float32: ``Router`` projections, routing predictors,
    LayerNorms."""
    return [m for m in module.modules() if keeps_float32(m)]


def shard_model(model: nn.Module, ctx: ParallelContext, precision: str = "fp32") -> nn.Module:
    """Apply the dp2ep FSDP2 layout to a model whose experts ``parallelize`` already split
    over "ep" (call it first). ``model.blocks`` are the units; ``model`` becomes the root."""
    fp32, blocks_policy = mixed_precision("fp32"), mixed_precision(precision)
    world = ctx.world_mesh
    for block in model.blocks:
        if ctx.ep_size > 1:
            for layer in moe_layers(block):
                fully_shard(
                    layer.experts,
                    mesh=ctx.mesh["dp"],
                    mp_policy=blocks_policy,
                    shard_placement_fn=lambda p: Shard(1),
                )
        small = float32_modules(block)
        if small:
            # One unit for all of them (a MoD router runs twice per forward: scores of every
            # token, then of the chosen ones), kept gathered from first use to the backward.
            fully_shard(small, mesh=world, mp_policy=fp32, reshard_after_forward=False)
        fully_shard(block, mesh=world, mp_policy=blocks_policy)
    fully_shard(model, mesh=world, mp_policy=fp32)
    return model


@torch.no_grad()
def scale_expert_grads(model: nn.Module, ctx: ParallelContext) -> None:
    """Divide the expert gradients by ``ep`` after the last backward of a step (see above)."""
    if ctx.ep_size == 1:
        return
    for p in expert_parameters(model):
        if p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            g.div_(ctx.ep_size)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Reduce gradients in this backward (the last micro-batch of a step) or only accumulate
    them locally (the others). A no-op for a model that FSDP does not shard."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


def clip_grad_norm(model: nn.Module, max_norm: float, ctx: ParallelContext) -> torch.Tensor:
    """Clip every gradient by the global norm (float32) and return the norm before clipping.

    Under FSDP2 each rank holds a disjoint piece of every gradient (the non-expert ones split
    over the world, the experts over ep and then dp), so the squared norm is the sum over
    the world of each rank's local sums: one all-reduce."""
    if not ctx.distributed:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    local = [
        p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters() if p.grad is not None
    ]
    sq = torch.zeros((), dtype=torch.float32, device=ctx.device)
    for g in local:
        sq += g.float().pow(2).sum()
    dist.all_reduce(sq)
    norm = sq.sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in local:
        g.mul_(scale.to(g.dtype))
    return norm
