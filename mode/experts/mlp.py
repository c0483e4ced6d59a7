"""Expert MLP weights and their two entry points.

Legend: N tokens, M assignments (token rows in expert order), D model dim, F expert hidden
dim, E experts.

- ``forward_sorted(x_sorted [M, D], counts [E]) -> [M, D]``: rows already sorted by expert,
  computed with a grouped GEMM backend (``loop``, ``torch``, ``megablocks``).
- ``forward_scattered(x [N, D], counts, token_idx [M], weights [M], slots [M], top_k) -> [N, D]``:
  tokens in their own order plus the dispatch; the gather and the weighted combine are fused
  into the expert loop (backend ``chunked``) or into the GEMMs' loads and stores (backend
  ``triton``, ``mode.kernels.scatter_gemm``).

Each backend declares which one it implements (its ``grouped_gemm.GEMM_BACKENDS`` row's ``entry``);
``uses_scattered`` says which one this layer's backend resolves to for an input.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import nn

from mode.checks import check_choice, check_int, check_positive
from mode.experts.chunked import chunked_experts, expert_activation
from mode.experts.grouped_gemm import backend as gemm_backend
from mode.experts.grouped_gemm import get_backend, resolve_name

MlpKind = Literal["gelu", "swiglu"]
MLP_KINDS: tuple[str, ...] = get_args(MlpKind)


def mlp_flops(n: int, d: int, d_ff: int, kind: MlpKind = "gelu") -> int:
    """Forward FLOPs of a 2-layer MLP (4 n D F) or SwiGLU (6 n D F) on n tokens."""
    return (6 if kind == "swiglu" else 4) * n * d * d_ff


class ExpertMLP(nn.Module):
    """E independent MLPs: GELU (``w1 [E, D, F]``, ``w2 [E, F, D]``) or SwiGLU (``w1`` and
    ``w3 [E, D, F]`` gate/up, ``w2`` down). ``forward`` is ``forward_sorted``."""

    def __init__(self, n_experts: int, d_model: int, d_ff: int, mlp: MlpKind = "gelu", backend: str = "auto") -> None:
        super().__init__()
        check_choice("mlp", mlp, MLP_KINDS)
        for name, value in (("n_experts", n_experts), ("d_model", d_model), ("d_ff", d_ff)):
            check_int(name, value)
            check_positive(name, value)
        self.mlp = mlp
        self.backend = backend
        self.active_fraction = 1.0  # share of these weights a token uses (set by the MoE layer)
        self.w1 = nn.Parameter(torch.empty(n_experts, d_model, d_ff))
        self.w2 = nn.Parameter(torch.empty(n_experts, d_ff, d_model))
        self.w3 = nn.Parameter(torch.empty(n_experts, d_model, d_ff)) if mlp == "swiglu" else None
        for w in (self.w1, self.w2, self.w3):
            if w is not None:
                nn.init.normal_(w, std=0.02)

    def extra_repr(self) -> str:
        E, D, F = self.w1.shape
        return f"experts={E}, d_model={D}, d_ff={F}, mlp={self.mlp!r}, backend={self.backend!r}"

    def active_share(self) -> float:
        """Share of the expert weights an average token touches (for active-parameter counts)."""
        return self.active_fraction

    def uses_scattered(self, x: torch.Tensor, rows: int | None = None) -> bool:
        """Whether the backend for ``x`` ([N, D]) and ``rows`` expert assignments implements
        ``forward_scattered`` (``auto`` decides by size, see ``grouped_gemm.resolve_name``).
        Under ``torch.compile`` the sorted path is used instead: its shapes do not depend on
        the routing."""
        d_model, d_ff = self.w1.shape[1:]
        # NOTE: decided at the dtype the experts compute in, as forward_scattered decides: under
        # bf16 autocast on CUDA, x's own float32 once sent the MoE to the chunked CPU path.
        name = resolve_name(self.backend, x.device, self.compute_dtype(x), d_model, d_ff, rows)
        return gemm_backend(name).entry == "scattered" and not torch.compiler.is_compiling()

    def compute_dtype(self, x: torch.Tensor) -> torch.dtype:
        """The dtype the experts compute in for input x: autocast's when autocast is on for x's
        device (bf16 under ``train.precision=bf16``), else x's own."""
        device = x.device.type
        return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype

    def _in_compute_dtype(self, x: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """x, w1, w2, w3 in the dtype the experts compute in: autocast's (bf16 under
        ``train.precision=bf16``) when autocast is on for x's device, else x's own. The grouped
        GEMM ops are not autocast-aware, so the cast happens here, as autocast does for linears."""
        dtype = self.compute_dtype(x)
        return tuple(None if t is None else t.to(dtype) for t in (x, self.w1, self.w2, self.w3))

    def forward_sorted(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [M, D] rows sorted by expert, counts [E] rows per expert -> [M, D] (grouped GEMMs;
        a ``scattered`` backend uses its grouped fallback here)."""
        x, w1, w2, w3 = self._in_compute_dtype(x)
        d_model, d_ff = w1.shape[1:]
        gmm = get_backend(self.backend, x.device, x.dtype, d_model, d_ff)
        with torch.autocast(x.device.type, enabled=False):
            h = gmm(x, w1, counts)
            h = expert_activation(h, gmm(x, w3, counts) if w3 is not None else None)
            return gmm(h, w2, counts)

    forward = forward_sorted

    def forward_scattered(
        self,
        x: torch.Tensor,
        counts: torch.Tensor,
        token_idx: torch.Tensor,
        weights: torch.Tensor,
        slots: torch.Tensor,
        top_k: int,
    ) -> torch.Tensor:
        """x [N, D] in token order; token_idx, weights, slots [M] each assignment's token,
        combine weight and flat index ``n * top_k + j`` in the [N, top_k] assignment table,
        grouped by expert; counts [E] -> ``out[n] = sum of weights[m] * expert_m(x[n])`` over
        n's assignments ([N, D]): gather and combine fused in."""
        x, w1, w2, w3 = self._in_compute_dtype(x)
        d_model, d_ff = w1.shape[1:]
        if resolve_name(self.backend, x.device, x.dtype, d_model, d_ff, token_idx.numel()) != "triton":
            return chunked_experts(x, token_idx, counts, weights.to(x.dtype), w1, w2, w3)
        from mode.experts.scattered import gemm_combine, scattered_gemm  # noqa: PLC0415  (imports triton)

        with torch.autocast(x.device.type, enabled=False):
            h = scattered_gemm(x, w1, token_idx, slots, counts, top_k)
            h3 = scattered_gemm(x, w3, token_idx, slots, counts, top_k) if w3 is not None else None
            return gemm_combine(expert_activation(h, h3), w2, weights, token_idx, slots, counts, top_k, x.shape[0])

    def forward_padded(self, x: torch.Tensor) -> torch.Tensor:
        """x: [E, C, D] padded per-expert buffers -> [E, C, D] with batched matmuls."""
        h = torch.bmm(x, self.w1)
        h = expert_activation(h, torch.bmm(x, self.w3) if self.w3 is not None else None)
        return torch.bmm(h, self.w2)
