"""Expert MLP weights and their grouped computation.

Legend: M tokens in expert order, D model dim, F expert hidden dim, E experts.
"""

from __future__ import annotations

import torch
from torch import nn

from mode.experts.chunked import chunked_experts, expert_activation
from mode.experts.grouped_gemm import get_backend, resolve_name


class ExpertMLP(nn.Module):
    """E independent MLPs: GELU (``w1 [E, D, F]``, ``w2 [E, F, D]``) or SwiGLU (``w1`` and
    ``w3 [E, D, F]`` gate/up, ``w2`` down). ``forward(x [M, D], counts [E]) -> [M, D]`` with
    rows of ``x`` sorted by expert (grouped GEMMs), or in token order with the gather and the
    weighted combine fused in (see ``forward``)."""

    def __init__(self, n_experts: int, d_model: int, d_ff: int, mlp: str = "gelu", backend: str = "auto") -> None:
        super().__init__()
        if mlp not in ("gelu", "swiglu"):
            raise ValueError(f"mlp={mlp!r} is invalid: choose 'gelu' or 'swiglu'")
        if min(n_experts, d_model, d_ff) <= 0:
            raise ValueError(f"n_experts={n_experts}, d_model={d_model}, d_ff={d_ff} must all be > 0")
        self.mlp = mlp
        self.backend = backend
        self.active_fraction = 1.0  # share of these weights a token uses (set by the MoE layer)
        self.w1 = nn.Parameter(torch.empty(n_experts, d_model, d_ff))
        self.w2 = nn.Parameter(torch.empty(n_experts, d_ff, d_model))
        self.w3 = nn.Parameter(torch.empty(n_experts, d_model, d_ff)) if mlp == "swiglu" else None
        for w in (self.w1, self.w2, self.w3):
            if w is not None:
                nn.init.normal_(w, std=0.02)

    def active_share(self) -> float:
        """Share of the expert weights an average token touches (for active-parameter counts)."""
        return self.active_fraction

    @property
    def n_experts(self) -> int:
        return self.w1.shape[0]

    def runs_chunked(self, x: torch.Tensor, rows: int | None = None) -> bool:
        """Whether the backend for ``x`` ([N, D]) and ``rows`` expert assignments is ``chunked``
        (token order in and out, see ``forward``; ``auto`` decides by size, see
        ``grouped_gemm.resolve_name``). Under ``torch.compile`` the grouped path is used
        instead: its shapes do not depend on the routing."""
        d_model, d_ff = self.w1.shape[1:]
        chunked = resolve_name(self.backend, x.device, x.dtype, d_model, d_ff, rows) == "chunked"
        return chunked and not torch.compiler.is_compiling()

    def forward(
        self,
        x: torch.Tensor,
        counts: torch.Tensor,
        token_idx: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Grouped: x [M, D] rows sorted by expert, counts [E] -> [M, D].

        Token order (the ``chunked`` backend): with ``token_idx`` and ``weights`` ([M], grouped
        by expert), x is [N, D] in token order and the result is ``out[n] = sum of weights[m]
        * expert_m(x[n])`` ([N, D]): the gather and the weighted combine are fused in.
        """
        if token_idx is not None:
            if weights is None:
                raise ValueError("token-order experts need the combine weights with token_idx")
            return chunked_experts(x, token_idx, counts, weights.to(x.dtype), self.w1, self.w2, self.w3)
        d_model, d_ff = self.w1.shape[1:]
        gmm = get_backend(self.backend, x.device, x.dtype, d_model, d_ff)
        h = gmm(x, self.w1, counts)
        h = expert_activation(h, gmm(x, self.w3, counts) if self.w3 is not None else None)
        return gmm(h, self.w2, counts)

    def forward_padded(self, x: torch.Tensor) -> torch.Tensor:
        """x: [E, C, D] padded per-expert buffers -> [E, C, D] with batched matmuls."""
        h = torch.bmm(x, self.w1)
        h = expert_activation(h, torch.bmm(x, self.w3) if self.w3 is not None else None)
        return torch.bmm(h, self.w2)
