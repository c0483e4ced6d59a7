"""ScatterMoE-style grouped GEMMs in Triton: input rows read through the sorted-assignment
index, output rows written back to token order with the router weights applied.

Legend: N tokens, K experts per token (top-k), E experts, M assignments grouped by expert
(``counts [E]`` per expert, M <= N * K: no-op or dropped assignments are absent), D model dim,
F expert hidden dim. For assignment m (in expert order): ``rows[m]`` its token, ``slots[m]``
its flat index ``n * K + j`` in the [N, K] assignment table, ``weights[m]`` its router weight.

Two kernels do all the work, each tiled over the M rows of one expert at a time (a tile never
straddles two experts; ``tile_schedule`` lays the tiles out on the device, no host sync):

- ``_rows_gemm``: ``out[dst(m)] = scale[m] * a[src(m)] @ w[e(m)]`` where ``src`` is ``rows[m]``
  (gather fused into the load) or m, and ``dst`` is ``slots[m]`` (scatter fused into the
  store) or m. Forward of both expert GEMMs and the input gradients of both.
- ``_rows_wgrad``: ``dw[e] = sum over m in e of a[src_a(m)]^T (scale[m] * b[src_b(m)])``, a
  grouped GEMM along the row dimension: the weight gradients.

``rows_gemm`` and ``rows_wgrad`` launch them (no autograd). The autograd ops an expert MLP is
made of, ``scattered_gemm`` (x [N, D] -> h [M, F]) and ``gemm_combine`` (h [M, F] -> out
[N, D]), and the plain ``grouped_mm``, are built on these in ``mode.experts.scattered``.

Accumulation is float32; inputs may be float32 (multiplied in full fp32, "ieee", not TF32: as
torch's matmul by default), bfloat16 or float16. Under Triton's CPU
interpreter the tiles are upcast to float32 before ``tl.dot`` (its bf16 dot returns garbage in
Triton 3.9; on a GPU the dot takes bf16 operands).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mode.kernels.availability import interpreting

# NOTE: fixed tiles, not autotuned: no GPU has measured alternatives yet (benchmarks/RESULTS.md).
_GPU_BLOCKS = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32}
_INTERPRETER_BLOCKS = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32}


def _blocks() -> dict[str, int]:
    return _INTERPRETER_BLOCKS if interpreting() else _GPU_BLOCKS


@triton.jit
def _rows_gemm(
    a_ptr,
    w_ptr,
    out_ptr,
    src_rows_ptr,
    dst_rows_ptr,
    scale_ptr,
    tile_expert_ptr,
    tile_start_ptr,
    tile_end_ptr,
    n_inner,
    n_out,
    stride_am,
    stride_ak,
    stride_we,
    stride_wk,
    stride_wn,
    stride_om,
    stride_on,
    GATHER: tl.constexpr,
    SCATTER: tl.constexpr,
    SCALE: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    m = start + tl.arange(0, BLOCK_M)
    m_ok = m < end
    if GATHER:
        src = tl.load(src_rows_ptr + m, mask=m_ok, other=0).to(tl.int64)
    else:
        src = m.to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < n_out
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, n_inner, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < n_inner
        a = tl.load(a_ptr + src[:, None] * stride_am + k[None, :] * stride_ak, mask=m_ok[:, None] & k_ok[None, :])
        w = tl.load(
            w_ptr + expert * stride_we + k[:, None] * stride_wk + n[None, :] * stride_wn,
            mask=k_ok[:, None] & n_ok[None, :],
        )
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    if SCALE:
        acc = acc * tl.load(scale_ptr + m, mask=m_ok, other=0.0).to(tl.float32)[:, None]
    if SCATTER:
        dst = tl.load(dst_rows_ptr + m, mask=m_ok, other=0).to(tl.int64)
    else:
        dst = m.to(tl.int64)
    out = out_ptr + dst[:, None] * stride_om + n[None, :] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _rows_wgrad(
    a_ptr,
    b_ptr,
    out_ptr,
    a_rows_ptr,
    b_rows_ptr,
    scale_ptr,
    offsets_ptr,
    n_a,
    n_b,
    stride_am,
    stride_ak,
    stride_bm,
    stride_bn,
    stride_oe,
    stride_ok,
    stride_on,
    GATHER_A: tl.constexpr,
    GATHER_B: tl.constexpr,
    SCALE: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    expert = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_n = tl.program_id(2)
    start = tl.load(offsets_ptr + expert)
    end = tl.load(offsets_ptr + expert + 1)
    k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = k < n_a
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < n_b
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        m_ok = m < end
        if GATHER_A:
            ra = tl.load(a_rows_ptr + m, mask=m_ok, other=0).to(tl.int64)
        else:
            ra = m.to(tl.int64)
        if GATHER_B:
            rb = tl.load(b_rows_ptr + m, mask=m_ok, other=0).to(tl.int64)
        else:
            rb = m.to(tl.int64)
        a = tl.load(a_ptr + ra[:, None] * stride_am + k[None, :] * stride_ak, mask=m_ok[:, None] & k_ok[None, :])
        b = tl.load(b_ptr + rb[:, None] * stride_bm + n[None, :] * stride_bn, mask=m_ok[:, None] & n_ok[None, :])
        if SCALE:
            s = tl.load(scale_ptr + m, mask=m_ok, other=0.0).to(tl.float32)
            b = (b.to(tl.float32) * s[:, None]).to(b_ptr.dtype.element_ty)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:
            acc += tl.dot(tl.trans(a), b, input_precision="ieee")
        else:
            acc += tl.dot(tl.trans(a), b)
    out = out_ptr + expert.to(tl.int64) * stride_oe + k[:, None] * stride_ok + n[None, :] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=k_ok[:, None] & n_ok[None, :])


def tile_schedule(counts: torch.Tensor, n_rows: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """counts: [E] rows per expert (M = n_rows in all) -> (expert, start, end) per tile, each
    [ceil(M / block_m) + E] int64 on counts' device: tile t covers rows ``start:end`` of one
    expert (at most block_m of them); unused tiles have start = end = 0. Computed on the
    device: the grid's size is a bound known without reading ``counts`` back."""
    counts = counts.to(torch.int64)
    E = counts.numel()
    ends = torch.cumsum(counts, 0)
    tiles = torch.div(counts + block_m - 1, block_m, rounding_mode="floor")
    tile_ends = torch.cumsum(tiles, 0)
    t = torch.arange(triton.cdiv(n_rows, block_m) + E, device=counts.device)
    expert = torch.searchsorted(tile_ends, t, right=True)
    used = expert < E
    e = expert.clamp_max(E - 1)
    start = ends[e] - counts[e] + (t - (tile_ends[e] - tiles[e])) * block_m
    zero = torch.zeros_like(t)
    return e, torch.where(used, start, zero), torch.where(used, ends[e], zero)


def _offsets(counts: torch.Tensor) -> torch.Tensor:
    """counts [E] -> [E + 1] group boundaries (int64)."""
    return torch.nn.functional.pad(torch.cumsum(counts.to(torch.int64), 0), (1, 0))


def rows_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    counts: torch.Tensor,
    out: torch.Tensor,
    src_rows: torch.Tensor | None = None,
    dst_rows: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[dst(m)] = scale[m] * a[src(m)] @ w[e(m)] for the M rows grouped by ``counts`` [E]:
    a [*, Ki], w [E, Ki, No] (any strides), out [*, No]; src = src_rows[m] or m, dst =
    dst_rows[m] or m. Rows of ``out`` no m writes are left as they were. No autograd."""
    if a.dtype != w.dtype:
        raise TypeError(f"rows_gemm needs a and w of one dtype, got {a.dtype} and {w.dtype}")
    index = src_rows if src_rows is not None else dst_rows
    n_rows = a.shape[0] if index is None else index.numel()
    if n_rows == 0 or out.numel() == 0:
        return out
    blocks = _blocks()
    expert, start, end = tile_schedule(counts, n_rows, blocks["BLOCK_M"])
    grid = (expert.numel(), triton.cdiv(w.shape[2], blocks["BLOCK_N"]))
    dummy = expert  # an unused pointer argument (its constexpr flag is off)
    _rows_gemm[grid](
        a,
        w,
        out,
        dummy if src_rows is None else src_rows,
        dummy if dst_rows is None else dst_rows,
        dummy if scale is None else scale,
        expert,
        start,
        end,
        w.shape[1],
        w.shape[2],
        a.stride(0),
        a.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out.stride(0),
        out.stride(1),
        GATHER=src_rows is not None,
        SCATTER=dst_rows is not None,
        SCALE=scale is not None,
        UPCAST=interpreting(),
        IEEE=a.dtype == torch.float32,
        **blocks,
    )
    return out


def rows_wgrad(
    a: torch.Tensor,
    b: torch.Tensor,
    counts: torch.Tensor,
    a_rows: torch.Tensor | None = None,
    b_rows: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """dw[e] = sum over m in expert e of a[ra(m)]^T (scale[m] * b[rb(m)]): a [*, Ka], b [*, Nb]
    -> [E, Ka, Nb] (experts without rows get zeros). No autograd."""
    E = counts.numel()
    out = torch.empty(E, a.shape[1], b.shape[1], dtype=out_dtype or a.dtype, device=a.device)
    if out.numel() == 0:
        return out
    blocks = _blocks()
    offsets = _offsets(counts)
    grid = (E, triton.cdiv(a.shape[1], blocks["BLOCK_K"]), triton.cdiv(b.shape[1], blocks["BLOCK_N"]))
    _rows_wgrad[grid](
        a,
        b,
        out,
        offsets if a_rows is None else a_rows,
        offsets if b_rows is None else b_rows,
        offsets if scale is None else scale,
        offsets,
        a.shape[1],
        b.shape[1],
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        GATHER_A=a_rows is not None,
        GATHER_B=b_rows is not None,
        SCALE=scale is not None,
        UPCAST=interpreting(),
        IEEE=a.dtype == torch.float32,
        **blocks,
    )
    return out
