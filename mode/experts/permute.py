"""Sort assignments by expert, gather tokens, and combine expert outputs back per token.

Legend: N tokens, D model dim, K experts per token, E experts, M assignments computed
(M = N*K dropless; fewer when some are dropped or go to no-op experts).

The two data movements around the grouped GEMM are a gather (tokens -> expert order) and a
gather-and-sum (expert order -> tokens). Both directions of both are single fused passes:
the sums use ``embedding_bag`` (a gather with an optional per-row weight, summed per bag),
so no ``[N, K, D]`` temporary, zero-filled output or atomic scatter is needed:

- ``permute``   forward: ``index_select``;  backward: per-token sum of its rows' gradients.
- ``combine``   forward: per-token weighted sum of its rows; backward: weighted gather of the
  output gradient, and the weight gradient as fused per-row dot products.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, get_args

import torch
import torch.nn.functional as F

from mode.routing.counting import count_ids

# How token rows move around the expert GEMMs: "embedding_bag" (the fused gather-sums below:
# no [N*K, D] temporary in the combine) or "index" (``index_select`` + a batched [1, K] x
# [K, D] combine and autograd's ``index_add`` backward, torchtitan's layout: one gathered
# [N*K, D] copy). "auto" is embedding_bag, measured on the CPU; ``bench_moe.py`` times both
# on a GPU, where the choice is still to be measured.
TokenMoves = Literal["auto", "embedding_bag", "index"]
TOKEN_MOVES: tuple[str, ...] = get_args(TokenMoves)


def resolve_token_moves(name: str) -> str:
    """The concrete token moves for ``name`` ("auto" -> "embedding_bag")."""
    return "embedding_bag" if name == "auto" else name


class Dispatch(NamedTuple):
    """Assignments sorted by expert (stable: ties keep token order), and the way back.

    order:     [R] index into the flattened [N*K] assignments, sorted by expert; the rows of
               the expert-ordered buffer (R = M, or N*K + 1 with ``pad``, see below).
    token_idx: [R] token row each sorted row reads (``order // K``).
    counts:    [E] assignments per expert (grouped-GEMM group sizes); rows past their sum are
               not computed by any expert.
    bags:      [N*K] every assignment in token order, as its row of the expert-ordered buffer
               (``pad`` for one no expert computes): token n's rows are
               ``bags[bag_offsets[n]:bag_offsets[n + 1]]``.
    bag_offsets: [N + 1] start of each token's rows in ``bags`` (``n * K``).
    pad:       None, or the buffer row that ``bags`` names for assignments that are not
               computed (no-op or dropped): a scratch row past the sorted ones, never read
               (``embedding_bag``'s ``padding_idx``). Sizes then stay N*K + 1 whatever the
               routing, so no host read of the count and no data-dependent shape.
    """

    order: torch.Tensor
    token_idx: torch.Tensor
    counts: torch.Tensor
    bags: torch.Tensor
    bag_offsets: torch.Tensor
    pad: int | None = None


def sort_by_expert(
    experts: torch.Tensor, n_experts: int, keep: torch.Tensor | None = None, has_noop: bool = False
) -> Dispatch:
    """experts: [N, K] expert ids; keep: [N, K] bool (None = all). With ``has_noop``, ids >=
    ``n_experts`` (no-op experts) are not computed, nor are assignments whose ``keep`` is
    False: they sort to the end, past every expert's rows, and their bags name the scratch
    row ``pad = N*K``. No shape depends on the data either way (no host sync, compiles)."""
    N, K = experts.shape
    flat = experts.reshape(-1)
    device = experts.device
    bag_offsets = torch.arange(0, N * K + 1, K, device=device)
    if (keep is None and not has_noop) or N == 0:  # (no tokens: nothing to leave out)
        counts = count_ids(flat, n_experts)
        order = torch.sort(flat, stable=True).indices
        bags, pad = _inverse(order), None
    else:
        valid = flat < n_experts
        if keep is not None:
            valid = valid & keep.reshape(-1)
        # NOTE: invalid assignments get key E and sort to the end, after every expert's rows.
        key = torch.where(valid, flat, torch.full_like(flat, n_experts))
        counts = count_ids(key, n_experts + 1)[:n_experts]
        order = torch.sort(key, stable=True).indices
        pad = N * K
        bags = torch.where(valid, _inverse(order), pad)
        # The scratch row reads assignment 0's token (any token: no expert computes it).
        order = torch.cat([order, order.new_zeros(1)])
    return Dispatch(order, torch.div(order, K, rounding_mode="floor"), counts, bags, bag_offsets, pad)


def _inverse(order: torch.Tensor) -> torch.Tensor:
    """The inverse permutation of ``order`` ([n] int64)."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


def computed(dispatch: Dispatch) -> torch.Tensor:
    """0-dim count of the assignments an expert computes (M), on the device."""
    return dispatch.counts.sum()


def bag_tokens(dispatch: Dispatch, k: int) -> torch.Tensor:
    """[N*K] token of each entry of ``dispatch.bags`` (they are in token order, K per token)."""
    return torch.div(torch.arange(dispatch.bags.numel(), device=dispatch.bags.device), k, rounding_mode="floor")


def gather_sum(rows: torch.Tensor, dispatch: Dispatch, weights: torch.Tensor | None = None) -> torch.Tensor:
    """``out[n] = sum of weights[a] * rows[bags[a]]`` over token n's entries: rows [R, D] in
    expert order, weights in bag order (None = 1) -> [N, D]; tokens without rows get 0, and
    entries naming ``dispatch.pad`` are skipped (never read)."""
    return F.embedding_bag(
        dispatch.bags,
        rows,
        dispatch.bag_offsets,
        mode="sum",
        per_sample_weights=weights,
        include_last_offset=True,
        padding_idx=dispatch.pad,
    )


def scaled_gather(src: torch.Tensor, rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``out[i] = scale[i] * src[rows[i]]``: src [N, D], rows and scale [n] -> [n, D], in one
    pass (no gathered copy scaled afterwards)."""
    return F.embedding_bag(rows.unsqueeze(1), src, mode="sum", per_sample_weights=scale.unsqueeze(1))


def gathered_dots(a: torch.Tensor, a_rows: torch.Tensor, b: torch.Tensor, b_rows: torch.Tensor) -> torch.Tensor:
    """``out[i] = <a[a_rows[i]], b[b_rows[i]]>``: a [Na, D], b [Nb, D], rows [n] -> [n]."""
    if a.device.type == "cpu":
        # NOTE: embedding_bag's per-sample-weight gradient kernel computes exactly these
        # gathered dot products in one pass, without [n, D] gathered copies: sample i is
        # <grad[offset2bag[i]], weight[indices[i]]>. On CPU each sample is handled on its own
        # (the rows need no order) and ``offsets`` is read only when offset2bag is empty.
        return torch.ops.aten._embedding_bag_per_sample_weights_backward(a, b, b_rows, b_rows, a_rows, 0)
    return torch.linalg.vecdot(a.index_select(0, a_rows), b.index_select(0, b_rows))


class _Permute(torch.autograd.Function):
    """x [N, D] -> x[token_idx] [M, D]; backward sums each token's row gradients (one pass)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dispatch: Dispatch) -> torch.Tensor:
        ctx.dispatch = dispatch
        return x.index_select(0, dispatch.token_idx)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return gather_sum(grad.contiguous(), ctx.dispatch), None


def permute(x: torch.Tensor, dispatch: Dispatch, moves: str = "embedding_bag") -> torch.Tensor:
    """x: [N, D] -> [R, D], the token rows in expert order; the backward sums into each token
    the gradients of its computed rows only (rows past ``counts.sum()`` carry none back).
    ``moves="index"``: a plain ``index_select`` (backward: ``index_add``) where no row is
    left uncomputed (``dispatch.pad`` is None)."""
    if resolve_token_moves(moves) == "index" and dispatch.pad is None:
        return x.index_select(0, dispatch.token_idx)
    return _Permute.apply(x, dispatch)


def sorted_weights(weights: torch.Tensor, dispatch: Dispatch) -> torch.Tensor:
    """weights: [N, K] combine weights -> [M] in the dispatch's expert order."""
    return weights.reshape(-1).index_select(0, dispatch.order)


def unpermute(y: torch.Tensor, token_idx: torch.Tensor, weights: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """Combine expert outputs back to tokens: ``out[n] = sum of w[m] * y[m] over m with token_idx[m] = n``.

    y: [M, D] in expert order; token_idx, weights: [M] -> [N, D]. Tokens that received no
    assignment get zeros. (Any row-to-token map; ``combine`` is the fused token-choice path.)
    """
    out = y.new_zeros(n_tokens, y.shape[-1])
    return out.index_add(0, token_idx, y * weights.unsqueeze(-1).to(y.dtype))


class _Combine(torch.autograd.Function):
    """out[n] = sum over token n's assignments a of w[a] * y[bags[a]].

    y: [M, D] expert order; w: [M] combine weights in bag (token) order, in y's dtype.
    Forward is one weighted gather-sum; backward is one weighted gather for dy and one fused
    gather-dot for dw.
    """

    @staticmethod
    def forward(ctx, y: torch.Tensor, w: torch.Tensor, dispatch: Dispatch, k: int) -> torch.Tensor:
        ctx.save_for_backward(y, w)
        ctx.dispatch, ctx.k = dispatch, k
        return gather_sum(y, dispatch, w)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        y, w = ctx.saved_tensors
        d: Dispatch = ctx.dispatch
        grad_out = grad_out.contiguous()
        grad_y = grad_w = None
        computed_entries = None if d.pad is None else d.bags != d.pad
        if computed_entries is not None:
            w = torch.where(computed_entries, w, 0)  # the scratch row gets no gradient
        if ctx.needs_input_grad[0]:
            w_sorted = w.new_zeros(y.shape[0])
            w_sorted[d.bags] = w  # expert order (entries naming the scratch row all write 0)
            grad_y = scaled_gather(grad_out, d.token_idx, w_sorted)  # w[m] * grad_out[token_idx[m]]
        if ctx.needs_input_grad[1]:
            grad_w = gathered_dots(grad_out, bag_tokens(d, ctx.k), y, d.bags)
            if computed_entries is not None:  # the scratch row holds no output: weight gradient 0
                grad_w = torch.where(computed_entries, grad_w, 0)
        return grad_y, grad_w, None, None


def combine(y: torch.Tensor, dispatch: Dispatch, weights: torch.Tensor, moves: str = "embedding_bag") -> torch.Tensor:
    """Token-choice combine: y [M, D] in expert order, weights [N, K] -> [N, D].

    Equals ``unpermute(y, dispatch.token_idx, sorted_weights(weights, dispatch), N)``;
    assignments not in the dispatch (dropped, no-op) contribute zero. ``moves="index"``:
    each token's K rows gathered ([N, K, D]) and weighted with one batched matmul.
    """
    N, K = weights.shape
    if resolve_token_moves(moves) == "index":
        rows = y.index_select(0, dispatch.bags).view(N, K, y.shape[-1])
        if dispatch.pad is not None:  # the scratch row holds no output: zero, whatever it holds
            rows = torch.where((dispatch.bags != dispatch.pad).view(N, K, 1), rows, 0)
        return torch.bmm(weights.to(y.dtype).unsqueeze(1), rows).squeeze(1)
    # NOTE: no shortcut when nothing was dispatched (M = 0): the output must stay connected to
    # y, whose backward is an all-to-all under expert parallelism that every rank must join
    # (a rank returning detached zeros would skip it while the others wait: a hang).
    # Every dispatch lists all N*K assignments in token order (left-out ones name the scratch row).
    return _Combine.apply(y, weights.reshape(-1).to(y.dtype), dispatch, K)


class _PaddedDispatch(torch.autograd.Function):
    """x [N, D] -> buffer [R, D] with ``buffer[slots[n, j]] = x[n]`` (rows no assignment
    fills are zero); slots [N, K] with R = a scratch row for assignments that are not placed.
    Forward: K row copies straight from x (no [N*K, D] gathered copy); backward: each token's
    placed slots summed in one pass (``embedding_bag`` with the 0/1 ``placed`` weights)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, slots: torch.Tensor, placed: torch.Tensor, n_rows: int) -> torch.Tensor:
        buffer = x.new_zeros(n_rows + 1, x.shape[1])
        for j in range(slots.shape[1]):
            buffer.index_copy_(0, slots[:, j], x)
        ctx.save_for_backward(slots, placed)
        return buffer[:n_rows]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        slots, placed = ctx.saved_tensors
        grad = grad.contiguous()
        rows = slots.clamp_max(grad.shape[0] - 1)  # the scratch row weighs 0 (placed is False)
        return F.embedding_bag(rows, grad, mode="sum", per_sample_weights=placed.to(grad.dtype)), None, None, None


def padded_dispatch(x: torch.Tensor, slots: torch.Tensor, placed: torch.Tensor, n_rows: int) -> torch.Tensor:
    """Place token rows into a zero-padded buffer: x [N, D], slots [N, K] buffer rows (any
    value for assignments whose ``placed`` [N, K] is False) -> [n_rows, D]."""
    n_rows_safe = torch.where(placed, slots, n_rows)
    if n_rows == 0:
        return x.new_zeros(0, x.shape[1]) + 0 * x.sum()
    return _PaddedDispatch.apply(x, n_rows_safe, placed, n_rows)


def padded_combine(y: torch.Tensor, slots: torch.Tensor, placed: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``out[n] = sum over placed j of weights[n, j] * y[slots[n, j]]``: y [R, D] the padded
    buffer's output, slots / placed / weights [N, K] -> [N, D], one fused weighted gather-sum
    (its backward: one weighted scatter into y's gradient and per-assignment dot products for
    the weights; assignments not placed get weight 0 and a zero weight gradient)."""
    if y.shape[0] == 0:
        return y.new_zeros(slots.shape[0], y.shape[1]) + 0 * (y.sum() + weights.sum())
    safe = torch.where(placed, slots, y.shape[0])  # not placed: a scratch row past the end
    return _PaddedCombine.apply(y, safe, (weights * placed).to(y.dtype))


class _PaddedCombine(torch.autograd.Function):
    """out[n] = sum_j w[n, j] * y[slots[n, j]]: y [R, D], slots [N, K] (R = not placed, whose
    w is 0), w [N, K] in y's dtype -> [N, D]. Forward: one weighted gather-sum. Backward: dy by
    K row scatters of ``w[:, j] * grad`` (placed slots are distinct, so no two rows meet), dw by
    fused gathered dot products. Its own backward because autograd's ``embedding_bag``
    per-sample-weight gradient has no bf16 CUDA kernel (torch 2.11)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, slots: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        rows = slots.clamp_max(y.shape[0] - 1)  # the scratch row read as any real row (w is 0)
        ctx.save_for_backward(y, slots, rows, w)
        return F.embedding_bag(rows, y, mode="sum", per_sample_weights=w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        y, slots, rows, w = ctx.saved_tensors
        grad = grad.contiguous()
        N, K = slots.shape
        grad_y = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_y = grad.new_zeros(y.shape[0] + 1, y.shape[1])
            for j in range(K):
                grad_y.index_add_(0, slots[:, j], grad * w[:, j : j + 1])
            grad_y = grad_y[: y.shape[0]]
        if ctx.needs_input_grad[2]:
            tokens = torch.arange(N, device=grad.device).repeat_interleave(K)
            grad_w = gathered_dots(grad, tokens, y, rows.reshape(-1)).view(N, K).to(w.dtype)
        return grad_y, None, grad_w
