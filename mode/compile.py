"""``torch.compile`` per block (``train.compile``), as torchtitan does: each block is one
compiled region, so that a graph break inside one (the dropless MoE's data-dependent
expert sizes) does not split the whole model, and a model of N identical blocks compiles
one graph that the others reuse.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

F = TypeVar("F", bound=Callable)


def compile_enabled(setting: str | bool, device: torch.device) -> bool:
    """``train.compile`` resolved: "true" / "false", or "auto": compile on CUDA (where the
    launches it saves are the cost), not on the CPU (where the first compile takes longer
    than a short run saves)."""
    setting = str(setting).lower()
    return setting == "true" or (setting == "auto" and device.type == "cuda")


# NOTE: random ops (random MoD routing, router jitter) draw from torch's own generator, as
# in eager mode, instead of inductor's: a compiled model trains as the eager one does.
COMPILE_OPTIONS = {"fallback_random": True}


def compile_block(block: nn.Module, fullgraph: bool = False, backend: str = "inductor") -> None:
    """Compile one block in place (``nn.Module.compile``: parameter names and state dicts do
    not change). With ``fullgraph`` a graph break raises instead of splitting the block:
    every block kind compiles whole with the default backends (``tests/test_compile.py``).
    ``backend`` another ``torch.compile`` backend (``aot_eager``: trace and autograd without
    code generation)."""
    block.compile(fullgraph=fullgraph, backend=backend, options=COMPILE_OPTIONS if backend == "inductor" else None)


def compile_blocks(model: nn.Module, fullgraph: bool = False, backend: str = "inductor") -> None:
    """Compile every block of ``model.blocks`` in place (``compile_block``), and mark the model
    so that the small pieces of its step outside the blocks (the token-id check, the step's
    finite test, the routing state's after-optimizer updates: ``compiled_piece``) run compiled
    with the same backend: on a GPU each is then one or two kernels instead of a dozen."""
    for block in model.blocks:
        compile_block(block, fullgraph, backend)
    model.compile_backend = backend


_PIECES: dict[tuple[Callable, str], Callable] = {}


def compiled_piece(fn: F, model: nn.Module) -> F:
    """``fn`` compiled whole (``fullgraph``) with the backend ``compile_blocks`` gave ``model``,
    or ``fn`` itself when the model is not compiled. One compiled function per (fn, backend),
    shared by every model: its guards tell models and shapes apart."""
    backend = getattr(model, "compile_backend", None)
    if backend is None:
        return fn
    key = (fn, backend)
    if key not in _PIECES:
        options = COMPILE_OPTIONS if backend == "inductor" else None
        _PIECES[key] = torch.compile(fn, fullgraph=True, backend=backend, options=options)
    return _PIECES[key]
