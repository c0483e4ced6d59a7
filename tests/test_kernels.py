"""Triton kernels (``mode.kernels``) against slow, obviously-correct torch references, in
values and gradients. On a machine without a GPU they run under Triton's interpreter
(``TRITON_INTERPRET=1``, set by conftest), so sizes stay small; the ``cuda`` tests repeat the
checks on a GPU in bf16 (benchmarks/gpu_check.sh runs them)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from mode.experts.grouped_gemm import gmm_loop
from mode.experts.moe import DroplessMoE
from mode.kernels import triton_missing_reason, triton_unavailable_reason
from mode.layers.mod import MoDBlock, StagedMoDEBlock
from mode.layers.mod_moves import add_gated_tokens, take_tokens, token_rows
from tests.tolerances import assert_close

if triton_missing_reason():
    pytest.skip(triton_missing_reason(), allow_module_level=True)

from mode.experts import scattered  # noqa: E402  (imports triton)
from mode.kernels import mod_tokens, scatter_gemm  # noqa: E402

pytestmark = pytest.mark.slow  # Triton kernels under the interpreter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# --- Mixture-of-Depths token movement ------------------------------------------------------


def _chosen_rows(B: int, T: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random distinct positions per sequence, ascending: indices [B, k] and their rows [B * k]."""
    indices = torch.stack([torch.randperm(T)[:k].sort().values for _ in range(B)]) if k else torch.zeros(B, 0)
    indices = indices.long()
    return indices, token_rows(indices, T)


MOD_CASES = [(2, 9, 3, 33), (3, 7, 7, 40), (2, 1, 1, 16), (2, 8, 0, 24), (1, 5, 2, 1500)]  # (B, T, k, D)


@pytest.mark.parametrize(("B", "T", "k", "D"), MOD_CASES)
def test_take_tokens_kernel_moves_rows_exactly(B, T, k, D):
    x = torch.randn(B, T, D, requires_grad=True)
    indices, rows = _chosen_rows(B, T, k)
    sel, alias = take_tokens(x, indices, rows, mod_tokens)
    ref_sel = x.detach()[torch.arange(B)[:, None], indices]
    assert torch.equal(sel, ref_sel)
    assert torch.equal(alias, x)
    # Backward of both outputs at once: the residual gradient plus the chosen rows' gradient.
    g_sel, g_alias = torch.randn_like(sel), torch.randn_like(alias)
    torch.autograd.backward((sel, alias), (g_sel, g_alias))
    expected = g_alias.clone()
    for b in range(B):
        for j in range(k):
            expected[b, indices[b, j]] += g_sel[b, j]
    assert torch.equal(x.grad, expected)


@pytest.mark.parametrize(("B", "T", "k", "D"), MOD_CASES)
def test_add_gated_tokens_kernel_matches_reference(B, T, k, D):
    x = torch.randn(B, T, D, requires_grad=True)
    indices, rows = _chosen_rows(B, T, k)
    gate = torch.rand(B * k, requires_grad=True)
    update = torch.randn(B * k, D, requires_grad=True)
    out = add_gated_tokens(x, indices, gate.view(B, k), update.view(B, k, D), rows, mod_tokens)
    # Reference: a Python loop over the chosen rows.
    ref = x.detach().clone()
    flat = ref.view(B * T, D)
    for i, r in enumerate(rows.tolist()):
        flat[r] = flat[r] + gate[i].detach() * update[i].detach()
    assert_close(out, ref, "elementwise")
    untouched = torch.ones(B * T, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(out.view(B * T, D)[untouched], x.detach().view(B * T, D)[untouched])  # bit for bit
    g = torch.randn_like(out)
    out.backward(g)
    g_rows = g.view(B * T, D)[rows]
    assert torch.equal(x.grad, g)
    assert_close(update.grad, gate.detach()[:, None] * g_rows, "exact")
    assert_close(gate.grad, (g_rows * update.detach()).sum(-1), "reduction")


def test_mod_token_kernels_in_bf16_match_the_torch_path():
    B, T, k, D = 2, 12, 5, 48
    x = torch.randn(B, T, D)  # the residual stream stays fp32; the update is bf16 (autocast)
    indices, rows = _chosen_rows(B, T, k)
    gate = torch.rand(B, k)
    update = torch.randn(B, k, D, dtype=torch.bfloat16)
    leaves = [t.clone().requires_grad_() for t in (x, gate, update)]
    ref_leaves = [t.clone().requires_grad_() for t in (x, gate, update)]
    out = add_gated_tokens(leaves[0], indices, leaves[1], leaves[2], rows, mod_tokens)
    ref = add_gated_tokens(ref_leaves[0], indices, ref_leaves[1], ref_leaves[2], rows)
    assert_close(out, ref, "elementwise", dtype=torch.bfloat16)  # the kernel rounds once, torch twice
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    for a, b in zip(leaves, ref_leaves, strict=True):
        assert_close(a.grad, b.grad, "layer_grad", dtype=torch.bfloat16)


@pytest.mark.parametrize("block_cls", [MoDBlock, StagedMoDEBlock])
def test_mod_block_with_triton_kernels_equals_torch_kernels(block_cls):
    torch.manual_seed(1)
    ref = block_cls(32, 4, capacity=0.25)
    fast = block_cls(32, 4, capacity=0.25, kernels="triton")
    fast.load_state_dict(ref.state_dict())
    x = torch.randn(2, 16, 32)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref, out_fast = ref(xa), fast(xb)
    assert_close(out_fast, out_ref, "elementwise")
    out_ref.square().sum().backward()
    out_fast.square().sum().backward()
    assert_close(xb.grad, xa.grad, "reduction")
    for (name, p), q in zip(ref.named_parameters(), fast.parameters(), strict=True):
        if p.grad is not None:
            assert_close(q.grad, p.grad, "reduction", msg=name)


def test_take_tokens_torch_and_triton_agree_on_the_same_contract():
    x = torch.randn(3, 10, 24)
    indices, rows = _chosen_rows(3, 10, 4)
    a_sel, a_alias = take_tokens(x, indices, rows)
    b_sel, b_alias = take_tokens(x, indices, rows, mod_tokens)
    assert torch.equal(a_sel, b_sel) and torch.equal(a_alias, b_alias)


# --- ScatterMoE-style expert GEMMs ---------------------------------------------------------


def _assignments(N: int, K: int, E: int, pattern: str, n_noop: int = 0):
    """Expert ids [N, K] (distinct per token): 'random', 'one_empty' (expert 1 gets nothing),
    'all_to_one' (top-1: every token to expert 0); ids >= E are no-op experts."""
    if pattern == "all_to_one":
        return torch.zeros(N, K, dtype=torch.long)
    pool = [e for e in range(E + n_noop) if not (pattern == "one_empty" and e == 1)]
    return torch.stack([torch.tensor(pool)[torch.randperm(len(pool))[:K]] for _ in range(N)])


def _dispatch(experts: torch.Tensor, E: int):
    """The sorted-assignment index the MoE layer builds: (rows, slots, counts) for ids < E."""
    flat = experts.reshape(-1)
    order = torch.sort(torch.where(flat < E, flat, E), stable=True).indices
    counts = torch.bincount(flat[flat < E], minlength=E)
    order = order[: int(counts.sum())]
    return torch.div(order, experts.shape[1], rounding_mode="floor"), order, counts


def _experts_reference(x, w1, w2, weights, rows, counts, N):
    """Slow and obvious: every assignment's MLP, one at a time, summed into its token."""
    expert_of = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    out = x.new_zeros(N, w2.shape[-1])
    for m in range(rows.numel()):
        e, n = int(expert_of[m]), int(rows[m])
        out = out.index_add(0, rows[m : m + 1], (weights[m] * (F.gelu(x[n] @ w1[e]) @ w2[e]))[None])
    return out


GEMM_CASES = [  # (N, K, E, D, F, pattern, n_noop)
    (37, 2, 5, 40, 24, "random", 0),
    (29, 2, 4, 24, 40, "one_empty", 0),
    (19, 1, 3, 16, 48, "all_to_one", 0),
    (23, 2, 4, 32, 16, "random", 2),  # no-op experts: M < N * K
    (1, 2, 4, 20, 16, "random", 0),
]


@pytest.mark.parametrize(("N", "K", "E", "D", "F_", "pattern", "n_noop"), GEMM_CASES)
def test_scattered_expert_gemms_match_reference(N, K, E, D, F_, pattern, n_noop):
    experts = _assignments(N, K, E, pattern, n_noop)
    rows, slots, counts = _dispatch(experts, E)
    leaves = [torch.randn(N, D), torch.randn(E, D, F_) / D**0.5, torch.randn(E, F_, D) / F_**0.5]
    leaves.append(torch.rand(rows.numel()))
    fast = [t.clone().requires_grad_() for t in leaves]
    slow = [t.clone().requires_grad_() for t in leaves]
    h = scattered.scattered_gemm(fast[0], fast[1], rows, slots, counts, K)
    out = scattered.gemm_combine(F.gelu(h), fast[2], fast[3], rows, slots, counts, K, N)
    ref = _experts_reference(*slow, rows, counts, N)
    assert_close(out, ref, "layer")
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    for name, a, b in zip(("x", "w1", "w2", "weights"), fast, slow, strict=True):
        assert_close(a.grad, b.grad, "layer_grad", msg=name)
    if pattern == "one_empty":  # an expert without tokens gets exactly zero weight gradient
        assert not fast[1].grad[1].any() and not fast[2].grad[1].any()


def test_scattered_expert_gemms_in_bf16_are_close_to_the_fp32_reference():
    N, K, E, D, F_ = 31, 2, 4, 48, 32
    rows, slots, counts = _dispatch(_assignments(N, K, E, "random"), E)
    leaves = [torch.randn(N, D), torch.randn(E, D, F_) / D**0.5, torch.randn(E, F_, D) / F_**0.5]
    leaves.append(torch.rand(rows.numel()))
    fast = [t.bfloat16().requires_grad_() for t in leaves[:3]] + [leaves[3].clone().requires_grad_()]
    slow = [t.clone().requires_grad_() for t in leaves]
    h = scattered.scattered_gemm(fast[0], fast[1], rows, slots, counts, K)
    out = scattered.gemm_combine(F.gelu(h), fast[2], fast[3], rows, slots, counts, K, N)
    assert out.dtype == torch.bfloat16
    ref = _experts_reference(*slow, rows, counts, N)
    assert_close(out, ref, "layer")
    g = torch.randn_like(ref)
    out.backward(g.bfloat16())
    ref.backward(g)
    for name, a, b in zip(("x", "w1", "w2", "weights"), fast, slow, strict=True):
        assert_close(a.grad, b.grad, "layer_grad", dtype=torch.bfloat16, msg=name)


@pytest.mark.parametrize("counts", [[5, 0, 9, 3], [17, 0, 0, 0], [0, 0, 0, 0]])
def test_triton_grouped_mm_equals_loop(counts):
    counts = torch.tensor(counts)
    x = torch.randn(int(counts.sum()), 40, requires_grad=True)
    w = torch.randn(4, 40, 24, requires_grad=True)
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    out, ref = scattered.grouped_mm(x, w, counts), gmm_loop(xr, wr, counts)
    assert_close(out, ref, "layer")
    if out.numel():
        g = torch.randn_like(out)
        out.backward(g)
        ref.backward(g)
        assert_close(x.grad, xr.grad, "layer")
        assert_close(w.grad, wr.grad, "layer")


@pytest.mark.parametrize("counts", [[5, 0, 9, 3], [0, 0, 0], [64, 1], [16, 16, 16]])
def test_tile_schedule_covers_each_row_once_within_one_expert(counts):
    counts = torch.tensor(counts)
    block = 16
    expert, start, end = scatter_gemm.tile_schedule(counts, int(counts.sum()), block)
    ends = torch.cumsum(counts, 0)
    covered = []
    for e, a, b in zip(expert.tolist(), start.tolist(), end.tolist(), strict=True):
        rows = list(range(a, min(a + block, b)))
        if rows:  # every row of the tile belongs to expert e
            assert int(ends[e] - counts[e]) <= rows[0] and rows[-1] < int(ends[e])
        covered += rows
    assert sorted(covered) == list(range(int(counts.sum())))


@pytest.mark.parametrize(("mlp", "n_noop"), [("gelu", 0), ("swiglu", 0), ("gelu", 2)])
def test_moe_layer_on_triton_backend_equals_loop_backend(mlp, n_noop):
    torch.manual_seed(2)
    ref = DroplessMoE(32, 48, 4, 2, mlp=mlp, backend="loop", n_noop=n_noop)
    fast = DroplessMoE(32, 48, 4, 2, mlp=mlp, backend="triton", n_noop=n_noop)
    fast.load_state_dict(ref.state_dict())
    x = torch.randn(2, 11, 32)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref, out_fast = ref(xa), fast(xb)
    assert_close(out_fast, out_ref, "layer")
    out_ref.square().sum().backward()
    out_fast.square().sum().backward()
    assert_close(xb.grad, xa.grad, "layer_grad")
    for (name, p), q in zip(ref.named_parameters(), fast.parameters(), strict=True):
        if p.grad is not None:
            assert_close(q.grad, p.grad, "layer_grad", msg=name)


# --- where the kernels can run ---------------------------------------------------------------


def test_triton_on_cpu_without_the_interpreter_says_it_needs_cuda(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "CUDA" in triton_unavailable_reason("cpu")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        MoDBlock(16, 2, kernels="triton")(torch.randn(1, 8, 16))
    with pytest.raises(RuntimeError, match="CUDA"):
        DroplessMoE(16, 32, 4, 2, backend="triton")(torch.randn(8, 16))


def test_mode_imports_without_triton_and_asking_for_it_says_what_to_install():
    # A stand-in for a machine without Triton: its import is blocked in a fresh interpreter.
    code = """
import sys
sys.modules["triton"] = None
import torch
import mode
from mode.experts.grouped_gemm import resolve_name
from mode.experts.moe import DroplessMoE
from mode.layers.mod import MoDBlock
assert resolve_name("auto", "cuda", torch.float32, 64, 64) == "loop"
for build in (lambda: MoDBlock(16, 2, kernels="triton"),
              lambda: DroplessMoE(16, 32, 4, 2, backend="triton")(torch.randn(4, 16))):
    try:
        build()
    except RuntimeError as e:
        assert "pip install triton" in str(e), e
    else:
        raise AssertionError("no error")
print("ok")
"""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")


# --- on a GPU --------------------------------------------------------------------------------


@pytest.mark.cuda
def test_kernels_on_cuda_in_bf16_match_the_torch_paths():
    torch.manual_seed(3)
    ref = DroplessMoE(256, 352, 8, 2, backend="loop").cuda()
    fast = DroplessMoE(256, 352, 8, 2, backend="triton").cuda()
    fast.load_state_dict(ref.state_dict())
    mod_ref = MoDBlock(256, 4, capacity=0.125).cuda()
    mod_fast = MoDBlock(256, 4, capacity=0.125, kernels="triton").cuda()
    mod_fast.load_state_dict(mod_ref.state_dict())
    x = torch.randn(4, 300, 256, device="cuda")
    for ref_layer, fast_layer in ((ref, fast), (mod_ref, mod_fast)):
        with torch.autocast("cuda", torch.bfloat16):
            out_ref, out_fast = ref_layer(x), fast_layer(x)
        assert_close(out_fast, out_ref, "layer")
        g = torch.randn_like(out_ref)
        out_ref.backward(g)
        out_fast.backward(g)
        for (name, p), q in zip(ref_layer.named_parameters(), fast_layer.parameters(), strict=True):
            if p.grad is not None:  # bf16 GEMMs: compare relative to the gradient's scale
                scale = p.grad.float().abs().max().clamp_min(1e-6)
                assert (q.grad.float() - p.grad.float()).abs().max() / scale < 5e-2, name
