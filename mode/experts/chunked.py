"""Expert-by-expert MoE computation with the token gather and the weighted combine fused in.

The grouped-GEMM path materializes the tokens in expert order (``permute``: an [M, D]
buffer), runs the grouped GEMMs, then combines an [M, D] output buffer back to tokens. On a
CPU those full-size buffers cost more than the routing itself: each is a fresh allocation
(page faults) and another pass over memory. Here each expert gathers its own rows, runs its
MLP and adds its weighted output straight into ``out``; the per-expert temporaries are a few
MB, come from the allocator's free lists and stay in cache. The backward gathers each
expert's input rows from ``x`` again instead of keeping an [M, D] copy, so this path also
saves M*D activations. ``backend="auto"`` uses it on CPU once the [M, D] buffer it avoids
would reach ``grouped_gemm.CHUNKED_MIN_BYTES`` (below that, its per-expert loop of small ops
costs more than the buffers: benchmarks/bench_moe_auto.py).

Legend: N tokens, D model dim, F expert hidden dim, E experts, M dispatched assignments
(grouped by expert, as in ``Dispatch``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mode.experts.permute import gathered_dots, scaled_gather


def expert_activation(h1: torch.Tensor, h3: torch.Tensor | None) -> torch.Tensor:
    """The expert MLP's hidden activation: GELU(h1), or SwiGLU's silu(h1) * h3 when the up
    projection ``h3`` is given."""
    return F.gelu(h1) if h3 is None else F.silu(h1) * h3


class _ChunkedExperts(torch.autograd.Function):
    """See ``chunked_experts``. Saves, per expert with tokens: h1 (, h3), act, y."""

    @staticmethod
    def forward(ctx, x, weights, w1, w2, w3, token_idx, bounds: list[int]):
        out = torch.zeros_like(x)
        saved = []
        for e, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            if a == b:
                continue
            rows = token_idx[a:b]
            xe = x.index_select(0, rows)  # [n_e, D]
            h1 = xe @ w1[e]  # [n_e, F]
            h3 = xe @ w3[e] if w3 is not None else None
            act = expert_activation(h1, h3)
            y = act @ w2[e]  # [n_e, D]
            out.index_add_(0, rows, y * weights[a:b, None])
            saved += [h1, act, y] if h3 is None else [h1, h3, act, y]
        ctx.save_for_backward(x, weights, w1, w2, w3, token_idx, *saved)
        ctx.bounds = bounds
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weights, w1, w2, w3, token_idx, *saved = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_out = grad_out.contiguous()
        grad_x = torch.zeros_like(x) if need_x else None
        grad_weights = torch.zeros_like(weights) if need_w else None
        # NOTE: every expert's weight gradient is written whole by ``mm(out=...)`` below;
        # only experts without tokens need zeros.
        grad_w1, grad_w2 = torch.empty_like(w1), torch.empty_like(w2)
        grad_w3 = torch.empty_like(w3) if w3 is not None else None
        per_expert = 3 if w3 is None else 4
        bounds, i = ctx.bounds, 0
        for e, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            if a == b:
                for grad_w in (grad_w1, grad_w2, grad_w3):
                    if grad_w is not None:
                        grad_w[e].zero_()
                continue
            if w3 is None:
                h1, act, y = saved[i : i + 3]
                h3 = None
            else:
                h1, h3, act, y = saved[i : i + 4]
            i += per_expert
            rows = token_idx[a:b]
            if need_w:  # <grad_out[rows[i]], y[i]>
                grad_weights[a:b] = gathered_dots(grad_out, rows, y, torch.arange(b - a, device=rows.device))
            g = scaled_gather(grad_out, rows, weights[a:b])  # d loss / d y
            torch.mm(act.t(), g, out=grad_w2[e])
            d_act = g @ w2[e].t()  # [n_e, F]
            if h3 is None:
                d_h1, d_h3 = torch.ops.aten.gelu_backward(d_act, h1), None
            else:
                d_h1 = torch.ops.aten.silu_backward(d_act * h3, h1)
                d_h3 = d_act * F.silu(h1)
            xe = x.index_select(0, rows)
            torch.mm(xe.t(), d_h1, out=grad_w1[e])
            if d_h3 is not None:
                torch.mm(xe.t(), d_h3, out=grad_w3[e])
            if need_x:
                d_x = d_h1 @ w1[e].t()
                if d_h3 is not None:
                    d_x.addmm_(d_h3, w3[e].t())
                grad_x.index_add_(0, rows, d_x)
        return grad_x, grad_weights, grad_w1, grad_w2, grad_w3, None, None


def chunked_experts(
    x: torch.Tensor,
    token_idx: torch.Tensor,
    counts: torch.Tensor,
    weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weighted sum of each token's expert MLP outputs, expert by expert.

    x: [N, D]; token_idx: [M] token of each dispatched assignment, grouped by expert
    (``Dispatch.token_idx``); counts: [E] assignments per expert; weights: [M] combine
    weight of each assignment (same order, x's dtype); w1: [E, D, F], w2: [E, F, D],
    w3: [E, D, F] for SwiGLU or None for GELU -> [N, D]::

        out[n] = sum over n's assignments m of weights[m] * mlp_{expert(m)}(x[n])

    Tokens with no assignment get zeros. Differentiable w.r.t. x, weights and w1/w2/w3.
    """
    if token_idx.shape != weights.shape or token_idx.dim() != 1:
        raise ValueError(f"token_idx {tuple(token_idx.shape)} and weights {tuple(weights.shape)} must be equal [M]")
    bounds = [0, *torch.cumsum(counts, 0).tolist()]
    if bounds[-1] > token_idx.numel():
        raise ValueError(f"counts sum to {bounds[-1]} but there are {token_idx.numel()} assignments")
    # NOTE: the experts compute in the inputs' dtype, as the grouped GEMM custom ops do: under
    # autocast the GEMMs would come out in another dtype than the ``out`` they accumulate into.
    with torch.autocast(x.device.type, enabled=False):
        return _ChunkedExperts.apply(x, weights, w1, w2, w3, token_idx, bounds)
