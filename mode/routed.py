"""Auxiliary losses and routing metrics that routed modules keep from their last forward.

A routed module's ``forward`` returns a plain tensor, so it drops into any model; its
auxiliary losses (already multiplied by their coefficients) and metrics sit on the module
until the next forward. ``aux_loss(model)`` and ``routing_metrics(model)`` collect them.
This module is a leaf: it imports nothing of ours.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from mode.protocols import KeepsFloat32, RoutingState

_recompute_depth = 0  # > 0 while activation checkpointing re-runs a block's forward


def router_projection(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` computed in at least float32, autocast or not: x [..., D], weight
    [R, D] -> [..., R]. Router scores decide top-k; a bf16 projection rounds them (about 700
    distinct values per 1,024 tokens) and turns near-ties into ties."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    with torch.autocast(x.device.type, enabled=False):
        return torch.nn.functional.linear(x.to(dtype), weight.to(dtype))


class Router(nn.Linear):
    """A router projection ``[..., D] -> [..., R]`` computed in at least float32
    (``router_projection``). A module (not a bare weight) so that FSDP2 can keep it in its own
    float32 unit while the rest of a block is gathered in bf16.

    ``bias`` (zero at init) adds one learned offset per output. For a MoD router (R = 1) it
    moves every token's score alike, so it never changes which tokens top-k picks, only the
    gate value ``g(r)`` (upcycling starts it where the gate is ~1). A state dict without it
    (written before it existed) loads with the offset 0."""

    keeps_float32 = True  # see ``keeps_float32``

    def __init__(self, d_model: int, n_out: int, bias: bool = False) -> None:
        super().__init__(d_model, n_out, bias=bias)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = router_projection(x, self.weight)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if self.bias is not None and prefix + "bias" not in state_dict:
            state_dict[prefix + "bias"] = torch.zeros_like(self.bias)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def recomputing() -> bool:
    """True while activation checkpointing re-runs a forward for the backward pass: routed
    modules then compute exactly what they computed before but update no state (running
    statistics, load counters), so a checkpointed step updates them once."""
    return _recompute_depth > 0


@contextlib.contextmanager
def recompute_scope() -> Iterator[None]:
    """Mark the forwards run inside as recomputations (see ``recomputing``)."""
    global _recompute_depth
    _recompute_depth += 1
    try:
        yield
    finally:
        _recompute_depth -= 1


_metrics_enabled = True


def measuring() -> bool:
    """Whether routed modules compute their metrics in this forward (``metrics_scope``).
    Always under ``torch.compile``: the flag would be a guard, and a compiled block would
    recompile on the first step that logs; in the graph the metrics are a few fused kernels
    (``benchmarks/step_launches.py --metrics`` counts them) and read nothing on the host."""
    return torch.compiler.is_compiling() or _metrics_enabled


@contextlib.contextmanager
def metrics_scope(enabled: bool) -> Iterator[None]:
    """Forwards inside compute routing metrics only when ``enabled``: the training loop turns
    them off on steps it does not log (each metric is a few small kernels per layer on a
    GPU). Auxiliary losses and the state a step updates are computed either way."""
    global _metrics_enabled
    previous, _metrics_enabled = _metrics_enabled, enabled
    try:
        yield
    finally:
        _metrics_enabled = previous


class Routed(nn.Module):
    """Base for modules that keep auxiliary losses and metrics of their last forward."""

    def __init__(self) -> None:
        super().__init__()
        self.aux_losses: dict[str, torch.Tensor] = {}
        self.metrics: dict[str, torch.Tensor | float] = {}

    def record_aux(self, name: str, value: torch.Tensor, coef: float) -> None:
        """Keep ``coef * value`` (skipped when coef is 0); the raw value goes to metrics."""
        self.metrics[name] = value.detach()
        if coef:
            self.aux_losses[name] = coef * value

    def clear_aux(self) -> None:
        self.aux_losses = {}
        self.metrics = {}

    def non_causal_reason(self) -> str | None:
        """The causal contract: None when this module's routing decision for a token depends
        only on that token and earlier ones (so ``routing="causal"`` and KV-cache decoding are
        exact), else why not and what to do instead. Every routed module must state it."""
        raise NotImplementedError(f"{type(self).__name__} does not state its causal contract")


def non_causal_layers(model: nn.Module) -> dict[str, str]:
    """``{module path: reason}`` of every routed module in ``model`` that cannot decide per token."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, Routed):
            reason = m.non_causal_reason()
            if reason is not None:
                out[name or type(m).__name__] = reason
    return out


def check_causal(model: nn.Module, what: str = "routing='causal'") -> None:
    """``ValueError`` naming each routed layer of ``model`` that cannot decide per token."""
    layers = non_causal_layers(model)
    if layers:
        lines = "; ".join(f"{name}: {reason}" for name, reason in layers.items())
        raise ValueError(f"{what} needs every routed layer to decide per token, and these cannot: {lines}")


def aux_loss(model: nn.Module) -> torch.Tensor:
    """Sum of every routed module's weighted auxiliary losses from its last forward (a 0-dim
    tensor; zero when there are none)."""
    terms = [v for m in model.modules() if isinstance(m, Routed) for v in m.aux_losses.values()]
    if not terms:
        p = next(model.parameters(), None)
        return torch.zeros((), device=p.device if p is not None else "cpu")
    return torch.stack([t.float() for t in terms]).sum()


def keeps_float32(module: nn.Module) -> bool:
    """Whether ``module``'s parameters stay float32 when a block is computed in bf16: routers
    and routing predictors and RMSNorms (a class attribute ``keeps_float32 = True``) and LayerNorms. FSDP2
    gives them a float32 unit of their own (``mode.parallel.fsdp``)."""
    return (isinstance(module, KeepsFloat32) and bool(module.keeps_float32)) or isinstance(module, nn.LayerNorm)


def step_records(model: nn.Module) -> list[torch.Tensor]:
    """The routing state to sum over data-parallel ranks before ``after_optimizer_step``: the
    tensors each module's ``step_records()`` returns (what its forwards recorded since the
    last step and its hook reads: an MoE layer's expert load, a predictor's k-th scores), in
    module order. They are sums, so the sum over ranks is the global batch's record and every
    replica then moves its state identically (``mode.parallel.mesh.sum_over_ranks``)."""
    out = []
    for m in model.modules():
        if isinstance(m, RoutingState) and m is not model:
            out.extend(m.step_records())
    return out


def after_optimizer_step(model: nn.Module, apply: bool | torch.Tensor = True) -> None:
    """Call every submodule's ``after_optimizer_step(apply)`` hook: the state that moves once
    per optimizer step from what the step's forwards recorded (aux-loss-free expert biases,
    the predictor's running threshold). Call it after ``optimizer.step()`` in your own
    training loop (``mode.train`` does); ``apply=False`` (a skipped step) discards the record.
    ``apply`` may be a 0-dim bool tensor on the device: the hooks then decide there, with no
    host read."""
    for m in model.modules():
        if isinstance(m, RoutingState) and m is not model:
            m.after_optimizer_step(apply)


def routing_metrics(model: nn.Module) -> dict[str, float | list[float]]:
    """Flat ``{"<module path>/<metric>": value}`` of every routed module's last-forward metrics."""
    out: dict[str, float | list[float]] = {}
    for name, m in model.named_modules():
        if not isinstance(m, Routed):
            continue
        for key, value in m.metrics.items():
            if isinstance(value, torch.Tensor):
                value = value.item() if value.numel() == 1 else value.float().tolist()
            out[f"{name}/{key}" if name else key] = value
    return out
