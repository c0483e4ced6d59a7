"""Property tests (hypothesis) of the routing primitives against slow references: random
shapes and capacities, ties, all-equal scores, every token on one expert, empty experts."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mode.experts.permute import combine, permute, sort_by_expert
from mode.routing.counting import count_ids
from mode.routing.token_choice import capacity_keep, expert_choice_tokens, token_choice_topk
from tests.tolerances import assert_close

SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def assignments(draw):
    """experts [N, K] in [0, E + n_noop) with a skew (often all on one expert, often some
    experts empty), a keep mask or None, and the layout sizes."""
    N, K, E = draw(st.integers(0, 24)), draw(st.integers(1, 3)), draw(st.integers(1, 6))
    n_noop = draw(st.integers(0, 2))
    seed = draw(st.integers(0, 10_000))
    gen = torch.Generator().manual_seed(seed)
    mode = draw(st.sampled_from(["random", "one_expert", "few_experts"]))
    high = {"random": E + n_noop, "one_expert": 1, "few_experts": min(2, E)}[mode]
    experts = torch.randint(0, high, (N, K), generator=gen)
    keep = torch.rand(N, K, generator=gen) > 0.3 if draw(st.booleans()) else None
    return experts, keep, E, n_noop, gen


@SETTINGS
@given(assignments())
def test_sort_by_expert_matches_a_stable_python_sort(case):
    experts, keep, E, n_noop, _ = case
    N, K = experts.shape
    d = sort_by_expert(experts, E, keep, has_noop=n_noop > 0)
    flat = experts.reshape(-1).tolist()
    kept = keep.reshape(-1).tolist() if keep is not None else [True] * (N * K)
    valid = [a for a in range(N * K) if flat[a] < E and kept[a]]
    ref_order = sorted(valid, key=lambda a: (flat[a], a))
    M = len(valid)
    # The computed rows come first; a static-size dispatch (no-op experts or drops) keeps
    # every assignment plus one scratch row, and its bags name that row for the others.
    static = (keep is not None or n_noop > 0) and N > 0
    assert d.order.numel() == (N * K + 1 if static else M)
    assert d.order[:M].tolist() == ref_order
    assert d.token_idx[:M].tolist() == [a // K for a in ref_order]
    assert d.counts.tolist() == [sum(1 for a in valid if flat[a] == e) for e in range(E)]
    # bags: each token's dispatched rows, in token-major order
    for n in range(N):
        rows = [r for r in d.bags[d.bag_offsets[n] : d.bag_offsets[n + 1]].tolist() if r != d.pad]
        assert sorted(ref_order[r] for r in rows) == [a for a in valid if a // K == n]


@SETTINGS
@given(assignments(), st.integers(1, 8))
def test_combine_of_permute_equals_the_per_token_weighted_sum(case, D):
    experts, keep, E, n_noop, gen = case
    N, K = experts.shape
    d = sort_by_expert(experts, E, keep, has_noop=n_noop > 0)
    x = torch.randn(N, D, generator=gen, dtype=torch.float64)
    w = torch.rand(N, K, generator=gen, dtype=torch.float64)
    out = combine(permute(x, d) * 2.0, d, w)
    ref = torch.zeros(N, D, dtype=torch.float64)
    for a in d.order[: int(d.counts.sum())].tolist():
        ref[a // K] += 2.0 * w[a // K, a % K] * x[a // K]
    assert_close(out, ref, "layer")


@SETTINGS
@given(
    N=st.integers(1, 20),
    E=st.integers(1, 6),
    data=st.data(),
    ties=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_token_choice_picks_the_top_k_scores(N, E, data, ties, seed):
    K = data.draw(st.integers(1, E))
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(-2, 3, (N, E), generator=gen).float() if ties else torch.randn(N, E, generator=gen)
    bias = torch.randn(E, generator=gen) if data.draw(st.booleans()) else None
    choice = token_choice_topk(logits, K, renormalize=True, selection_bias=bias)
    scores = logits + (bias if bias is not None else 0)
    for n in range(N):
        picked = choice.experts[n].tolist()
        assert len(set(picked)) == K
        # the chosen scores are the K largest (any order among ties)
        assert sorted(scores[n, picked].tolist(), reverse=True) == sorted(scores[n].tolist(), reverse=True)[:K]
    probs = torch.softmax(logits, -1)
    expected = probs.gather(1, choice.experts)
    assert_close(choice.weights, expected / expected.sum(-1, keepdim=True) if K > 1 else expected, "elementwise")


@SETTINGS
@given(assignments(), st.integers(0, 10), st.sampled_from(["position", "probs"]), st.booleans())
def test_capacity_keep_matches_the_documented_queue(case, capacity, policy, equal_weights):
    experts, _, E, n_noop, gen = case
    N, K = experts.shape
    weights = torch.full((N, K), 0.5) if equal_weights else torch.rand(N, K, generator=gen)
    keep = capacity_keep(experts, weights, E, capacity, policy)
    queue = [(n, j) for j in range(K) for n in range(N)]  # choice rank, then position
    if policy == "probs":
        queue = sorted(queue, key=lambda a: -weights[a].item())  # stable: ties keep that order
    used, ref = [0] * (E + n_noop), torch.zeros(N, K, dtype=torch.bool)
    for n, j in queue:
        e = int(experts[n, j])
        if e < E and used[e] < capacity:
            used[e] += 1
            ref[n, j] = True
    assert torch.equal(keep, ref)


@SETTINGS
@given(N=st.integers(1, 20), E=st.integers(1, 5), C=st.integers(0, 24), equal=st.booleans(), seed=st.integers(0, 999))
def test_expert_choice_takes_each_experts_top_c(N, E, C, equal, seed):
    gen = torch.Generator().manual_seed(seed)
    probs = torch.full((N, E), 1.0 / E) if equal else torch.softmax(torch.randn(N, E, generator=gen), -1)
    tokens, weights = expert_choice_tokens(probs, C)
    for e in range(E):
        ref = sorted(sorted(range(N), key=lambda n: (-probs[n, e].item(), n))[: min(C, N)])
        assert tokens[e].tolist() == ref
        assert_close(weights[e], probs[ref, e] if ref else probs[:0, e], "elementwise")


@SETTINGS
@given(assignments())
def test_count_ids_equals_bincount(case):
    experts, _, E, n_noop = case[:4]
    n = E + n_noop
    counts = count_ids(experts, n)
    assert counts.dtype == torch.long and counts.shape == (n,)
    assert torch.equal(counts, torch.bincount(experts.reshape(-1), minlength=n))
