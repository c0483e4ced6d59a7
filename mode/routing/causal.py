"""Causal routing decisions for sampling.

Top-k over a sequence looks at later tokens, so at sampling time a token decides alone:
it is routed when a per-token logit is > 0. That logit is either the MoD router's own score,
trained with ``membership_bce`` toward the top-k decision ("router_bce"), or the output of a
predictor that sees only detached inputs: the router score minus the top-k threshold of the
tokens so far, plus a small MLP on ``x.detach()`` trained the same way ("predictor",
``mode.layers.predictor``).

Legend: B batch, T tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def membership_bce(logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy with logits toward top-k membership: logits, chosen: [B, T]."""
    return F.binary_cross_entropy_with_logits(logits.float(), chosen.to(torch.float32))


def causal_decisions(logits: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: a token is routed when its logit is > 0."""
    return logits > 0


@torch.no_grad()
def decision_metrics(logits: torch.Tensor, chosen: torch.Tensor) -> dict[str, torch.Tensor]:
    """Agreement of the causal decisions with the top-k labels ([B, T] each).

    accuracy: share of tokens decided like top-k; recall: share of top-k tokens routed;
    precision: share of routed tokens that top-k chose; causal_share: share routed.
    """
    routed = causal_decisions(logits)
    chosen = chosen.bool()
    tp = (routed & chosen).sum().float()
    return {
        "accuracy": (routed == chosen).float().mean(),
        "recall": tp / chosen.sum().clamp_min(1),
        "precision": tp / routed.sum().clamp_min(1),
        "causal_share": routed.float().mean(),
    }
