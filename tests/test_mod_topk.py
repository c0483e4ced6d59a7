import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mode.layers.mod_moves import add_gated_tokens, gather_tokens, take_tokens
from mode.routing.mod_topk import capacity_to_k, capacity_to_k_tensor, expert_choice_topk
from tests.reference import topk_reference
from tests.tolerances import assert_close

CASES = [(1, 8, 0.5), (3, 16, 0.125), (2, 7, 0.3), (4, 32, 1.0), (2, 10, 0.0)]


@pytest.mark.parametrize("B,T,capacity", CASES, ids=[f"B{b}-T{t}-c{c}" for b, t, c in CASES])
def test_exact_k_sorted_and_matches_reference(B, T, capacity):
    scores = torch.randn(B, T)
    plan = expert_choice_topk(scores, capacity)
    k = capacity_to_k(capacity, T)
    assert plan.indices.shape == (B, k)
    assert plan.mask.sum(dim=1).tolist() == [k] * B
    assert torch.all(plan.indices[:, 1:] > plan.indices[:, :-1])
    assert plan.indices.tolist() == topk_reference(scores, k)
    assert_close(plan.weights, scores.gather(1, plan.indices), "exact")


def test_ties_go_to_lower_positions():
    scores = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0, 2.0]])
    plan = expert_choice_topk(scores, 0.5)  # k = 3 among four tied 2.0s
    assert plan.indices.tolist() == [[1, 2, 3]]
    assert expert_choice_topk(torch.zeros(2, 8), 0.25).indices.tolist() == [[0, 1], [0, 1]]


def test_k_is_floor_of_capacity_times_T():
    assert capacity_to_k(0.125, 1024) == 128
    assert capacity_to_k(0.3, 10) == 3
    assert capacity_to_k(0.29, 10) == 2
    with pytest.raises(ValueError, match="capacity"):
        capacity_to_k(1.5, 10)


def test_capacity_to_k_tensor_equals_capacity_to_k():
    lengths = torch.arange(0, 4097)
    for capacity in (0.0, 0.05, 0.1, 0.125, 0.3, 1 / 3, 0.5, 0.7, 1.0):
        want = torch.tensor([capacity_to_k(capacity, int(n)) for n in lengths])
        assert torch.equal(capacity_to_k_tensor(capacity, lengths), want), capacity
    with pytest.raises(ValueError, match="capacity"):
        capacity_to_k_tensor(1.5, lengths)


def test_router_weights_carry_gradient():
    scores = torch.randn(2, 8, requires_grad=True)
    plan = expert_choice_topk(scores, 0.5)
    plan.weights.sum().backward()
    assert torch.equal(scores.grad, plan.mask.float())


@settings(max_examples=50, deadline=None)
@given(B=st.integers(1, 4), T=st.integers(1, 40), capacity=st.floats(0, 1), seed=st.integers(0, 10_000))
def test_property_chosen_scores_dominate(B, T, capacity, seed):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randint(-3, 4, (B, T), generator=gen).float()  # many ties
    plan = expert_choice_topk(scores, capacity)
    k = capacity_to_k(capacity, T)
    assert plan.indices.tolist() == topk_reference(scores, k)
    if 0 < k < T:
        chosen_min = scores.masked_fill(~plan.mask, float("inf")).min(dim=1).values
        other_max = scores.masked_fill(plan.mask, float("-inf")).max(dim=1).values
        assert torch.all(chosen_min >= other_max)


def test_nan_scores_count_as_highest_and_keep_exact_k():
    scores = torch.tensor([[0.5, float("nan"), 2.0, float("nan"), -1.0, float("inf")]])
    plan = expert_choice_topk(scores, 0.5)  # k = 3: NaN, NaN (as +inf), then +inf by position
    assert plan.indices.tolist() == [[1, 3, 5]]
    assert plan.mask.sum().item() == 3
    all_nan = expert_choice_topk(torch.full((2, 8), float("nan")), 0.25)
    assert all_nan.indices.tolist() == [[0, 1], [0, 1]]


def test_gather_and_take_tokens_match_indexing():
    x = torch.randn(3, 10, 4, requires_grad=True)
    indices = torch.tensor([[0, 4, 9], [1, 2, 3], [5, 7, 8]])
    expected = torch.stack([x[b, indices[b]] for b in range(3)])
    assert torch.equal(gather_tokens(x, indices), expected)
    x_sel, alias = take_tokens(x, indices)
    assert torch.equal(x_sel, expected) and torch.equal(alias, x)
    g_sel, g_alias = torch.randn_like(x_sel), torch.randn_like(x)
    (grad,) = torch.autograd.grad((x_sel * g_sel).sum() + (alias * g_alias).sum(), x)
    (ref,) = torch.autograd.grad((expected * g_sel).sum() + (x * g_alias).sum(), x)
    assert_close(grad, ref, "elementwise")


def add_gated_reference(x, indices, gate, update):
    out = x.clone()
    for b in range(x.shape[0]):
        for j, t in enumerate(indices[b].tolist()):
            out[b, t] = x[b, t] + gate[b, j] * update[b, j]
    return out


def test_add_gated_tokens_values_grads_and_untouched_rows():
    torch.manual_seed(0)
    x = torch.randn(2, 9, 5, dtype=torch.float64, requires_grad=True)
    indices = torch.tensor([[0, 3, 8], [2, 4, 5]])
    gate = torch.rand(2, 3, dtype=torch.float64, requires_grad=True)
    update = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    out = add_gated_tokens(x, indices, gate, update)
    assert_close(out, add_gated_reference(x, indices, gate, update), "elementwise")
    untouched = torch.ones(2, 9, dtype=torch.bool).scatter_(1, indices, False)
    assert torch.equal(out[untouched], x[untouched])  # bit-exact
    assert torch.autograd.gradcheck(lambda *a: add_gated_tokens(a[0], indices, a[1], a[2]), (x, gate, update))
