"""The auxiliary routing predictor of a MoD block (causal sampling, "predictor" method).

Top-k keeps a token when its router score is above the k-th largest score of its sequence,
a threshold that depends on later tokens. The predictor replaces that threshold by one that
does not: a running mean of the k-th score over training batches, plus a small MLP on the
token that learns, by BCE toward top-k membership, where the fixed threshold is wrong.

Legend: B batch, T tokens, D model dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RoutingPredictor(nn.Module):
    """Predicts from one token alone whether top-k routing would choose it.

    ``logit = (score - threshold) + mlp(x)``, routed when ``logit > 0``, where ``score`` is the
    MoD router's logit for the token, ``threshold`` a buffer tracking the mean per-sequence
    k-th largest score (``update_threshold``, called in training steps with top-k routing),
    and ``mlp`` a one-hidden-layer SiLU MLP whose output starts near zero. Both inputs
    are detached, so training the predictor never changes the trunk or the router.

    NOTE: the MLP alone (the MoD paper's predictor) has to learn the router's own linear
    score, a moving target, from scratch; on the compare.py ``mod`` model a fixed threshold on
    the router score decides like top-k on 98% of tokens where the MLP alone reached 95-97%
    (benchmarks/RESULTS.md, "Causal sampling").

    Under DDP with ``broadcast_buffers=False`` each rank keeps its own running threshold (they
    agree to the noise of their batches); the checkpoint holds rank 0's.
    """

    def __init__(self, d_model: int, hidden: int = 64, momentum: float = 0.01) -> None:
        super().__init__()
        if not 0.0 < momentum <= 1.0:
            raise ValueError(f"momentum={momentum!r} is invalid: must be in (0, 1]")
        self.momentum = momentum
        self.fc = nn.Linear(d_model, hidden)
        self.out = nn.Linear(hidden, 1)
        nn.init.normal_(self.out.weight, std=0.02)  # as MoDETransformer's init: starts near 0
        nn.init.zeros_(self.out.bias)
        self.register_buffer("threshold", torch.zeros(()))
        self.register_buffer("calibrated", torch.zeros((), dtype=torch.bool))

    def _apply(self, fn, recurse: bool = True):
        # NOTE: the running threshold stays float32 when the module is cast (``.to(bfloat16)``,
        # ``.half()``): in bf16 an EMA step of 1% of the gap rounds away near |threshold| ~ 10.
        threshold = self.threshold
        super()._apply(fn, recurse)
        self.threshold = threshold.to(self.threshold.device)
        return self

    def forward(self, x: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
        """x: [..., D], score: [...] router logits -> decision logits [...] (float32)."""
        correction = self.out(F.silu(self.fc(x.detach()))).squeeze(-1).float()
        return score.detach().float() - self.threshold + correction

    @torch.no_grad()
    def update_threshold(self, scores: torch.Tensor, chosen: torch.Tensor) -> None:
        """Move the threshold toward the mean k-th largest score of this batch.

        scores: [B, T] router logits, chosen: [B, T] bool top-k membership with the same
        k >= 1 tokens in every row. The first update sets the threshold.
        """
        batch_kth = torch.where(chosen, scores.float(), torch.inf).amin(dim=-1).mean()
        ema = torch.lerp(self.threshold, batch_kth, self.momentum)
        self.threshold.copy_(torch.where(self.calibrated, ema, batch_kth))
        self.calibrated.fill_(True)
