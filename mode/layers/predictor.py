"""The auxiliary routing predictor of a MoD block (causal sampling, "predictor" method)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RoutingPredictor(nn.Module):
    """A small MLP that predicts, from one token alone, whether top-k routing would choose it.

    x: [..., D] -> logits [...]. Its input is detached: training it never changes the trunk.
    """

    def __init__(self, d_model: int, hidden: int = 64) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, hidden)
        self.out = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.silu(self.fc(x.detach()))).squeeze(-1)
