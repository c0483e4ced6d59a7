"""Early exit: the depth-saving control beside Mixture-of-Depths (CALM / depth-adaptive style).

Legend: B batch, T tokens, D model dim, V vocabulary, L blocks.

After block ``i`` (for ``min_layer <= i + 1 < L``) each token's exit head, the model's own
final norm + LM head on its state, gives a distribution over the next token; a token whose
largest probability reaches ``threshold`` exits there. Later blocks pass its state through
unchanged (their output for it is discarded) and later tokens still attend to it: its keys and
values in every later block are computed from that frozen state, so a KV cache holds the
same entries in a full forward and in token-by-token decoding (exact). The decision looks at
the token's own state only, so the model stays causal.

Training runs every block on every token (no exits) and adds the usual per-layer exit loss,
``loss_coef`` times the mean cross-entropy of the intermediate exit heads; exits happen in
evaluation and sampling (``model.eval()``), where ``threshold`` sets the compute share.
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass

import torch
import torch.nn.functional as F

from mode.checks import check_int, check_positive, check_range, fail, options_object
from mode.routed import Routed


@dataclass
class EarlyExitConfig:
    """Per-token early exit (``mode.layers.early_exit``): the depth-saving control for MoD; the
    one place these options are written and validated (``model.early_exit``; ``EarlyExit``
    takes one as ``opts`` or builds one from its keywords).

    enabled: exit heads after blocks ``min_layer .. n_layers - 1`` (dense layouts only).
    threshold: a token exits once its exit head's largest next-token probability reaches it
        (evaluation and sampling; training computes every block and the exit losses).
    loss_coef: weight of the mean intermediate exit cross-entropy added to the LM loss.
    min_layer: blocks every token runs before it may exit (below the model's ``n_layers``:
        ``check_depth``).

    ``field_prefix`` (not a field) is how errors name an option: ``model.early_exit.`` for a
    config, "" for ``EarlyExit``'s keyword arguments.
    """

    enabled: bool = False
    threshold: float = 0.9
    loss_coef: float = 1.0
    min_layer: int = 1
    field_prefix: InitVar[str] = "model.early_exit."

    def __post_init__(self, field_prefix: str) -> None:
        check_range(field_prefix + "threshold", self.threshold, 0.0, 1.0)
        check_positive(field_prefix + "loss_coef", self.loss_coef, allow_zero=True)
        check_int(field_prefix + "min_layer", self.min_layer)
        check_positive(field_prefix + "min_layer", self.min_layer)

    def check_depth(self, n_layers: int, field_prefix: str = "model.early_exit.") -> None:
        """``ConfigError`` unless a token can exit before the last of ``n_layers`` blocks."""
        if self.min_layer >= n_layers:
            fix = f"must be below n_layers={n_layers} (a token exits after that block)"
            fail(field_prefix + "min_layer", self.min_layer, fix)


class EarlyExit(Routed):
    """The exit rule and its losses (no parameters: the exit head is the model's LM head).

    ``metrics`` after an evaluation forward: ``compute_share`` (the share of block-token pairs
    computed, 1 = dense) and ``exit_share`` (tokens that exited before the last block); after a
    training forward with targets: ``exit_ce`` (mean intermediate exit cross-entropy).
    """

    def __init__(self, n_layers: int, opts: EarlyExitConfig | None = None, **options: object) -> None:
        super().__init__()
        keywords = opts is None  # errors name the keywords, else the config fields
        opts = options_object(EarlyExitConfig, opts, options, "early-exit", {"enabled": True})
        opts.check_depth(n_layers, field_prefix="" if keywords else "model.early_exit.")
        self.opts = opts
        self.n_layers, self.threshold = n_layers, opts.threshold
        self.loss_coef, self.min_layer = opts.loss_coef, opts.min_layer

    def extra_repr(self) -> str:
        return f"threshold={self.threshold}, loss_coef={self.loss_coef}, min_layer={self.min_layer}"

    def non_causal_reason(self) -> str | None:
        return None  # a token's exit depends on its own state only

    def can_exit_after(self, layer: int) -> bool:
        """Whether tokens may exit after block ``layer`` (0-based): not before ``min_layer``
        blocks ran, and never after the last (that is the ordinary output)."""
        return self.min_layer <= layer + 1 < self.n_layers

    def confident(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [..., V] -> [...] bool: the largest next-token probability reaches ``threshold``."""
        return torch.softmax(logits.float(), dim=-1).amax(dim=-1) >= self.threshold

    def record_exit_losses(self, layer_logits: list[torch.Tensor], targets: torch.Tensor) -> None:
        """Per-layer exit loss: ``loss_coef`` * the mean over intermediate heads of their
        cross-entropy (layer_logits: [B, T, V] each; targets: [B, T], -100 ignored)."""
        if not layer_logits:
            return
        flat = targets.reshape(-1)
        losses = [F.cross_entropy(lg.float().view(-1, lg.shape[-1]), flat) for lg in layer_logits]
        self.record_aux("exit_ce", torch.stack(losses).mean(), self.loss_coef)

    def record_compute(self, active_shares: list[torch.Tensor | float]) -> None:
        """active_shares: per block, the share of tokens it computed (1.0 before any exit)."""
        shares = torch.tensor([float(s) for s in active_shares])
        self.metrics["compute_share"] = shares.mean()
        self.metrics["exit_share"] = 1.0 - shares[-1]
