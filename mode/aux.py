"""Auxiliary losses and routing metrics that routed modules keep from their last forward.

A routed module's ``forward`` returns a plain tensor, so it drops into any model; its
auxiliary losses (already multiplied by their coefficients) and metrics sit on the module
until the next forward. ``aux_loss(model)`` and ``routing_metrics(model)`` collect them.
This module is a leaf: it imports nothing of ours.
"""

from __future__ import annotations

import torch
from torch import nn


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


def aux_loss(model: nn.Module) -> torch.Tensor:
    """Sum of every routed module's weighted auxiliary losses from its last forward (a 0-dim
    tensor; zero when there are none)."""
    terms = [v for m in model.modules() if isinstance(m, Routed) for v in m.aux_losses.values()]
    if not terms:
        p = next(model.parameters(), None)
        return torch.zeros((), device=p.device if p is not None else "cpu")
    return torch.stack([t.float() for t in terms]).sum()


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
