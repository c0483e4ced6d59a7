"""Grouped GEMM backends: ``gmm(x [N, K], w [E, K, M], counts [E]) -> [N, M]``.

Rows of ``x`` are sorted by expert: rows ``offsets[e-1]:offsets[e]`` (``offsets = cumsum(counts)``)
are multiplied by ``w[e]``. Rows past ``offsets[-1]`` (a static-size dispatch's scratch rows)
belong to no expert: their output is unspecified (``loop`` writes zeros) and never read. The
backends are the rows of one table, ``GEMM_BACKENDS`` (name, entry point, grouped GEMM, why it
cannot run, place in ``auto``'s CUDA order):

- ``loop``: one matmul per expert (the reference; any device and dtype).
- ``torch``: ``torch._grouped_mm`` as a custom op whose registered backward makes the
  incoming gradient contiguous (the built-in CPU backward fails on expanded zero-stride
  gradients with "Invalid strides/sizes") and computes dX and dW with grouped GEMMs.
  Needs float32/bfloat16/float16 and K, M whose rows are 16-byte aligned.
- ``megablocks``: MegaBlocks' grouped GEMM (its ``grouped_gemm`` package), CUDA and bf16
  only, imported only when asked for. The adapter follows that package's documented contract
  (``ops.gmm(a, b, batch_sizes, trans_b=False)``: a [N, K] and b [E, K, M] contiguous bf16 on
  the GPU, batch_sizes a CPU int64 [E]); it is checked against a stand-in on CPU and is
  unverified on hardware until a GPU run has checked it.
- ``triton``: our Triton kernels (``mode.kernels.scatter_gemm``), CUDA (or the CPU under
  ``TRITON_INTERPRET=1``, for tests). Its token-choice entry point is ``scattered``: the first
  GEMM reads token rows through the sorted-assignment index and the second writes back to
  token order with the router weights applied, so neither [M, D] permuted buffer exists.
- ``chunked``: not a grouped GEMM but a way to run the whole expert MLP: expert by expert on
  its token rows, with the gather and the weighted combine fused into that loop (see
  ``mode.experts.chunked``), which avoids the [M, D] permuted buffers. Where a grouped GEMM
  is still needed (tokens that arrive sorted, e.g. under expert parallelism) it uses
  ``torch`` where supported, else ``loop``.
- ``auto``: on CUDA the first that can run in ``AUTO_CUDA_ORDER`` (megablocks, torch, triton,
  loop: see ``GEMM_BACKENDS`` for why; benchmarks/RESULTS.md "GPU"); on
  other devices ``chunked`` once the [M, D] sorted-token buffer it avoids would reach
  ``CHUNKED_MIN_BYTES``, else torch where supported, else loop (benchmarks/RESULTS.md,
  "auto on CPU").
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch.utils.flop_counter import register_flop_formula

from mode.checks import closest
from mode.kernels import triton_unavailable_reason

GroupedGemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def gmm_loop(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Reference grouped GEMM: x [N, K], w [E, K, M], counts [E] -> [N, M]."""
    sizes = counts.tolist()
    tail = x.shape[0] - sum(sizes)  # rows past every group (a dispatch's scratch rows): zeros
    outs = [xe @ w[e] for e, xe in enumerate(torch.split(x, [*sizes, tail], dim=0)[: len(sizes)])]
    return torch.cat([*outs, x.new_zeros(tail, w.shape[-1])], dim=0)


# NOTE: the grouped GEMM is a torch.library custom op with a fake (meta) implementation
# so torch.compile treats it as one opaque node (the built-in meta of torch._grouped_mm
# insists on bf16); its autograd is registered explicitly so the backward works on CPU.
@torch.library.custom_op("mode::grouped_mm", mutates_args=())
def _grouped_mm_op(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(x, w, offs=offsets)


@_grouped_mm_op.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[-1])


@torch.library.custom_op("mode::grouped_mm_wgrad", mutates_args=())
def _grouped_mm_wgrad(x: torch.Tensor, grad_out: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """dW[e] = x[group e]^T @ grad_out[group e]: x [N, K], grad_out [N, M] -> [E, K, M]."""
    # NOTE: x.t() is a transposed view with 16-byte aligned columns; a contiguous copy would
    # cost more than the GEMM's own transpose handling.
    return torch._grouped_mm(x.t(), grad_out, offs=offsets)


@_grouped_mm_wgrad.register_fake
def _(x: torch.Tensor, grad_out: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return x.new_empty(offsets.shape[0], x.shape[1], grad_out.shape[1])


def _setup_context(ctx, inputs, output) -> None:
    x, w, offsets = inputs
    ctx.save_for_backward(x, w, offsets)


def _backward(ctx, grad_out: torch.Tensor):
    x, w, offsets = ctx.saved_tensors
    # NOTE: grad_out may be an expanded (zero-stride) tensor; _grouped_mm rejects it.
    grad_out = grad_out.contiguous()
    grad_x = _grouped_mm_op(grad_out, w.transpose(-2, -1), offsets) if ctx.needs_input_grad[0] else None
    grad_w = _grouped_mm_wgrad(x, grad_out, offsets) if ctx.needs_input_grad[1] else None
    return grad_x, grad_w, None


_grouped_mm_op.register_autograd(_backward, setup_context=_setup_context)


def gmm_torch(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` with a backward that works on CPU: x [N, K], w [E, K, M], counts [E]."""
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    return _grouped_mm_op(x, w, offsets)


def _torch_reason(device: torch.device, dtype: torch.dtype, k: int, m: int) -> str | None:
    if not hasattr(torch, "_grouped_mm"):
        return "this torch has no torch._grouped_mm (needs torch >= 2.8)"
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"torch._grouped_mm does not support {dtype}"
    if device.type == "cuda" and dtype == torch.float32:
        return "torch._grouped_mm on CUDA supports bf16/fp16 only"
    if device.type not in ("cpu", "cuda"):
        return f"torch._grouped_mm is not available on {device.type}"
    align = 16 // dtype.itemsize
    if k % align or m % align:
        return f"dims K={k}, M={m} must be multiples of {align} for 16-byte-aligned rows in {dtype}"
    return None


def _megablocks_reason(device: torch.device, dtype: torch.dtype, k: int, m: int) -> str | None:
    if device.type != "cuda":
        return "megablocks needs a CUDA device"
    if dtype != torch.bfloat16:
        return "megablocks' grouped GEMM supports bf16 only (its kernel checks a, b and c are kBFloat16)"
    if importlib.util.find_spec("grouped_gemm") is None:
        return "install the GPU extra: pip install 'mode-moe[gpu]' (megablocks, grouped_gemm)"
    return None


def megablocks_arguments(
    x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(a, b, batch_sizes) as ``grouped_gemm.ops.gmm`` requires them: a = x [N, K] and b = w
    [E, K, M] contiguous (its kernel checks ``is_contiguous``), batch_sizes = counts as a CPU
    int64 [E] (it checks ``is_cpu`` for its cuBLAS build and ``kInt64``)."""
    if x.dim() != 2 or w.dim() != 3 or counts.dim() != 1 or counts.numel() != w.shape[0]:
        raise ValueError(
            f"grouped GEMM needs x [N, K], w [E, K, M], counts [E]; got {tuple(x.shape)}, "
            f"{tuple(w.shape)}, {tuple(counts.shape)}"
        )
    return x.contiguous(), w.contiguous(), counts.to("cpu", torch.int64)


def gmm_megablocks(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, gmm: Callable | None = None) -> torch.Tensor:
    """MegaBlocks' CUTLASS grouped GEMM: ``grouped_gemm.ops.gmm(a, b, batch_sizes,
    trans_b=False)`` (an autograd function; CUDA, bf16). ``gmm`` replaces that function (the
    tests pass a pure-torch stand-in with the same signature)."""
    if gmm is None:
        from grouped_gemm import ops  # noqa: PLC0415

        gmm = ops.gmm
    return gmm(*megablocks_arguments(x, w, counts), trans_b=False)


def _triton_reason(device: torch.device, dtype: torch.dtype, k: int, m: int) -> str | None:
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"the triton kernels support float32, bfloat16 and float16, not {dtype}"
    return triton_unavailable_reason(device)


def gmm_triton(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Our Triton grouped GEMM on rows already sorted by expert (``mode.kernels.scatter_gemm``)."""
    from mode.experts.scattered import grouped_mm  # noqa: PLC0415  (imports triton)

    return grouped_mm(x, w, counts)


@dataclass(frozen=True, kw_only=True)
class GemmBackend:
    """One row of the backend table.

    name: what ``model.moe.backend`` says. entry: the ``ExpertMLP`` entry point it implements,
    "sorted" (a grouped GEMM over tokens already sorted by expert) or "scattered" (tokens in
    their own order with the dispatch: the gather and the weighted combine fused into the
    expert loop). gemm: its grouped GEMM on sorted rows, or None where it borrows the CPU
    one (``chunked``: torch where supported, else loop). unavailable: (device, dtype, k, m)
    -> why it cannot run there, or None. cuda_rank: its place in ``auto``'s order on CUDA
    (lower first), None where ``auto`` never picks it there.
    """

    name: str
    entry: Literal["sorted", "scattered"]
    gemm: GroupedGemm | None
    unavailable: Callable[[torch.device, torch.dtype, int, int], str | None]
    cuda_rank: int | None = None


def _always(device: torch.device, dtype: torch.dtype, k: int, m: int) -> None:
    return None


# The backend table: adding a backend is one row here (plus its module). auto on CUDA:
# megablocks, then torch (on an H200 in bf16 torch._grouped_mm ran the scattered expert GEMMs
# 2.2x faster than our untuned Triton tiles), then triton (one launch instead of E matmuls),
# then loop.
GEMM_BACKENDS: tuple[GemmBackend, ...] = (
    GemmBackend(name="loop", entry="sorted", gemm=gmm_loop, unavailable=_always, cuda_rank=3),
    GemmBackend(name="torch", entry="sorted", gemm=gmm_torch, unavailable=_torch_reason, cuda_rank=1),
    GemmBackend(name="megablocks", entry="sorted", gemm=gmm_megablocks, unavailable=_megablocks_reason, cuda_rank=0),
    GemmBackend(name="chunked", entry="scattered", gemm=None, unavailable=_always),
    GemmBackend(name="triton", entry="scattered", gemm=gmm_triton, unavailable=_triton_reason, cuda_rank=2),
)
BACKENDS: dict[str, GemmBackend] = {b.name: b for b in GEMM_BACKENDS}
BackendName = Literal["loop", "torch", "megablocks", "chunked", "triton"]
BACKEND_NAMES: tuple[str, ...] = tuple(BACKENDS)
assert BACKEND_NAMES == get_args(BackendName), "BackendName must list the table's rows in order"
AUTO_CUDA_ORDER: tuple[str, ...] = tuple(
    b.name for b in sorted((b for b in GEMM_BACKENDS if b.cuda_rank is not None), key=lambda b: b.cuda_rank)
)


def backend(name: str) -> GemmBackend:
    """The table row of backend ``name`` (a ``ValueError`` with the closest name otherwise)."""
    if name not in BACKENDS:
        hint = closest(name, BACKEND_NAMES)
        raise ValueError(f"backend={name!r} is invalid: choose one of {[*BACKEND_NAMES, 'auto']}{hint}")
    return BACKENDS[name]


def unavailable_reason(name: str, device: torch.device, dtype: torch.dtype, k: int = 64, m: int = 64) -> str | None:
    """Why backend ``name`` cannot run for these inputs, or None when it can."""
    return backend(name).unavailable(torch.device(device), dtype, k, m)


def _grouped_fallback(device: torch.device, dtype: torch.dtype, k: int, m: int) -> str:
    """The grouped GEMM off CUDA (``chunked``'s, and ``auto``'s for small batches)."""
    return "loop" if unavailable_reason("torch", device, dtype, k, m) else "torch"


# NOTE: measured with benchmarks/bench_moe_auto.py on 2 CPU cores (fp32 and bf16, d 256-1024,
# 512-8192 tokens): chunked takes 0.84-0.93x the grouped path's time once the [M, D] buffer of
# sorted tokens that it never builds reaches 16 MiB, and 0.98-1.26x below that.
CHUNKED_MIN_BYTES = 16 * 2**20


def resolve_name(
    name: str,
    device: torch.device | str,
    dtype: torch.dtype,
    k: int = 64,
    m: int = 64,
    rows: int | None = None,
) -> str:
    """The concrete backend on ``device``/``dtype`` for GEMMs of inner dim ``k`` and output
    dim ``m`` (d_model, d_ff) over ``rows`` expert assignments.

    ``auto`` tries megablocks, torch, triton, loop in that order on CUDA. Elsewhere it is ``chunked``
    when ``rows * k`` elements of ``dtype`` reach ``CHUNKED_MIN_BYTES`` or ``rows`` is unknown
    (None), and otherwise torch where supported, else loop. A named backend that cannot run
    raises ``RuntimeError`` saying why and what to install.
    """
    device = torch.device(device)
    if name == "auto":
        if device.type != "cuda":
            if rows is None or rows * k * dtype.itemsize >= CHUNKED_MIN_BYTES:
                return "chunked"
            return _grouped_fallback(device, dtype, k, m)
        reasons = {}
        for candidate in AUTO_CUDA_ORDER:
            reason = unavailable_reason(candidate, device, dtype, k, m)
            if reason is None:
                return candidate
            reasons[candidate] = reason
        raise RuntimeError(f"no grouped GEMM backend works here: {reasons}")
    reason = unavailable_reason(name, device, dtype, k, m)
    if reason is not None:
        raise RuntimeError(f"grouped GEMM backend {name!r} is unavailable: {reason}")
    return name


def get_backend(
    name: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, k: int = 64, m: int = 64
) -> GroupedGemm:
    """The grouped GEMM that backend ``name`` uses for these inputs (see ``resolve_name``);
    ``chunked`` uses ``torch`` where supported, else ``loop``."""
    row = backend(resolve_name(name, device, dtype, k, m))
    return row.gemm or backend(_grouped_fallback(torch.device(device), dtype, k, m)).gemm


# FlopCounterMode counts the custom ops like any matmul: 2 * N * K * M.
@register_flop_formula(torch.ops.mode.grouped_mm)
def _grouped_mm_flops(x_shape, w_shape, offsets_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * x_shape[0] * x_shape[1] * w_shape[-1]


@register_flop_formula(torch.ops.mode.grouped_mm_wgrad)
def _grouped_mm_wgrad_flops(x_shape, grad_shape, offsets_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * x_shape[0] * x_shape[1] * grad_shape[1]
