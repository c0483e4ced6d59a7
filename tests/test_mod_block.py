import pytest
import torch

from mode.layers.attention import CausalSelfAttention
from mode.layers.blocks import DenseBlock
from mode.layers.mod import MoDBlock
from tests.reference import attention_reference, mod_block_reference
from tests.tolerances import assert_close

D, H = 32, 4
ATOL_F32 = 1e-5


def make_block(capacity=0.25, gate="sigmoid", dtype=torch.float32):
    blk = MoDBlock(D, H, capacity=capacity, gate=gate).to(dtype)
    torch.nn.init.normal_(blk.router.weight, std=0.5)
    return blk


@pytest.mark.parametrize("gate", ["sigmoid", "identity", "none"])
def test_matches_loop_reference_values_and_grads(gate):
    blk = make_block(0.25, gate)
    x = torch.randn(3, 16, D, requires_grad=True)
    out = blk(x)
    ref = mod_block_reference(blk, x)
    assert_close(out, ref, "layer")
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, *blk.parameters()], g, allow_unused=True)
    ref_grads = torch.autograd.grad(ref, [x, *blk.parameters()], g, allow_unused=True)
    for a, b in zip(grads, ref_grads, strict=True):
        if a is None:
            assert b is None
            continue
        assert_close(a, b, "layer_grad")


def test_residual_form_and_unrouted_bit_exact():
    blk = make_block(0.25)
    x = torch.randn(2, 16, D)
    out = blk(x)
    scores = blk.router_logits(x)
    from mode.layers.mod_moves import gather_tokens
    from mode.routing.mod_topk import expert_choice_topk

    plan = expert_choice_topk(scores, 0.25)
    assert torch.equal(out[~plan.mask], x[~plan.mask])  # bit-exact
    delta = blk.block.delta(gather_tokens(x, plan.indices), plan.indices)
    expected = gather_tokens(x, plan.indices) + torch.sigmoid(plan.weights)[..., None] * delta
    assert_close(gather_tokens(out, plan.indices), expected, "layer")
    # Never g(r) * (x + f(x)): that would scale the residual stream itself.
    wrong = torch.sigmoid(plan.weights)[..., None] * (gather_tokens(x, plan.indices) + delta)
    assert (gather_tokens(out, plan.indices) - wrong).abs().max() > 1e-2


def test_capacity_zero_is_identity():
    blk = make_block(0.0)
    x = torch.randn(2, 16, D)
    assert torch.equal(blk(x), x)


def test_capacity_one_with_unit_gate_equals_dense():
    blk = make_block(1.0, gate="none")
    dense = DenseBlock(D, H)
    dense.load_state_dict(blk.block.state_dict())
    x = torch.randn(2, 16, D)
    assert_close(blk(x), dense(x), "layer")


def test_router_gradcheck_float64():
    torch.manual_seed(1)
    blk = make_block(0.5, dtype=torch.float64)
    x = torch.randn(1, 6, D, dtype=torch.float64)
    w_router = blk.router.weight.detach().clone().requires_grad_(True)
    w_fc = blk.block.mlp.fc.weight.detach().clone().requires_grad_(True)

    def f(wr, wf):
        params = {"router.weight": wr, "block.mlp.fc.weight": wf}
        return torch.func.functional_call(blk, params, (x,))

    # Finite differences never flip the top-k choice here: the scores are far apart.
    scores = blk.router_logits(x)[0].sort().values
    assert (scores[1:] - scores[:-1]).min() > 1e-4
    assert torch.autograd.gradcheck(f, (w_router, w_fc), eps=1e-6, atol=1e-5)
    out = f(w_router, w_fc)
    (gr,) = torch.autograd.grad(out.pow(2).sum(), w_router)
    assert gr.abs().max() > 1e-3  # the router really receives gradient


def test_batch_independence():
    blk = make_block(0.25)
    x = torch.randn(4, 16, D)
    full = blk(x)
    for b in range(4):
        assert_close(blk(x[b : b + 1]), full[b : b + 1], "layer")
    x2 = x.clone()
    x2[0] = torch.randn(16, D)  # changing row 0 leaves the others untouched
    assert torch.equal(blk(x2)[1:], full[1:])


def test_chosen_token_attention_equals_restricted_dense_attention():
    attn = CausalSelfAttention(D, H)
    B, T = 2, 12
    x = torch.randn(B, T, D)
    chosen = torch.tensor([[0, 3, 4, 9], [2, 5, 10, 11]])
    sub = attn(torch.gather(x, 1, chosen[..., None].expand(-1, -1, D)), chosen)
    # Dense attention over all T tokens at their own positions, keys restricted to the chosen set.
    pos = torch.arange(T).expand(B, T)
    q, k, v = attn.project_qkv(x, pos)
    member = torch.zeros(B, T, dtype=torch.bool).scatter_(1, chosen, True)
    allowed = torch.tril(torch.ones(T, T, dtype=torch.bool))[None] & member[:, None, :]
    ref = attn.output(attention_reference(q, k, v, allowed))
    assert_close(sub, ref.gather(1, chosen[..., None].expand(-1, -1, D)), "layer")
    # Wrong positions (0..k-1 instead of the original ones) give a different answer.
    wrong = attn(torch.gather(x, 1, chosen[..., None].expand(-1, -1, D)), torch.arange(4).expand(B, 4))
    assert (wrong - sub).abs().max() > 1e-4


def test_bad_arguments():
    with pytest.raises(ValueError, match="capacity"):
        MoDBlock(D, H, capacity=1.5)
    with pytest.raises(ValueError, match="gate"):
        MoDBlock(D, H, gate="relu")


def test_random_routing_control_routes_exactly_k_random_tokens_without_gradient():
    import mode
    from mode.step import build_optimizer

    torch.manual_seed(0)
    block = mode.RandomMoDBlock(32, 4, capacity=0.25)
    x = torch.randn(3, 16, 32, requires_grad=True)
    out = block(x)
    changed = (out - x).abs().sum(-1) > 0  # [B, T]: the tokens the block updated
    assert changed.sum(1).tolist() == [4, 4, 4]  # k = 0.25 * 16 per sequence
    out2 = block(x)
    assert not torch.equal((out2 - x).abs().sum(-1) > 0, changed)  # a fresh draw each forward
    scores = block.router_logits(x)
    assert not scores.requires_grad and scores.min() >= 0 and scores.max() < 1
    out.sum().backward()
    assert block.router.weight.grad is None and not block.router.weight.requires_grad
    cfg = mode.load_config("mod_random", ["model.d_model=32", "model.n_heads=4", "model.n_layers=2"])
    lm = mode.MoDETransformer(cfg.model)
    routers = {id(p) for b in lm.blocks if isinstance(b, mode.RandomMoDBlock) for p in b.router.parameters()}
    optimized = {id(p) for g in build_optimizer(lm, cfg.train).param_groups for p in g["params"]}
    assert routers and not routers & optimized
    assert not lm.supports_causal()


def test_router_gradient_is_the_closed_form_of_the_gate():
    """The router learns only through g(r) in x + g(r) * f(x): for L = sum(c * y), dL/dW is
    sum over routed tokens of g'(r_i) (c_i . f_i) x_i and dL/db the same without x_i, with
    g = sigmoid, and no other path (f does not depend on the router). Written out by hand in
    float64 and compared with autograd's."""
    torch.manual_seed(3)
    blk = make_block(0.25, dtype=torch.float64)
    x = torch.randn(2, 16, D, dtype=torch.float64)
    c = torch.randn(2, 16, D, dtype=torch.float64)
    (blk(x) * c).sum().backward()
    want_w, want_b = torch.zeros_like(blk.router.weight), torch.zeros_like(blk.router.bias)
    k = int(0.25 * 16)
    with torch.no_grad():
        for b in range(2):
            r = x[b] @ blk.router.weight[0] + blk.router.bias[0]  # [T] the router's scores, by hand
            chosen = r.topk(k).indices.sort().values
            f = blk.block.delta(x[b, chosen][None], chosen[None])[0]  # the block on the routed tokens
            s = torch.sigmoid(r[chosen])
            weight = s * (1 - s) * (c[b, chosen] * f).sum(-1)  # g'(r_i) (c_i . f_i)
            want_w[0] += weight @ x[b, chosen]
            want_b[0] += weight.sum()
    assert_close(blk.router.weight.grad, want_w, "layer_grad")
    assert_close(blk.router.bias.grad, want_b, "layer_grad")
