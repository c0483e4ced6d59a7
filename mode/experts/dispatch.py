"""Dispatchers: where an MoE layer's experts run.

A dispatcher runs experts on assignments sorted by expert (``__call__(x_sorted [M, D],
counts [E], experts) -> [M, D]``, the entry point of expert-choice and capacity layers) and
the whole token-choice path (``token_choice(x [N, D], dispatch, weights [N, K], experts) ->
[N, D]``: gather, experts, weighted combine). ``LocalDispatcher`` keeps every expert on this
device and takes the experts' fused scattered entry point when their backend implements it;
``mode.parallel.expert_parallel.ExpertParallelDispatcher`` moves the sorted tokens over the ep
group with all-to-all.
"""

from __future__ import annotations

import torch

from mode.experts.mlp import ExpertMLP
from mode.experts.permute import Dispatch, combine, permute, sorted_weights


class Dispatcher:
    """Base: the token-choice path is gather -> ``self(...)`` on sorted rows -> combine."""

    def __call__(self, x_sorted: torch.Tensor, counts: torch.Tensor, experts: ExpertMLP) -> torch.Tensor:
        raise NotImplementedError

    def token_choice(
        self,
        x: torch.Tensor,
        dispatch: Dispatch,
        weights: torch.Tensor,
        experts: ExpertMLP,
        moves: str = "embedding_bag",
    ) -> torch.Tensor:
        y = self(permute(x, dispatch, moves), dispatch.counts, experts)
        return combine(y, dispatch, weights, moves)


class LocalDispatcher(Dispatcher):
    """All experts live on this device."""

    def __call__(self, x_sorted: torch.Tensor, counts: torch.Tensor, experts: ExpertMLP) -> torch.Tensor:
        return experts.forward_sorted(x_sorted, counts)

    def token_choice(
        self,
        x: torch.Tensor,
        dispatch: Dispatch,
        weights: torch.Tensor,
        experts: ExpertMLP,
        moves: str = "embedding_bag",
    ) -> torch.Tensor:
        if experts.uses_scattered(x, dispatch.token_idx.numel()):
            w = sorted_weights(weights, dispatch)
            top_k = weights.shape[1]
            return experts.forward_scattered(x, dispatch.counts, dispatch.token_idx, w, dispatch.order, top_k)
        return super().token_choice(x, dispatch, weights, experts, moves)

    def __repr__(self) -> str:
        return "LocalDispatcher()"
