"""The auxiliary routing predictor of a MoD block (causal sampling, "predictor" method).

Top-k keeps a token when its router score is above the k-th largest score of its sequence,
a threshold that depends on later tokens. The predictor replaces it by one that does not: the
same order statistic over the tokens seen so far (the prefix), shrunk toward a running mean of
the k-th score over training batches while the prefix is short, plus a small MLP on the token
that learns, by BCE toward top-k membership, where that threshold is wrong.

Legend: B batch, T tokens (a sequence from its first token), D model dim, c capacity.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mode.checks import check_range
from mode.layers.kv_cache import PredictorState
from mode.routed import recomputing
from mode.routing.mod_topk import capacity_to_k, capacity_to_k_tensor


class RoutingPredictor(nn.Module):
    """Predicts from a token and the tokens before it whether top-k routing would choose it.

    ``logit_t = (score_t - threshold_t) + mlp(x_t)``, routed when ``logit_t > 0``, with

    - ``score``: the MoD router's logit of each token (detached);
    - ``threshold_t = (prior_tokens * running + L * q_L) / (prior_tokens + L)``, where ``L`` is
      the number of tokens up to t rounded down to a multiple of ``stride`` and ``q_L`` the
      ``max(1, floor(c * L))``-th largest score among the first ``L`` tokens of the row: the
      top-k rule applied to the prefix. ``running`` (buffer ``threshold``) is the mean
      per-sequence k-th score over training steps (``update_threshold``), the prior for short
      prefixes. ``stride`` bounds the cost: T / stride top-k calls over at most T scores;
    - ``mlp``: one SiLU hidden layer on ``x.detach()``, output starting near zero.

    Nothing here sends gradient to the trunk or the router. In decoding, the prefix is the
    row's scores kept by the KV cache (``KVCache.record_scores``), so a decoded token decides
    exactly as in a full causal forward over the same sequence.

    NOTE: the MLP alone (the MoD paper's predictor) has to relearn the router's moving linear
    score; a fixed threshold on the score cannot follow sequences whose k-th score sits high or
    low; the prefix order statistic can (benchmarks/RESULTS.md, "Causal sampling").
    The running threshold moves in ``after_optimizer_step`` (call it after each optimizer step
    in your own loop, or ``mode.after_optimizer_step(model)``); under data parallelism
    ``mode.train_step`` first sums the recorded k-th scores over the ranks
    (``step_records``, ``mode.routed.step_records``), so all replicas agree.
    """

    keeps_float32 = True  # FSDP2 keeps it out of a block's bf16 gathers (``mode.routed.keeps_float32``)

    def __init__(
        self,
        d_model: int,
        capacity: float,
        hidden: int = 64,
        momentum: float = 0.01,
        prior_tokens: int = 32,
        stride: int = 16,
    ) -> None:
        super().__init__()
        if not 0.0 < momentum <= 1.0:
            raise ValueError(f"momentum={momentum!r} is invalid: must be in (0, 1]")
        check_range("capacity", capacity, 0.0, 1.0)
        if prior_tokens < 0 or stride < 1:
            raise ValueError(f"prior_tokens={prior_tokens} must be >= 0 and stride={stride} >= 1")
        self.capacity, self.momentum, self.prior_tokens, self.stride = capacity, momentum, prior_tokens, stride
        self.fc = nn.Linear(d_model, hidden)
        self.out = nn.Linear(hidden, 1)
        nn.init.normal_(self.out.weight, std=0.02)  # as MoDETransformer's init: starts near 0
        nn.init.zeros_(self.out.bias)
        self.register_buffer("threshold", torch.zeros(()))
        self.register_buffer("calibrated", torch.zeros((), dtype=torch.bool))
        # k-th scores seen since the last optimizer step: [sum, count] (float32, not saved)
        self.register_buffer("pending", torch.zeros(2), persistent=False)

    def _apply(self, fn, recurse: bool = True):
        # NOTE: the running threshold stays float32 when the module is cast (``.to(bfloat16)``,
        # ``.half()``): in bf16 an EMA step of 1% of the gap rounds away near |threshold| ~ 10.
        threshold, pending = self.threshold, self.pending
        super()._apply(fn, recurse)
        self.threshold = threshold.to(self.threshold.device)
        self.pending = pending.to(self.pending.device)
        return self

    def extra_repr(self) -> str:
        return f"capacity={self.capacity}, stride={self.stride}, prior_tokens={self.prior_tokens}"

    def correction(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., D] -> the MLP's term of the logit [...] (float32)."""
        return self.out(F.silu(self.fc(x.detach()))).squeeze(-1).float()

    def _prefix_threshold(self, scores: torch.Tensor, length: int) -> torch.Tensor:
        """Threshold of a token whose rounded prefix is the first ``length`` of ``scores`` [B, n] -> [B]."""
        if length == 0:
            return self.threshold.expand(scores.shape[0])
        return self._kth_of_prefixes(scores, range(length, length + 1))[:, 0]

    def thresholds(self, scores: torch.Tensor) -> torch.Tensor:
        """scores: [B, T] of a sequence from its first token -> causal thresholds [B, T].

        Token t uses the prefix of length L = ((t + 1) // stride) * stride (so tokens
        start-1 .. start+stride-2 share L = start, and the last token sees all T when T is a
        multiple of ``stride``). All prefixes' k-th largest scores come from one batched
        ``topk`` over ``[B, prefixes, L_max]`` with the positions past each prefix masked to
        -inf (chunked to bound memory), not a loop of one ``topk`` per prefix: one launch
        instead of T / stride of them, the difference between a host-bound and a device-bound
        training step on a GPU."""
        s = scores.detach().float()
        B, T = s.shape
        n_prefixes = T // self.stride + 1  # lengths 0, stride, 2 * stride, ... <= T
        per_prefix = [self.threshold.expand(B).unsqueeze(-1)]  # length 0: the running threshold
        chunk = max(1, self.MAX_TOPK_ELEMENTS // max(1, B * T))
        for first in range(1, n_prefixes, chunk):
            lengths = range(first * self.stride, min(first + chunk, n_prefixes) * self.stride, self.stride)
            per_prefix.append(self._kth_of_prefixes(s, lengths))
        prefix_of_token = torch.div(torch.arange(1, T + 1, device=s.device), self.stride, rounding_mode="floor")
        return torch.cat(per_prefix, dim=1).index_select(1, prefix_of_token)

    MAX_TOPK_ELEMENTS = 1 << 24  # [B, prefixes, L] elements per batched top-k (64 MiB in float32)

    def _kth_of_prefixes(self, s: torch.Tensor, lengths: range) -> torch.Tensor:
        """s: [B, T] -> [B, len(lengths)]: the threshold of each prefix length L > 0,
        ``(prior_tokens * running + L * q) / (prior_tokens + L)`` with q the k-th largest of the
        first L scores, k = max(1, capacity_to_k(capacity, L))."""
        width = lengths[-1]
        positions = torch.arange(width, device=s.device)
        ends = torch.arange(lengths.start, lengths.stop, lengths.step, device=s.device)
        masked = s[:, None, :width].masked_fill(positions >= ends[:, None], -torch.inf)  # [B, P, width]
        # k grows with the length, so the longest prefix's k bounds them all.
        top = masked.topk(max(1, capacity_to_k(self.capacity, width)), dim=-1).values  # descending
        k = capacity_to_k_tensor(self.capacity, ends).clamp(min=1)
        q = top.gather(-1, (k - 1).view(1, -1, 1).expand(s.shape[0], -1, 1)).squeeze(-1)
        return (self.prior_tokens * self.threshold + ends * q) / (self.prior_tokens + ends)

    def forward(self, x: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """x: [B, T, D], scores: [B, T] router logits of a sequence from its first token ->
        decision logits [B, T] (float32)."""
        return scores.detach().float() - self.thresholds(scores) + self.correction(x)

    def decode_logits(
        self, x: torch.Tensor, history: torch.Tensor, state: PredictorState | None = None
    ) -> torch.Tensor:
        """One new token per row: x [B, 1, D], history [B, n] the row's scores so far with this
        token's last -> [B, 1], equal to ``forward`` on the whole sequence at its last position.
        ``state`` (``KVCache.predictor_state``) keeps the threshold between tokens: it changes
        only when the prefix length reaches the next multiple of ``stride``."""
        s = history.detach().float()
        length = s.shape[1] // self.stride * self.stride
        if state is not None and state.length == length and state.threshold is not None:
            threshold = state.threshold
        else:
            threshold = self._prefix_threshold(s, length)
            if state is not None:
                state.length, state.threshold = length, threshold
        return (s[:, -1] - threshold).unsqueeze(-1) + self.correction(x)

    @torch.no_grad()
    def update_threshold(self, scores: torch.Tensor, chosen: torch.Tensor) -> None:
        """Record this batch's per-sequence k-th largest scores; ``after_optimizer_step`` moves
        the running threshold toward their mean, once per step whatever the number of
        micro-batches (and ``mode.parallel`` sums ``pending`` over the ranks first).

        scores: [B, T] router logits, chosen: [B, T] bool top-k membership with the same
        k >= 1 tokens in every row.
        """
        if recomputing():
            return
        kth = torch.where(chosen, scores.float(), torch.inf).amin(dim=-1)  # [B]
        # NOTE: the count is filled on the device (``torch.tensor(n, device=...)`` is a host copy: a sync).
        self.pending += torch.stack([kth.sum(), torch.full((), float(kth.numel()), device=kth.device)])

    def step_records(self) -> list[torch.Tensor]:
        """``pending``: the sum of the recorded k-th scores and their count since the last step."""
        return [self.pending]

    @torch.no_grad()
    def after_optimizer_step(self, apply: bool | torch.Tensor = True) -> None:
        """Move the running threshold toward the mean recorded k-th score (EMA with
        ``momentum``; the first update sets it) and clear the record (only clear it when
        ``apply`` is False; a 0-dim bool tensor decides on the device)."""
        if apply is not False:  # on the device throughout: no host read of ``pending`` or ``apply``
            recorded = (self.pending[1] > 0) & torch.as_tensor(apply, device=self.pending.device)
            batch_kth = self.pending[0] / self.pending[1].clamp_min(1)
            ema = torch.lerp(self.threshold, batch_kth, self.momentum)
            moved = torch.where(self.calibrated, ema, batch_kth)
            self.threshold.copy_(torch.where(recorded, moved, self.threshold))
            self.calibrated.logical_or_(recorded)
        self.pending.zero_()
