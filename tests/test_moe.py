import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mode
from mode.experts.chunked import chunked_experts
from mode.experts.grouped_gemm import CHUNKED_MIN_BYTES, get_backend, gmm_loop, gmm_torch, resolve_name
from mode.experts.moe import CapacityMoE, DroplessMoE, ExpertChoiceMoE
from mode.experts.permute import (
    combine,
    padded_combine,
    padded_dispatch,
    permute,
    sort_by_expert,
    sorted_weights,
    unpermute,
)
from mode.kernels import triton_missing_reason
from mode.layers.blocks import MoEBlock
from mode.routing.token_choice import capacity_keep, expert_capacity
from tests.reference import moe_reference
from tests.tolerances import assert_close

D, F_, E, N = 16, 32, 4, 24


def make(cls=DroplessMoE, top_k=2, **kw):
    layer = cls(D, F_, E, top_k, **kw)
    torch.nn.init.normal_(layer.router.weight, std=0.5)
    for w in (layer.experts.w1, layer.experts.w2):
        torch.nn.init.normal_(w, std=0.3)
    return layer


def grads_of(out, layer, x, g):
    params = [x, layer.router.weight, layer.experts.w1, layer.experts.w2]
    return torch.autograd.grad(out, params, g, allow_unused=True)


def assert_matches_reference(layer, x, **ref_kw):
    out = layer(x)
    ref = moe_reference(layer, x, **ref_kw)
    assert_close(out, ref, "layer_grad")
    g = torch.randn_like(out)
    for a, b, name in zip(
        grads_of(out, layer, x, g), grads_of(ref, layer, x, g), ["x", "router", "w1", "w2"], strict=True
    ):
        assert_close(a, b, "layer_grad", msg=name)
        assert b.abs().max() > 1e-3, name  # the gradient is far above atol
    return out


CASES = [(k, b) for k in (1, 2) for b in ("loop", "torch", "chunked")]


@pytest.mark.parametrize("top_k,backend", CASES, ids=[f"top{k}-{b}" for k, b in CASES])
def test_dropless_equals_loop_reference(top_k, backend):
    layer = make(top_k=top_k, backend=backend)
    assert_matches_reference(layer, torch.randn(N, D, requires_grad=True))


@pytest.mark.parametrize("top_k,backend", CASES, ids=[f"top{k}-{b}" for k, b in CASES])
def test_dropless_with_one_expert_taking_all_tokens(top_k, backend):
    layer = make(top_k=top_k, backend=backend)
    with torch.no_grad():
        layer.router.weight.fill_(-0.1)
        layer.router.weight[0].fill_(0.1)  # x > 0: every token's first choice is expert 0
        layer.router.weight[1, 0] = 0.5  # second choice always expert 1; experts 2, 3 get nothing
    x = (torch.rand(N, D) + 0.1).requires_grad_(True)
    assert_matches_reference(layer, x)
    load = layer.metrics["load"]
    assert load[0] == pytest.approx(1.0 / top_k) and load[3] == 0


@pytest.mark.parametrize("materialized", [False, True], ids=["expanded-grad", "materialized-grad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_torch_grouped_mm_autograd_equals_loop(materialized, dtype):
    counts = torch.tensor([5, 0, 12, 3, 0, 8])
    x = torch.randn(int(counts.sum()), 16, dtype=dtype, requires_grad=True)
    w = torch.randn(6, 16, 32, dtype=dtype, requires_grad=True)
    grads = []
    for fn in (gmm_torch, gmm_loop):
        y = fn(x, w, counts)
        if materialized:
            y.backward(torch.ones_like(y) * 0.5)
        else:
            y.sum().backward()  # an expanded, zero-stride incoming gradient
        grads.append((y.detach(), x.grad.clone(), w.grad.clone()))
        x.grad = w.grad = None
    for a, b in zip(grads[0], grads[1], strict=True):
        assert_close(a, b, "layer_grad")
    assert torch.all(grads[0][2][[1, 4]] == 0)  # experts with no rows get zero weight gradient


def test_torch_backend_odd_row_count_backward():
    counts = torch.tensor([3, 2, 0])  # 5 rows: not a multiple of the 16-byte alignment
    x = torch.randn(5, 8, requires_grad=True)
    w = torch.randn(3, 8, 8, requires_grad=True)
    gmm_torch(x, w, counts).sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    gmm_loop(x, w, counts).sum().backward()
    assert_close(gx, x.grad, "layer_grad")
    assert_close(gw, w.grad, "layer_grad")


@pytest.mark.parametrize("policy", ["position", "probs"])
@pytest.mark.parametrize("top_k", [1, 2])
def test_capacity_drops_exactly_the_documented_overflow(policy, top_k):
    layer = make(CapacityMoE, top_k=top_k, capacity_factor=0.75, drop_policy=policy)
    with torch.no_grad():
        layer.router.weight[0] += 0.4  # skew toward expert 0 so it overflows
    x = torch.randn(N, D, requires_grad=True)
    C = layer.capacity(N)
    assert C == expert_capacity(N, top_k, E, 0.75)
    assert_matches_reference(layer, x, capacity=C, policy=policy)
    assert layer.metrics["drop_fraction"] > 0


def test_capacity_keep_hand_worked():
    # 4 tokens, top-1, 2 experts with capacity 2: token order decides ("position").
    experts = torch.tensor([[0], [0], [1], [0]])
    weights = torch.tensor([[0.2], [0.9], [0.5], [0.7]])
    assert capacity_keep(experts, weights, 2, 2, "position").view(-1).tolist() == [True, True, True, False]
    assert capacity_keep(experts, weights, 2, 2, "probs").view(-1).tolist() == [False, True, True, True]
    # top-2: all first choices are served before any second choice.
    experts2 = torch.tensor([[1, 0], [0, 1], [0, 1]])
    keep = capacity_keep(experts2, torch.ones(3, 2), 2, 2, "position")
    assert keep.tolist() == [[True, False], [True, True], [True, False]]


def test_capacity_equals_dropless_when_capacity_is_large():
    dropless = make(top_k=2)
    cap = CapacityMoE(D, F_, E, 2, capacity_factor=float(E))  # C >= N: nothing can drop
    cap.load_state_dict(dropless.state_dict())  # same parameters: one checkpoint loads in both
    x = torch.randn(N, D)
    assert_close(cap(x), dropless(x), "layer_grad")
    assert cap.metrics["drop_fraction"] == 0


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 30), e=st.integers(1, 6), k=st.integers(1, 3), seed=st.integers(0, 1000))
def test_property_permute_then_unpermute_is_identity(n, e, k, seed):
    k = min(k, e)
    gen = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
    x = torch.randn(n, 5, generator=gen)
    dispatch = sort_by_expert(experts, e)
    xs = permute(x, dispatch)
    assert dispatch.counts.tolist() == torch.bincount(experts.view(-1), minlength=e).tolist()
    sorted_experts = experts.view(-1)[dispatch.order]
    assert torch.all(sorted_experts[1:] >= sorted_experts[:-1])  # grouped by expert
    w = torch.full((dispatch.order.numel(),), 1.0 / k)
    assert_close(unpermute(xs, dispatch.token_idx, w, n), x, "layer_grad")
    assert_close(combine(xs, dispatch, torch.full((n, k), 1.0 / k)), x, "layer_grad")


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 20), e=st.integers(2, 5), k=st.integers(1, 2), drop=st.floats(0, 1), seed=st.integers(0, 99))
def test_property_combine_equals_unpermute_with_drops(n, e, k, drop, seed):
    gen = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
    keep = torch.rand(n, k, generator=gen) >= drop
    dispatch = sort_by_expert(experts, e, keep)
    y = torch.randn(dispatch.order.numel(), 4, generator=gen, requires_grad=True)
    w = torch.rand(n, k, generator=gen, requires_grad=True)
    fast = combine(y, dispatch, w)
    M = int(dispatch.counts.sum())  # rows past the computed ones (the scratch row) are never read
    assert dispatch.order.numel() == n * k + 1 and int(keep.sum()) == M
    ref = unpermute(y[:M], dispatch.token_idx[:M], sorted_weights(w, dispatch)[:M], n)
    assert_close(fast, ref, "layer_grad")
    g = torch.randn(n, 4, generator=gen)
    for a, b in zip(
        torch.autograd.grad(fast, [y, w], g, allow_unused=True),
        torch.autograd.grad(ref, [y, w], g, allow_unused=True),
        strict=True,
    ):
        if b is None or a is None:
            assert a is None or a.abs().max() == 0
            continue
        assert_close(a, b, "layer_grad")


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 20), e=st.integers(2, 5), k=st.integers(1, 2), drop=st.floats(0, 1), seed=st.integers(0, 99))
def test_property_permute_gradient_equals_index_select(n, e, k, drop, seed):
    """The fused permute backward (a per-token gather-sum) equals autograd of a plain gather."""
    gen = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(e + 1, generator=gen)[:k] for _ in range(n)])  # id e = no-op
    keep = torch.rand(n, k, generator=gen) >= drop
    dispatch = sort_by_expert(experts, e, keep, has_noop=True)
    x = torch.randn(n, 3, generator=gen, requires_grad=True)
    fast = permute(x, dispatch)
    ref = x[torch.div(dispatch.order, k, rounding_mode="floor")]
    assert_close(fast, ref, "exact")
    g = torch.randn_like(ref)
    # Rows past the computed ones (no-op, dropped, the scratch row) carry no gradient back.
    computed_rows = (torch.arange(ref.shape[0]) < dispatch.counts.sum()).unsqueeze(1)
    ref_grad = torch.autograd.grad(ref, x, g * computed_rows)[0]
    assert_close(torch.autograd.grad(fast, x, g)[0], ref_grad, "layer_grad")


@pytest.mark.parametrize("keep_all", [True, False])
def test_permute_and_combine_gradcheck(keep_all):
    gen = torch.Generator().manual_seed(0)
    n, e, k = 7, 3, 2
    experts = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
    keep = None if keep_all else torch.rand(n, k, generator=gen) > 0.3
    dispatch = sort_by_expert(experts, e, keep)
    x = torch.randn(n, 4, dtype=torch.float64, requires_grad=True)
    w = torch.rand(n, k, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: combine(permute(x, dispatch).sin(), dispatch, w), (x, w))


def padded_case(n: int, k: int, n_rows: int, dtype: torch.dtype, seed: int = 0):
    """Distinct slots for placed assignments (as the capacity rule gives), junk for the rest."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(n_rows, generator=gen)[: n * k].view(n, k)
    placed = torch.rand(n, k, generator=gen) > 0.3
    slots = torch.where(placed, slots, torch.randint(0, 10**6, (n, k), generator=gen))
    x = torch.randn(n, 5, generator=gen).to(dtype).requires_grad_()
    w = torch.rand(n, k, generator=gen).to(dtype).requires_grad_()
    return x, w, slots, placed


def padded_reference(x, w, slots, placed, n_rows):
    """Row by row: buffer[slot] = x[n]; a stand-in expert (sin); out[n] = sum_j w * buffer'[slot]."""
    buffer = x.new_zeros(n_rows, x.shape[1])
    for n, j in placed.nonzero().tolist():
        buffer = buffer.index_put((slots[n, j : j + 1],), x[n : n + 1])
    y = buffer.sin()
    rows = [
        sum((w[n, j] * y[slots[n, j]] for j in range(w.shape[1]) if placed[n, j]), x.new_zeros(x.shape[1]))
        for n in range(x.shape[0])
    ]
    return torch.stack(rows)


def test_padded_dispatch_and_combine_gradcheck():
    x, w, slots, placed = padded_case(6, 2, 16, torch.float64)
    f = lambda x, w: padded_combine(padded_dispatch(x, slots, placed, 16).sin(), slots, placed, w)  # noqa: E731
    assert torch.autograd.gradcheck(f, (x, w))
    assert_close(f(x, w), padded_reference(x, w, slots, placed, 16), "elementwise")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_combine_matches_reference_in_low_precision(dtype):
    # bf16 is the case that broke on CUDA (no bf16 kernel for embedding_bag's weight gradient).
    x, w, slots, placed = padded_case(33, 3, 128, dtype, seed=1)
    g = torch.randn(33, 5, dtype=dtype)
    out = padded_combine(padded_dispatch(x, slots, placed, 128).sin(), slots, placed, w)
    grads = torch.autograd.grad(out, (x, w), g)
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    ref = padded_reference(x64, w64, slots, placed, 128)
    ref_grads = torch.autograd.grad(ref, (x64, w64), g.double())
    assert_close(out, ref, "layer")
    for got, want in zip(grads, ref_grads, strict=True):
        assert_close(got, want, "layer")


def test_expert_choice_router_matches_reference():
    layer = make(ExpertChoiceMoE, capacity_factor=1.0)
    x = torch.randn(N, D)
    probs = torch.softmax(layer.router(x).float(), dim=-1)
    C = expert_capacity(N, 2, E, 1.0)
    ref = torch.zeros(N, D)
    for e in range(E):
        top = sorted(range(N), key=lambda n: (-probs[n, e].item(), n))[:C]
        for n in top:
            ref[n] += probs[n, e] * (torch.nn.functional.gelu(x[n] @ layer.experts.w1[e]) @ layer.experts.w2[e])
    assert_close(layer(x), ref, "layer_grad")
    assert layer.metrics["dispatched"] == E * C


@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_shared_expert_and_swiglu(mlp):
    layer = DroplessMoE(D, F_, E, 2, mlp=mlp, shared_expert=True)
    x = torch.randn(N, D)
    out = layer(x)
    layer.shared = None
    routed = layer(x)
    assert (out - routed).abs().max() > 0  # the shared expert contributes
    assert out.shape == x.shape


def test_auto_backend_on_cpu_chooses_by_size():
    """``auto`` runs small batches through the grouped path and large ones chunked, and the
    layer's output is the same either way."""
    layer = make()
    x = torch.randn(2, 8, D)
    assert not layer.experts.uses_scattered(x.view(-1, D), rows=16)
    assert layer.experts.uses_scattered(x.view(-1, D), rows=CHUNKED_MIN_BYTES // (D * 4))
    # Under bf16 autocast the experts compute in bf16 (2 bytes a value): the size rule uses
    # that dtype, not x's float32, so this many rows still fit the grouped path.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not layer.experts.uses_scattered(x.view(-1, D), rows=CHUNKED_MIN_BYTES // (D * 4))
        assert layer.experts.uses_scattered(x.view(-1, D), rows=CHUNKED_MIN_BYTES // (D * 2))
    chunked = make(backend="chunked")
    chunked.load_state_dict(layer.state_dict())
    assert_close(layer(x), chunked(x), "layer_grad")


@pytest.mark.slow
def test_moe_block_torch_compile_chunked_backend():
    """Compiled, ``chunked`` takes the grouped path (static shapes); eager takes chunked. (The
    choice is made while dynamo traces: AOT autograd without code generation shows it.)"""
    layer = make(backend="chunked")
    blk = MoEBlock(D, 4, layer)
    x = torch.randn(2, 8, D)
    assert layer.experts.uses_scattered(x)
    assert_close(torch.compile(blk, backend="aot_eager", fullgraph=True)(x), blk(x), "layer_grad")


@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
@pytest.mark.parametrize("n_noop", [0, 2])
def test_chunked_equals_grouped_path(mlp, n_noop):
    """Values and every gradient (x, router, w1, w2, w3) of the fused chunked path equal the
    permute -> grouped GEMM -> combine path, with no-op experts (fewer than N*K assignments)."""
    torch.manual_seed(0)
    chunked = make(mlp=mlp, n_noop=n_noop, backend="chunked")
    if chunked.experts.w3 is not None:
        torch.nn.init.normal_(chunked.experts.w3, std=0.3)
    grouped = make(mlp=mlp, n_noop=n_noop, backend="loop")
    grouped.load_state_dict(chunked.state_dict())
    x = torch.randn(N, D, requires_grad=True)
    outs = [layer(x) for layer in (chunked, grouped)]
    assert_close(outs[0], outs[1], "layer_grad")
    if n_noop:
        assert 0 < chunked.metrics["dispatched"] < N * 2  # some assignments went to no-op experts
    g = torch.randn_like(outs[0])
    grads = []
    for layer, out in zip((chunked, grouped), outs, strict=True):
        params = [x, layer.router.weight] + [
            w for w in (layer.experts.w1, layer.experts.w2, layer.experts.w3) if w is not None
        ]
        grads.append(torch.autograd.grad(out, params, g))
    for a, b in zip(*grads, strict=True):
        assert_close(a, b, "layer_grad")
        assert b.abs().max() > 1e-3


def test_chunked_under_autocast_equals_torch_backend():
    """Under CPU autocast both expert paths compute in autocast's dtype (bf16: the experts cast
    themselves, as autocast does for linears) and agree; gradients reach the fp32 weights."""
    chunked, grouped = make(backend="chunked"), make(backend="torch")
    grouped.load_state_dict(chunked.state_dict())
    x = torch.randn(N, D, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = [layer(x) for layer in (chunked, grouped)]
    assert outs[0].dtype == outs[1].dtype == torch.bfloat16
    assert_close(outs[0], outs[1], "reduction")
    layers = (chunked, grouped)
    grads = [torch.autograd.grad(o.float().sum(), [x, layer.experts.w1]) for o, layer in zip(outs, layers, strict=True)]
    for a, b in zip(*grads, strict=True):
        assert a.dtype == b.dtype == torch.float32
        assert_close(a, b, "reduction", dtype=torch.bfloat16)


@pytest.mark.parametrize("swiglu", [False, True], ids=["gelu", "swiglu"])
def test_chunked_experts_gradcheck(swiglu):
    gen = torch.Generator().manual_seed(0)
    n, d, f, e = 5, 3, 4, 3
    x = torch.randn(n, d, dtype=torch.float64, requires_grad=True)
    token_idx = torch.tensor([0, 3, 1, 2, 4, 0, 1])  # expert 1 gets no tokens
    counts = torch.tensor([4, 0, 3])
    weights = torch.rand(7, dtype=torch.float64, generator=gen, requires_grad=True)
    ws = [torch.randn(e, d, f, dtype=torch.float64, generator=gen).requires_grad_() for _ in range(3)]
    w2 = ws[1].transpose(1, 2).contiguous().detach().requires_grad_()
    w3 = ws[2] if swiglu else None
    inputs = (x, weights, ws[0], w2) + ((w3,) if swiglu else ())

    def fn(x, weights, w1, w2, w3=None):
        return chunked_experts(x, token_idx, counts, weights, w1, w2, w3)

    assert torch.autograd.gradcheck(fn, inputs)


def test_chunked_experts_rejects_inconsistent_inputs():
    x, w = torch.randn(4, 3), torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match="counts sum to 3"):
        chunked_experts(x, torch.tensor([0, 1]), torch.tensor([2, 1]), torch.ones(2), w, w.transpose(1, 2))
    with pytest.raises(ValueError, match="must be equal"):
        chunked_experts(x, torch.tensor([0, 1]), torch.tensor([1, 1]), torch.ones(3), w, w.transpose(1, 2))


def test_backend_registry_explains_itself():
    assert resolve_name("auto", "cpu", torch.float32, 512, 1024) == "chunked"  # size unknown
    # On CPU, auto is chunked once the [M, D] sorted-token buffer reaches CHUNKED_MIN_BYTES:
    big = CHUNKED_MIN_BYTES // (512 * 4)  # rows of fp32 d 512 that make the buffer that size
    assert resolve_name("auto", "cpu", torch.float32, 512, 1024, rows=big) == "chunked"
    assert resolve_name("auto", "cpu", torch.float32, 512, 1024, rows=big - 1) == "torch"
    assert resolve_name("auto", "cpu", torch.bfloat16, 512, 1024, rows=big) == "torch"  # half the bytes
    assert resolve_name("auto", "cpu", torch.float64, 512, 1024, rows=8) == "loop"  # no grouped_mm
    assert resolve_name("auto", "cuda", torch.bfloat16, 512, 1024) in ("megablocks", "torch")
    # CUDA grouped_mm is bf16/fp16 only: fp32 goes to our Triton kernels where importable, else loop.
    fp32_cuda = "loop" if triton_missing_reason() else "triton"
    assert resolve_name("auto", "cuda", torch.float32, 512, 1024) == fp32_cuda
    # chunked's grouped GEMM (tokens that arrive sorted, e.g. expert parallelism):
    assert get_backend("chunked", "cpu", torch.float32, 512, 1024) is gmm_torch
    assert get_backend("chunked", "cpu", torch.float64, 512, 1024) is gmm_loop
    assert get_backend("chunked", "cpu", torch.float32, 6, 10) is gmm_loop  # rows not 16-byte aligned
    with pytest.raises(RuntimeError, match="CUDA"):
        get_backend("megablocks", "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="backend"):
        get_backend("cutlass_magic")


def test_backend_table_is_the_one_source():
    """Every backend is one row: the option's choices, auto's CUDA order, the entry point an
    ExpertMLP takes and the GEMM it calls all come from ``GEMM_BACKENDS``; each row's GEMM
    equals the per-expert loop (an independent reference: one matmul per group) where it runs."""
    from mode.experts.grouped_gemm import AUTO_CUDA_ORDER, GEMM_BACKENDS, backend
    from mode.experts.moe import MoEConfig

    names = [b.name for b in GEMM_BACKENDS]
    assert len(set(names)) == len(names)
    assert AUTO_CUDA_ORDER == ("megablocks", "torch", "triton", "loop")
    for name in names:
        MoEConfig(backend=name)  # accepted by the option
        assert DroplessMoE(8, 16, 2, 1, backend=name).experts.backend == name
    with pytest.raises(ValueError, match="closest|choose one of"):
        MoEConfig(backend="chunkd")
    torch.manual_seed(0)
    x, w, counts = torch.randn(12, 16), torch.randn(3, 16, 8), torch.tensor([5, 0, 6])  # 1 scratch row
    want = torch.cat([x[:5] @ w[0], x[5:11] @ w[2]])
    for row in GEMM_BACKENDS:
        assert row.entry in ("sorted", "scattered") and backend(row.name) is row
        if row.unavailable(torch.device("cpu"), torch.float32, 16, 8) is None and row.name != "triton":
            got = get_backend(row.name, "cpu", torch.float32, 16, 8)(x, w, counts)
            assert_close(got[:11], want, "layer")


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"top_k": 5}, "top_k"),
        ({"capacity_factor": 0.0}, "capacity_factor"),
        ({"backend": "nope"}, "backend"),
        ({"drop_policy": "random"}, "drop_policy"),
    ],
    ids=["top_k>E", "capacity_factor<=0", "unknown-backend", "bad-policy"],
)
def test_bad_layer_arguments(kwargs, field):
    args = {"top_k": 2, **kwargs}
    with pytest.raises(ValueError, match=field):
        CapacityMoE(D, F_, E, **args)


@pytest.mark.parametrize("n_noop", [0, 3], ids=["plain", "noop"])
def test_token_moves_index_equals_embedding_bag(n_noop):
    """The two ways of moving token rows (``model.moe.token_moves``) give the same layer:
    outputs and the gradients of the input, the router and the experts."""
    torch.manual_seed(0)
    layers = {
        m: DroplessMoE(24, 32, 4, 2, backend="torch", n_noop=n_noop, token_moves=m) for m in ("embedding_bag", "index")
    }
    with torch.no_grad():  # weights far from zero, so the gradients are far above the tolerance
        for p in layers["embedding_bag"].experts.parameters():
            p.mul_(10)
    layers["index"].load_state_dict(layers["embedding_bag"].state_dict())
    x = torch.randn(2, 16, 24)
    grads = {}
    for name, layer in layers.items():
        xi = x.clone().requires_grad_(True)
        out = layer(xi)
        (out.square().sum() + mode.aux_loss(layer)).backward()
        grads[name] = (out.detach(), xi.grad, *(p.grad for p in layer.parameters()))
    assert grads["index"][1].abs().max() > 1e-3  # a gradient far above the tolerance
    for a, b in zip(grads["index"], grads["embedding_bag"], strict=True):
        assert_close(a, b, "layer_grad")


def test_token_moves_is_checked():
    with pytest.raises(ValueError, match="token_moves"):
        DroplessMoE(24, 32, 4, 2, token_moves="scatter")
