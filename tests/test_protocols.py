"""The hooks the package asks modules for are declared protocols (``mode.protocols``), and the
modules that carry the state satisfy them; a module that does not is never called."""

from __future__ import annotations

import torch
from torch import nn

import mode
from mode.experts.mlp import ExpertMLP
from mode.layers.arch import RMSNorm
from mode.layers.predictor import RoutingPredictor
from mode.protocols import ActiveShare, KeepsFloat32, RoutingState
from mode.routed import Router, after_optimizer_step, keeps_float32, step_records


def test_the_stateful_routing_modules_satisfy_the_routing_state_protocol():
    assert isinstance(mode.DroplessMoE(16, 32, 4, bias_rate=0.01), RoutingState)
    assert isinstance(RoutingPredictor(16, 0.25, 8), RoutingState)
    assert not isinstance(mode.DenseBlock(16, 2), RoutingState)
    assert isinstance(ExpertMLP(4, 16, 32), ActiveShare)
    assert all(isinstance(m, KeepsFloat32) for m in (Router(16, 4), RMSNorm(16), RoutingPredictor(16, 0.25, 8)))


def test_a_module_with_half_the_protocol_is_not_asked():
    """``step_records`` alone is not the protocol: the step hooks ask only modules with both."""
    calls = []

    class Half(nn.Module):
        def step_records(self) -> list[torch.Tensor]:
            calls.append("records")
            return [torch.ones(1)]

    class Whole(Half):
        def after_optimizer_step(self, apply=True) -> None:
            calls.append(("after", apply))

    model = nn.Sequential(Half(), Whole())
    assert [t.tolist() for t in step_records(model)] == [[1.0]]
    after_optimizer_step(model, apply=False)
    assert calls == ["records", ("after", False)]
    assert keeps_float32(nn.LayerNorm(4)) and not keeps_float32(nn.Linear(4, 4))
