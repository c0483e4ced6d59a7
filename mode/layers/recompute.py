"""Activation checkpointing of whole blocks (``train.activation_checkpoint``).

A checkpointed block keeps only its input for the backward pass and re-runs its forward
there (``torch.utils.checkpoint``, non-reentrant). Routed modules compute exactly the same
values in that re-run (same inputs, same RNG state, routing state moves only after the
optimizer step) and skip their state updates (``mode.routed.recomputing``), so a
checkpointed step equals an ordinary one.
"""

from __future__ import annotations

from typing import Literal, get_args

from torch import nn
from torch.utils.checkpoint import checkpoint

from mode.routed import recompute_scope

ActivationCheckpoint = Literal["none", "full", "every_n"]
ACTIVATION_CHECKPOINTS: tuple[str, ...] = get_args(ActivationCheckpoint)


def checkpoint_module(module: nn.Module) -> None:
    """Make ``module``'s forward checkpointed, in place (its parameter names do not change)."""
    forward = module.forward

    def checkpointed(*args, **kwargs):
        runs = 0

        def run(*a, **kw):
            nonlocal runs
            runs += 1
            if runs == 1:
                return forward(*a, **kw)
            with recompute_scope():
                return forward(*a, **kw)

        return checkpoint(run, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed


def checkpoint_blocks(blocks: nn.ModuleList, mode: ActivationCheckpoint, every: int = 2) -> int:
    """Checkpoint every block (``full``), every ``every``-th one starting with the first
    (``every_n``) or none; returns how many were checkpointed."""
    if mode == "none":
        return 0
    chosen = [b for i, b in enumerate(blocks) if mode == "full" or i % every == 0]
    for block in chosen:
        checkpoint_module(block)
    return len(chosen)
