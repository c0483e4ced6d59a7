"""Causal routing for sampling: causality, KV-cache decoding, predictor isolation, BCE."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mode
from mode.config import load_config
from mode.layers.kv_cache import KVCache
from mode.layers.mod import MoDBlock
from mode.layers.predictor import RoutingPredictor
from mode.model import MoDETransformer
from mode.routing.causal import decision_metrics, membership_bce
from tests.tolerances import assert_close

VARIANTS = [
    ("mod", "router_bce"),
    ("mod", "predictor"),
    ("mode_staged", "predictor"),
    ("mode_integrated", "predictor"),
    ("dense", "none"),
]
IDS = [f"{layout}-{causal}" for layout, causal in VARIANTS]


def make_model(layout: str, causal: str, seed: int = 0) -> MoDETransformer:
    torch.manual_seed(seed)
    cfg = load_config(
        None,
        [
            "model.d_model=64",
            "model.n_heads=4",
            "model.n_layers=4",
            "model.seq_len=64",
            f"model.layout=dense,{layout}",
            f"model.mod.causal={causal}",
            "model.mod.capacity=0.5",
            f"model.moe.n_noop={4 if layout == 'mode_integrated' else 0}",
            "model.moe.top_k=2",
        ],
    ).model
    model = MoDETransformer(cfg).eval()
    # Center every decision logit on a sample so that about half of the tokens skip.
    inputs = {}
    hooks = [
        b.register_forward_pre_hook(lambda m, args: inputs.__setitem__(m, args[0]))
        for b in model.blocks
        if isinstance(b, MoDBlock)
    ]
    with torch.no_grad():
        model(torch.randint(0, 256, (4, 64)))
        for block, x in inputs.items():
            torch.nn.init.normal_(block.router.weight, std=0.3)
            if block.predictor is not None:
                block.predictor.out.bias -= block.predictor(x, block.router_logits(x)).median()
    for h in hooks:
        h.remove()
    return model


@pytest.mark.parametrize("layout,causal", VARIANTS, ids=IDS)
def test_causal_mode_is_causal(layout, causal):
    model = make_model(layout, causal)
    idx = torch.randint(0, 256, (2, 48))
    edited = idx.clone()
    t = 20
    edited[:, t:] = torch.randint(0, 256, (2, 48 - t))
    with torch.no_grad():
        a, _ = model(idx, routing="causal")
        b, _ = model(edited, routing="causal")
    assert (a[:, :t] - b[:, :t]).abs().max() <= 1e-5


@pytest.mark.parametrize("layout", ["mod", "mode_staged"])
def test_topk_mode_is_not_causal(layout):
    model = make_model(layout, "predictor")
    idx = torch.randint(0, 256, (2, 48))
    edited = idx.clone()
    edited[:, 20:] = torch.randint(0, 256, (2, 28))
    with torch.no_grad():
        a, _ = model(idx, routing="topk")
        b, _ = model(edited, routing="topk")
    assert (a[:, :20] - b[:, :20]).abs().max() > 1e-3  # later tokens changed who got chosen


@pytest.mark.parametrize("layout,causal", VARIANTS, ids=IDS)
def test_kv_cache_decode_equals_full_causal_forward(layout, causal):
    model = make_model(layout, causal)
    B, T0, steps = 2, 8, 24
    prompt = torch.randint(0, 256, (B, T0))
    caches = model.new_caches(B)
    with torch.no_grad():
        logits, _ = model(prompt, routing="causal", caches=caches)
        seq, step_logits = prompt, [logits[:, -1]]
        for s in range(steps):
            next_id = step_logits[-1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, next_id], dim=1)
            step_logits.append(model.decode(next_id, T0 + s, caches))
        full, _ = model(seq, routing="causal")
    for s, lg in enumerate(step_logits):
        assert_close(lg, full[:, T0 - 1 + s], "model")


@pytest.mark.parametrize("layout,causal", VARIANTS[:3], ids=IDS[:3])
def test_skipped_tokens_write_no_cache_entries(layout, causal):
    model = make_model(layout, causal)
    B, T = 2, 40
    idx = torch.randint(0, 256, (B, T))
    caches = model.new_caches(B)
    decided = []
    hooks = [
        b.register_forward_hook(lambda m, a, out: decided.append(m.metrics["causal_share"]))
        for b in model.blocks
        if isinstance(b, MoDBlock)
    ]
    with torch.no_grad():
        model(idx, routing="causal", caches=caches)
    for h in hooks:
        h.remove()
    routed = iter(decided)
    for block, cache in zip(model.blocks, caches, strict=True):
        if isinstance(block, MoDBlock):
            share = float(next(routed))
            assert cache.entries() == round(share * B * T)
            assert 0 < cache.entries() < B * T  # some tokens skipped: fewer entries than tokens
        else:
            assert cache.entries() == B * T


def test_predictor_input_is_detached():
    model = make_model("mod", "predictor")
    model.train()
    idx = torch.randint(0, 256, (2, 32))

    def trunk_grads(coef: float) -> dict[str, torch.Tensor]:
        for block in model.blocks:
            if isinstance(block, MoDBlock):
                block.causal_coef = coef
        model.zero_grad()
        _, loss = model(idx, idx)
        (loss + mode.aux_loss(model)).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if "predictor" not in n and p.grad is not None}

    with_loss, without = trunk_grads(1.0), trunk_grads(0.0)
    assert with_loss.keys() == without.keys()
    for name in with_loss:
        assert torch.equal(with_loss[name], without[name]), name
    pred = next(b.predictor for b in model.blocks if isinstance(b, MoDBlock))
    trunk_grads(1.0)
    assert pred.fc.weight.grad.abs().max() > 0  # the predictor itself learns


def test_router_bce_trains_the_router():
    model = make_model("mod", "router_bce").train()
    idx = torch.randint(0, 256, (2, 32))
    model(idx, idx)
    block = next(b for b in model.blocks if isinstance(b, MoDBlock))
    assert "causal_bce" in block.aux_losses
    block.aux_losses["causal_bce"].backward()
    assert block.router.weight.grad.abs().max() > 0


def test_bce_and_metrics_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0]])
    chosen = torch.tensor([[True, False, False, True]])
    expected = (
        -(
            math.log(1 / (1 + math.exp(-2.0)))
            + math.log(1 - 1 / (1 + math.exp(1.0)))
            + math.log(1 - 1 / (1 + math.exp(-0.5)))
            + math.log(1 / (1 + math.exp(3.0)))
        )
        / 4
    )
    assert membership_bce(logits, chosen).item() == pytest.approx(expected, rel=1e-6)
    m = decision_metrics(logits, chosen)  # routed: [T, F, T, F]
    assert m["accuracy"].item() == pytest.approx(0.5)
    assert m["recall"].item() == pytest.approx(0.5)
    assert m["precision"].item() == pytest.approx(0.5)
    assert m["causal_share"].item() == pytest.approx(0.5)


def test_clear_errors():
    model = make_model("mod", "none")
    idx = torch.randint(0, 256, (1, 8))
    with pytest.raises(ValueError, match="model.mod.causal"):
        model(idx, routing="causal")
    with pytest.raises(ValueError, match="routing"):
        model(idx, routing="sideways")
    with pytest.raises(ValueError, match="causal"):
        model.blocks[1](torch.randn(1, 8, 64), cache=model.new_caches(1)[1])


def test_generate_uses_the_cache_when_it_can():
    model = make_model("mod", "predictor")
    out = model.generate(torch.randint(0, 256, (2, 4)), 10, temperature=0)
    assert out.shape == (2, 14)
    no_cache = make_model("mod", "none").generate(torch.randint(0, 256, (1, 4)), 3)
    assert no_cache.shape == (1, 7)


def test_predictor_threshold_tracks_the_kth_score():
    torch.manual_seed(0)
    block = MoDBlock(32, 4, capacity=0.25, causal="predictor").train()
    pred = block.predictor
    assert not pred.calibrated
    pred.after_optimizer_step()  # nothing recorded: no move, still uncalibrated
    assert not pred.calibrated and pred.threshold.item() == 0.0

    def kth_mean(x: torch.Tensor) -> torch.Tensor:  # slow reference: sort every row
        scores = block.router_logits(x)
        return scores.sort(dim=-1, descending=True).values[:, 16 // 4 - 1].mean()

    x1, x2 = torch.randn(3, 16, 32), torch.randn(3, 16, 32)
    block(x1)
    assert not pred.calibrated  # the forward records; the step moves it
    block.predictor.after_optimizer_step()
    assert pred.calibrated
    assert_close(pred.threshold, kth_mean(x1).detach(), "reduction")
    block(x2)
    block(x2)  # two micro-batches of one step: one move toward their mean
    mode.after_optimizer_step(block)
    expected = (1 - pred.momentum) * kth_mean(x1) + pred.momentum * kth_mean(x2)
    assert_close(pred.threshold, expected.detach(), "reduction")
    before = pred.threshold.clone()
    block.eval()(torch.randn(3, 16, 32))
    assert torch.equal(pred.threshold, before)  # evaluation never moves it
    assert torch.equal(block.state_dict()["predictor.threshold"], before)  # saved with the model


def reference_thresholds(pred: RoutingPredictor, scores: torch.Tensor) -> torch.Tensor:
    """Slow reference: token t uses the first L = floor((t + 1) / stride) * stride scores of its
    row; threshold = (prior * running + L * (k-th largest of them)) / (prior + L)."""
    B, T = scores.shape
    out = torch.empty(B, T)
    for b in range(B):
        for t in range(T):
            L = (t + 1) // pred.stride * pred.stride
            if L == 0:
                out[b, t] = pred.threshold
                continue
            k = max(1, math.floor(pred.capacity * L + 1e-9))
            q = sorted(scores[b, :L].tolist(), reverse=True)[k - 1]
            out[b, t] = (pred.prior_tokens * pred.threshold + L * q) / (pred.prior_tokens + L)
    return out


@settings(max_examples=40, deadline=None)
@given(
    T=st.integers(1, 70),
    stride=st.integers(1, 20),
    capacity=st.sampled_from([0.0, 0.05, 0.125, 0.5, 1.0]),
    prior=st.integers(0, 40),
    seed=st.integers(0, 10_000),
    chunked=st.booleans(),
)
def test_predictor_thresholds_match_the_slow_reference(T, stride, capacity, prior, seed, chunked):
    torch.manual_seed(seed)
    pred = RoutingPredictor(8, capacity, prior_tokens=prior, stride=stride)
    if chunked:  # the batched top-k split into one prefix per chunk
        pred.MAX_TOPK_ELEMENTS = 1
    pred.threshold.fill_(torch.randn(()).item())
    scores = torch.randn(2, T).round(decimals=1)  # ties are common
    thresholds = pred.thresholds(scores)
    assert_close(thresholds, reference_thresholds(pred, scores), "reduction")
    # Causal: the thresholds of the first t tokens do not depend on the tokens after them.
    t = T // 2
    edited = torch.cat([scores[:, :t], torch.randn(2, T - t)], dim=1)
    assert torch.equal(pred.thresholds(edited)[:, :t], thresholds[:, :t])


def test_predictor_logit_is_score_minus_prefix_threshold_plus_mlp():
    torch.manual_seed(0)
    block = MoDBlock(32, 4, capacity=0.25, causal="predictor").train()
    x = torch.randn(3, 40, 32)  # crosses the stride-16 prefix lengths 16 and 32
    block(x)
    pred = block.predictor
    with torch.no_grad():
        scores = block.router_logits(x)
        mlp = pred.out(torch.nn.functional.silu(pred.fc(x))).squeeze(-1)
        expected = scores - reference_thresholds(pred, scores) + mlp
        assert_close(block.decision_logits(x), expected, "layer")
        # Decoding token t from the row's recorded scores gives the same logit as the full pass.
        for t in (0, 14, 15, 16, 31, 39):
            got = pred.decode_logits(x[:, t : t + 1], scores[:, : t + 1])
            assert_close(got[:, 0], expected[:, t], "layer")
        pred.out.weight.zero_()
        pred.out.bias.zero_()
        assert torch.equal(block.decision_logits(x) > 0, scores > reference_thresholds(pred, scores))
    with pytest.raises(ValueError, match="momentum"):
        RoutingPredictor(32, 0.25, momentum=0.0)
    with pytest.raises(ValueError, match="capacity"):
        RoutingPredictor(32, 1.5)


def test_a_filled_cache_refuses_a_second_prefill():
    model = make_model("mod", "predictor")
    caches = model.new_caches(1)
    with torch.no_grad():
        model(torch.randint(0, 256, (1, 8)), routing="causal", caches=caches)
        with pytest.raises(ValueError, match="fresh caches"):
            model(torch.randint(0, 256, (1, 8)), routing="causal", caches=caches)


def test_predictor_threshold_stays_float32_in_a_bf16_model():
    torch.manual_seed(0)
    block = MoDBlock(32, 4, capacity=0.25, causal="predictor").to(torch.bfloat16).train()
    assert block.predictor.fc.weight.dtype == torch.bfloat16
    assert block.predictor.threshold.dtype == torch.float32
    x = torch.randn(2, 16, 32, dtype=torch.bfloat16)
    block(x)
    mode.after_optimizer_step(block)
    first = block.predictor.threshold.clone()
    block(x + 0.5)
    mode.after_optimizer_step(block)
    assert block.predictor.threshold.dtype == torch.float32 and block.predictor.threshold != first
    assert block.decision_logits(x).dtype == torch.float32


def test_kv_cache_records_scores_past_its_first_allocation():
    cache = KVCache(2, 1, 4, torch.float32, torch.device("cpu"))
    first, second = torch.randn(2, 50), torch.randn(2, 30)
    cache.record_scores(first)
    cache.record_scores(second)
    assert torch.equal(cache.scores_seen(), torch.cat([first, second], dim=1))
    assert cache.nbytes_used() == 2 * 80 * 4  # no KV entries yet: the scores alone


NON_CAUSAL = {
    "moe_capacity": ("blocks.1.mlp", "capacity MoE", []),
    "expert_choice": ("blocks.1.mlp", "expert-choice", ["model.moe.router=expert_choice"]),
    "mod_none": ("blocks.1", "model.mod.causal", []),
}


def small_lm(layout: str, extra: list[str]) -> MoDETransformer:
    torch.manual_seed(0)
    cfg = load_config(
        None,
        ["model.d_model=32", "model.n_heads=4", "model.n_layers=2", "model.seq_len=32", f"model.layout=dense,{layout}"]
        + extra,
    ).model
    return MoDETransformer(cfg).eval()


@pytest.mark.parametrize("case", list(NON_CAUSAL))
def test_layers_that_look_at_the_batch_refuse_causal_routing_and_generate_falls_back_exactly(case):
    name, words, extra = NON_CAUSAL[case]
    layout = {"moe_capacity": "moe_capacity", "expert_choice": "moe", "mod_none": "mod"}[case]
    model = small_lm(layout, extra)
    assert not model.supports_causal()
    idx = torch.randint(0, 256, (1, 8))
    with pytest.raises(ValueError, match=words) as err:
        model(idx, routing="causal")
    assert name in str(err.value)
    with pytest.raises(ValueError, match=name):
        model.generate(idx, 2, use_cache=True)
    # The default is the exact fallback: the model's own top-k forward at every step.
    out = model.generate(idx, 4, temperature=0)
    ref = idx
    for _ in range(4):
        ref = torch.cat([ref, model(ref)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, ref)


def test_token_choice_dropless_moe_decides_per_token_and_uses_the_cache():
    model = small_lm("mode_staged", ["model.mod.causal=predictor", "model.moe.n_experts=4"])
    assert model.supports_causal()
    assert [m.non_causal_reason() for m in model.modules() if isinstance(m, mode.DroplessMoE)] == [None]
    out = model.generate(torch.randint(0, 256, (1, 4)), 3, temperature=0)
    assert out.shape == (1, 7)


def test_printing_a_model_shows_the_routing_settings():
    text = repr(small_lm("mode_staged", ["model.mod.causal=predictor", "model.moe.n_experts=4"]))
    assert "capacity=0.125, gate='sigmoid', causal='predictor'" in text
    assert "n_experts=4, top_k=2" in text and "backend='auto'" in text
