"""Per-layer key/value cache holding only the tokens that went through the layer.

Legend: B batch rows, H heads, L cached entries, Dh head dim. Keys are stored after RoPE
(at the tokens' original positions), so a routed layer's cache is a packed list of its
routed tokens; each row has its own length, and memory grows with what is stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PredictorState:
    """The routing predictor's decode state: the threshold of the rounded prefix ``length``
    (it changes only when the prefix reaches the next multiple of the predictor's stride)."""

    length: int = -1
    threshold: torch.Tensor | None = None


class KVCache:
    """k, v: [B, H, capacity, Dh] (capacity doubles as needed); lengths: [B] entries per row."""

    def __init__(self, batch: int, n_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.k = torch.empty(batch, n_heads, 0, head_dim, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        # Router scores of every token the layer has seen, routed or not: [B, capacity], the
        # first n_scores valid (the routing predictor's prefix; empty unless a predictor records
        # them), and the predictor's threshold derived from them.
        self.scores = torch.empty(batch, 0, dtype=torch.float32, device=device)
        self.n_scores = 0
        self.predictor_state = PredictorState()

    def _reserve(self, needed: int) -> None:
        self.k, self.v = _grown(self.k, 2, needed), _grown(self.v, 2, needed)

    def fill(self, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        """Store a prefill's keys/values k, v: [B, H, T, Dh]; only tokens with ``keep`` ([B, T]) if given."""
        B, H, T, Dh = k.shape
        if self.lengths.any() or self.n_scores:
            # NOTE: a forward pass attends only within its own tokens, so a second prefill into
            # a filled cache would leave its tokens blind to the first: refuse it.
            raise ValueError(
                "this KV cache already holds tokens: a causal forward fills fresh caches "
                "(model.new_caches) and decode continues from them one token at a time"
            )
        if keep is None:
            keep = torch.ones(B, T, dtype=torch.bool, device=k.device)
        counts = keep.sum(dim=1)
        self._reserve(int((self.lengths + counts).max()) if B else 0)
        for b in range(B):
            idx = keep[b].nonzero().squeeze(-1)
            start = int(self.lengths[b])
            self.k[b, :, start : start + idx.numel()] = k[b, :, idx]
            self.v[b, :, start : start + idx.numel()] = v[b, :, idx]
        self.lengths += counts

    def append(self, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append one entry to each of ``rows`` ([b]); k, v: [b, H, 1, Dh]."""
        self._reserve(int(self.lengths[rows].max()) + 1)
        pos = self.lengths[rows]
        self.k[rows, :, pos] = k[:, :, 0]
        self.v[rows, :, pos] = v[:, :, 0]
        self.lengths[rows] += 1

    def record_scores(self, scores: torch.Tensor) -> None:
        """Append router scores [B, T] of every row's next T tokens (routed or not)."""
        T = scores.shape[1]
        self.scores = _grown(self.scores, 1, self.n_scores + T)
        self.scores[:, self.n_scores : self.n_scores + T] = scores.detach()
        self.n_scores += T

    def scores_seen(self) -> torch.Tensor:
        """[B, n] router scores of the n tokens recorded so far per row."""
        return self.scores[:, : self.n_scores]

    def view(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys, values [b, H, L, Dh] of ``rows`` (sorted, distinct) and the valid-entry mask
        [b, 1, 1, L]. With every row (a dense layer, or a routed one where all rows route)
        they are views of the cache; a subset of rows is gathered (a copy)."""
        lengths = self.lengths[rows]
        L = int(lengths.max())
        mask = torch.arange(L, device=lengths.device) < lengths[:, None]
        if rows.numel() == self.k.shape[0]:  # sorted and distinct: all rows, in order
            return self.k[:, :, :L], self.v[:, :, :L], mask[:, None, None, :]
        return self.k[rows, :, :L], self.v[rows, :, :L], mask[:, None, None, :]

    def entries(self) -> int:
        """Number of cached tokens summed over rows."""
        return int(self.lengths.sum())

    def nbytes_used(self) -> int:
        """Bytes of the stored keys and values (entries x heads x head dim x 2 x element size)
        plus the recorded router scores (4 bytes per token and row, when a predictor keeps them)."""
        B, H, _, Dh = self.k.shape
        kv = self.entries() * H * Dh * 2 * self.k.element_size()
        return kv + self.scores_seen().numel() * self.scores.element_size()


def _grown(t: torch.Tensor, dim: int, needed: int) -> torch.Tensor:
    """``t`` with room for ``needed`` entries along ``dim`` (capacity doubles, at least 16);
    the new entries are zero."""
    capacity = t.shape[dim]
    if needed <= capacity:
        return t
    shape = list(t.shape)
    shape[dim] = max(needed, 2 * capacity, 16) - capacity
    return torch.cat([t, t.new_zeros(shape)], dim=dim)
