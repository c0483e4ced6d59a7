"""Which device a run computes on (``train.device``, ``mode-eval --device``, the demo)."""

from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    """``train.device`` resolved: "auto" is the first CUDA device when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
