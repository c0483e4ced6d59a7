"""One optimizer step and its pieces: the learning-rate schedule, AdamW, the objective.

``train_step`` is the whole step that ``mode.train`` runs, usable from a user's own loop:
micro-batches (gradient accumulation), autocast, backward, cross-rank syncs of routing
state, clipping, the skip of non-finite steps, the optimizer, the post-step hooks.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from mode.compile import compiled_piece
from mode.config import TrainConfig
from mode.model import MoDETransformer
from mode.parallel.fsdp import clip_grad_norm, scale_expert_grads, set_gradient_sync
from mode.parallel.mesh import ONE_PROCESS, ParallelContext, min_over_ranks_, sum_over_ranks
from mode.precision import autocast
from mode.routed import after_optimizer_step, aux_loss, metrics_scope, step_records


def lr_at(step: int, cfg: TrainConfig, elapsed: float = 0.0) -> float:
    """Linear warm-up to ``lr`` then cosine decay to ``min_lr`` at ``steps``, or at
    ``max_seconds`` of wall-clock when that comes first (time-budgeted runs decay too)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    if cfg.max_seconds:
        progress = max(progress, min(1.0, elapsed / cfg.max_seconds))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def fused_optimizer_supported(device: torch.device | str) -> bool:
    """Whether this torch has a fused AdamW kernel for ``device`` (one kernel for every
    parameter instead of a dozen foreach ops, and a device-side ``found_inf`` skip)."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices  # noqa: PLC0415

    return torch.device(device).type in _get_fused_kernels_supported_devices()


def use_fused_optimizer(setting: str, device: torch.device | str) -> bool:
    """``train.fused_optimizer`` resolved: "auto" is fused where supported (CUDA, and the CPU
    in torch >= 2.4); "true" insists (an error where unsupported); "false" is foreach AdamW."""
    setting = str(setting).lower()
    if setting == "auto":
        return fused_optimizer_supported(device)
    if setting == "true" and not fused_optimizer_supported(device):
        raise ValueError(f"train.fused_optimizer=true: this torch has no fused AdamW on {device}; use auto or false")
    return setting == "true"


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not norms, biases or 1-D parameters), fused
    where ``cfg.fused_optimizer`` says (default: wherever this torch has the kernel)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    device = params[0].device if params else torch.device("cpu")
    fused = use_fused_optimizer(cfg.fused_optimizer, device)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=fused, foreach=None if fused else True)


class LMObjective(torch.nn.Module):
    """``(x, y) -> (LM loss, auxiliary loss)`` of ``model`` on a batch: the LM loss and every
    routed module's weighted auxiliary losses from that forward (``mode.aux_loss``)."""

    def __init__(self, model: MoDETransformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _, loss = self.model(x, y)
        return loss, aux_loss(self.model)


class StepResult(NamedTuple):
    """What ``train_step`` did: the LM loss, the auxiliary loss (means over the
    micro-batches), the gradient norm before clipping, and whether the step was skipped for a
    non-finite loss or gradient. All are 0-dim tensors on the model's device, so that the
    step never waits for the device: read them (``float()``, ``bool()``) only when needed."""

    loss: torch.Tensor
    aux: torch.Tensor
    grad_norm: torch.Tensor
    skipped: torch.Tensor


class NonFiniteTrainingError(RuntimeError):
    """``train.max_bad_steps`` consecutive steps had a non-finite loss or gradient."""


def finite_step(loss: torch.Tensor, aux: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
    """1.0 where the step's loss, auxiliary loss and gradient norm (0-dim each) are all
    finite, else 0.0: one test for all three, as a sum of finite float32 values is finite
    (short of 3e38)."""
    return torch.isfinite(loss + aux + grad_norm).float()


def step_flags(finite: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``finite_step``'s flag (after the ranks agreed) -> (ok, skipped) bools and the fused
    optimizer's ``found_inf`` (1.0 skips the update), all 0-dim on the device."""
    ok = finite.bool()
    return ok, ~ok, 1.0 - finite


def _skips_on_device(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt.step()`` honours a ``found_inf`` tensor (fused Adam/AdamW/SGD: the kernel
    leaves weights, moments and step count as they were where it is 1)."""
    return bool(getattr(opt, "_step_supports_amp_scaling", False)) and all(g.get("fused") for g in opt.param_groups)


def train_step(
    model: MoDETransformer,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    grad_clip: float = 0.0,
    *,
    ctx: ParallelContext = ONE_PROCESS,
    objective: torch.nn.Module | None = None,
    precision: str = "fp32",
    accum_steps: int = 1,
    metrics: bool = True,
) -> StepResult:
    """One optimizer step on a batch: x, y [B, T] token ids (this rank's rows) -> ``StepResult``.

    The batch is split into ``accum_steps`` micro-batches of ``B / accum_steps`` rows; each
    runs forward (through ``objective``, default ``LMObjective(model)``) under the autocast of
    ``precision`` ("fp32" or "bf16") and backward on ``(LM loss + auxiliary loss) /
    accum_steps``, so the gradients equal those of one batch of B rows for losses that are
    means over sequences or tokens. Under FSDP (``ctx``: the ranks, ``ONE_PROCESS`` by
    default) gradients are reduced only on the last micro-batch. Then: routing state recorded
    by the forwards is summed over the ranks, gradients are clipped by their global norm when
    ``grad_clip`` > 0, the optimizer steps, and the modules' ``after_optimizer_step`` hooks
    move the routing state once.

    A step whose loss or gradient norm is not finite (on any rank) is skipped: gradients and
    the recorded routing state are dropped, the weights and optimizer state are left as they
    were, and the result says ``skipped``. With a fused optimizer (``build_optimizer``'s
    default) the skip is decided on the device (the optimizer's ``found_inf``), so the step
    reads nothing on the host; other optimizers read one flag. ``metrics=False`` skips the
    routing metrics (``mode.routing_metrics``) in this step's forwards: the training loop
    computes them only on the steps it logs.
    """
    objective = objective or LMObjective(model)
    if x.shape[0] % accum_steps:
        raise ValueError(f"a batch of {x.shape[0]} rows does not split into accum_steps={accum_steps} micro-batches")
    micro = x.shape[0] // accum_steps
    losses, auxes = [], []
    for i in range(accum_steps):
        set_gradient_sync(model, i == accum_steps - 1)
        rows = slice(i * micro, (i + 1) * micro) if accum_steps > 1 else slice(None)
        with autocast(precision, x.device), metrics_scope(metrics):
            loss, aux = objective(x[rows], y[rows])
        total = loss + aux
        (total / accum_steps if accum_steps > 1 else total).backward()
        losses.append(loss.detach().float())
        auxes.append(aux.detach().float())
    if accum_steps == 1:
        loss, aux = losses[0], auxes[0]
    else:
        loss, aux = torch.stack(losses).mean(), torch.stack(auxes).mean()
    scale_expert_grads(model, ctx)
    grad_norm = clip_grad_norm(model, grad_clip or math.inf, ctx)
    finite = compiled_piece(finite_step, model)(loss, aux, grad_norm)
    min_over_ranks_(finite, ctx)  # every rank skips the same steps
    ok, skipped, found_inf = compiled_piece(step_flags, model)(finite)
    if _skips_on_device(opt):
        opt.found_inf = found_inf  # the fused kernel skips the whole update where it is 1
        try:
            opt.step()
        finally:
            del opt.found_inf
    elif ok.item():  # one host read: this optimizer cannot skip on the device
        opt.step()
    opt.zero_grad(set_to_none=True)
    sum_over_ranks(step_records(model), ctx)  # every replica moves its routing state alike
    compiled_piece(after_optimizer_step, model)(model, ok)
    return StepResult(loss, aux, grad_norm, skipped)
