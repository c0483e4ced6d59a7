"""The hooks the package asks modules for, written down (as torchtitan keeps its protocols):
a module satisfies one by having its members (structural typing, ``isinstance`` checks them).

- ``RoutingState``: routing state that moves once per optimizer step from what the step's
  forwards recorded (``MoELayer``'s aux-loss-free bias, ``RoutingPredictor``'s threshold);
  ``mode.routed.step_records`` / ``after_optimizer_step`` call it.
- ``ActiveShare``: parameters only a share of the tokens touch on average (``ExpertMLP``);
  ``mode.flops.active_params`` reads it.
- ``KeepsFloat32``: a module whose parameters stay float32 under bf16 (routers, the routing
  predictor, RMSNorm); ``mode.routed.keeps_float32`` reads it.

This module is a leaf: it imports nothing of ours.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class RoutingState(Protocol):
    def step_records(self) -> list[torch.Tensor]:
        """What the forwards since the last step recorded (sums: the sum over data-parallel
        ranks is the global batch's record)."""
        ...

    def after_optimizer_step(self, apply: bool | torch.Tensor = True) -> None:
        """Move the state by the record and clear it (``apply=False``: only clear it; a 0-dim
        bool tensor decides on the device)."""
        ...


@runtime_checkable
class ActiveShare(Protocol):
    def active_share(self) -> float:
        """The share of this module's own parameters an average token touches."""
        ...


@runtime_checkable
class KeepsFloat32(Protocol):
    keeps_float32: bool
