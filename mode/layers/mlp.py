"""The dense MLP of a transformer block (GELU, 4x by default)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """x: [..., D] -> [..., D] via a hidden layer of size d_ff with GELU."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, d_ff, bias=False)
        self.proj = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))
