"""``torch.compile`` per block (``train.compile``), as torchtitan does: each block is one
compiled region, so that a graph break inside one (the dropless MoE's data-dependent
expert sizes) does not split the whole model, and a model of N identical blocks compiles
one graph that the others reuse.
"""

from __future__ import annotations

from torch import nn


def compile_blocks(model: nn.Module) -> None:
    """Compile every block of ``model.blocks`` in place (``nn.Module.compile``: parameter
    names and state dicts do not change)."""
    for block in model.blocks:
        block.compile()
