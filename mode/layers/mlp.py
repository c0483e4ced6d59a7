"""The dense MLP of a transformer block: GELU (exact or tanh) or SwiGLU, 4x wide by default."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mode.layers.arch import DEFAULT_ARCH, Arch


class MLP(nn.Module):
    """x: [..., D] -> [..., D]: ``proj(act(fc(x)))`` (GELU, exact or tanh), or SwiGLU's
    ``proj(silu(fc(x)) * up(x))``; hidden width d_ff."""

    def __init__(self, d_model: int, d_ff: int, arch: Arch = DEFAULT_ARCH) -> None:
        super().__init__()
        self.kind = arch.mlp
        self.fc = nn.Linear(d_model, d_ff, bias=arch.bias)
        self.up = nn.Linear(d_model, d_ff, bias=arch.bias) if arch.mlp == "swiglu" else None
        self.proj = nn.Linear(d_ff, d_model, bias=arch.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.up is not None:
            return self.proj(F.silu(h) * self.up(x))
        return self.proj(F.gelu(h, approximate="tanh" if self.kind == "gelu_tanh" else "none"))
