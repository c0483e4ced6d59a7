"""Numerical faults: router math stays fp32, NaN in one sequence stays in that sequence, and a
NaN/inf loss or gradient skips the step instead of poisoning the run."""

import json
import math

import pytest
import torch

import mode
from mode.checkpoint import load_checkpoint
from mode.config import load_config
from mode.model import MoDETransformer
from mode.step import NonFiniteTrainingError
from mode.train import train
from tests.tiny import TINY
from tests.tolerances import assert_close

D = 32


def test_router_projections_are_computed_in_float32_from_bf16_weights():
    """A bf16 projection rounds the scores (~700 distinct values per 1,024 tokens): the router
    runs its projection itself in fp32, with or without autocast."""
    torch.manual_seed(0)
    x = torch.randn(1, 1024, D).bfloat16()
    mod_block = mode.MoDBlock(D, 4).bfloat16()
    moe = mode.DroplessMoE(D, 64, 4).bfloat16()
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            scores = mod_block.router_logits(x)
            logits = moe.router_logits(x.view(-1, D))
        ref = x.float() @ mod_block.router.weight.float().t()
        assert scores.dtype == logits.dtype == torch.float32
        assert_close(scores, ref.squeeze(-1), "elementwise")
        assert_close(logits, x.view(-1, D).float() @ moe.router.weight.float().t(), "elementwise")
        assert scores.unique().numel() == 1024


LAYERS = {
    "mod": lambda: mode.MoDBlock(D, 4, capacity=0.25),
    "dropless": lambda: mode.DroplessMoE(D, 64, 4),
    "capacity_probs": lambda: mode.CapacityMoE(D, 64, 4, capacity_factor=1.0, drop_policy="probs"),
    "capacity_position": lambda: mode.CapacityMoE(D, 64, 4, capacity_factor=1.0),
    "expert_choice": lambda: mode.ExpertChoiceMoE(D, 64, 4, capacity_factor=1.0),
    "staged": lambda: mode.StagedMoDEBlock(D, 4, capacity=0.25, n_experts=4),
    "integrated": lambda: mode.IntegratedMoDEBlock(D, 4, n_experts=4, n_noop=2, top_k=1),
}
# Layers whose routing looks only at a token's own sequence: the other rows are exactly what
# they are without the bad row. Batch-level routing (capacity, expert choice) gives a bad token
# the lowest priority, so the other rows stay finite.
PER_SEQUENCE = {"mod", "dropless", "staged", "integrated"}


@pytest.mark.parametrize("kind", list(LAYERS))
def test_nan_in_one_sequence_stays_in_that_sequence(kind):
    """What the layers do with NaN scores: a MoD router counts a NaN score as the highest (exact
    k still holds, per sequence); token choice sends a NaN token somewhere and leaves it out of
    the balance and z-losses; capacity and expert choice rank NaN last for their slots."""
    torch.manual_seed(0)
    layer = LAYERS[kind]()
    x = torch.randn(4, 16, D)
    bad = x.clone()
    bad[0, 5] = float("nan")
    y = layer(bad)
    losses = {k: v for m in layer.modules() for k, v in getattr(m, "aux_losses", {}).items()}
    assert all(torch.isfinite(v) for v in losses.values()), losses
    assert losses or kind == "mod"  # a MoD block without a causal method has no aux loss
    assert torch.isfinite(y[1:]).all()
    if kind in PER_SEQUENCE:
        assert_close(y[1:], layer(x[1:]), "layer")


def test_nan_tokens_rank_last_for_capacity_and_expert_choice_slots():
    from mode.routing.token_choice import capacity_keep, expert_choice_tokens

    N = 8
    probs = torch.rand(N, 2)
    probs[3] = float("nan")
    tokens, _ = expert_choice_tokens(probs, N - 1)
    assert 3 not in tokens.tolist()[0] and 3 not in tokens.tolist()[1]
    weights = torch.rand(N, 1)
    weights[3] = float("nan")
    keep = capacity_keep(torch.zeros(N, 1, dtype=torch.long), weights, 1, N - 1, "probs")
    assert not keep[3] and keep.sum() == N - 1


BASE = [*TINY, "model.layout=dense,moe", "train.batch_size=4", "train.eval_every=1000", "train.warmup_steps=1"]


def records(out_dir) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_nan_gradient_skips_the_step_and_training_goes_on(tmp_path):
    cfg = load_config(None, [*BASE, "train.steps=6", f"train.out_dir={tmp_path}"])
    torch.manual_seed(cfg.train.seed)
    model = MoDETransformer(cfg.model)
    calls = {"n": 0}

    def poison(grad):  # the third backward's gradient of one weight is NaN
        calls["n"] += 1
        return grad * float("nan") if calls["n"] == 3 else grad

    model.blocks[1].mlp.experts.w1.register_hook(poison)
    trained, result = train(cfg, model=model)
    rows = records(tmp_path)
    assert [r.get("skipped", False) for r in rows] == [False, False, True, False, False, False]
    assert result.steps == 6
    for name, p in trained.named_parameters():
        assert torch.isfinite(p).all(), name
    reloaded = MoDETransformer(cfg.model)
    assert load_checkpoint(tmp_path / "ckpt.pt", reloaded) == 6
    assert all(torch.isfinite(p).all() for p in reloaded.parameters())


def test_a_skipped_step_leaves_weights_and_optimizer_untouched(tmp_path):
    from mode.step import build_optimizer, train_step

    cfg = load_config(None, [*BASE])
    torch.manual_seed(0)
    model = MoDETransformer(cfg.model)
    opt = build_optimizer(model, cfg.train)
    x = torch.randint(0, 256, (2, 32))
    train_step(model, opt, x, x, 1.0)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    state = {k: v["exp_avg"].clone() for k, v in enumerate(opt.state.values())}
    with torch.no_grad():
        model.blocks[0].attn.qkv.weight[0, 0] = float("inf")
    out = train_step(model, opt, x, x, 1.0)
    assert out.skipped and not math.isfinite(float(out.loss)) or not math.isfinite(float(out.grad_norm))
    with torch.no_grad():
        model.blocks[0].attn.qkv.weight[0, 0] = weights["blocks.0.attn.qkv.weight"][0, 0]
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    for k, v in enumerate(opt.state.values()):
        assert torch.equal(v["exp_avg"], state[k])


def test_nan_weights_stop_training_without_a_poisoned_checkpoint(tmp_path):
    cfg = load_config(None, [*BASE, "train.steps=10", "train.max_bad_steps=2", f"train.out_dir={tmp_path}"])
    torch.manual_seed(cfg.train.seed)
    model = MoDETransformer(cfg.model)
    with torch.no_grad():
        model.blocks[0].attn.qkv.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteTrainingError, match="train.max_bad_steps=2"):
        train(cfg, model=model)
    assert not (tmp_path / "ckpt.pt").exists()
    assert [r["step"] for r in records(tmp_path)] == [1, 2] and all(r["skipped"] for r in records(tmp_path))


def test_nan_in_the_data_is_skipped(tmp_path):
    """A batch whose embeddings hold a NaN (as corrupt input data would) costs one skipped step."""
    cfg = load_config(None, [*BASE, "train.steps=4", f"train.out_dir={tmp_path}"])
    torch.manual_seed(cfg.train.seed)
    model = MoDETransformer(cfg.model)
    calls = {"n": 0}

    def corrupt(module, args, out):
        calls["n"] += 1
        if calls["n"] == 2:
            out = out.clone()
            out[0, 3] = float("nan")
        return out

    model.tok_emb.register_forward_hook(corrupt)
    trained, result = train(cfg, model=model)
    assert [r.get("skipped", False) for r in records(tmp_path)] == [False, True, False, False]
    assert all(torch.isfinite(p).all() for p in trained.parameters())


def test_routing_health_metrics_and_collapse_warnings():
    from mode.routed import routing_metrics
    from mode.telemetry import health_warnings

    torch.manual_seed(0)
    block = mode.MoDBlock(D, 4, capacity=0.1)
    w = block.router.weight.detach()[0]
    x = 0.1 * torch.randn(2, 100, D)
    x[:, :10] += 5 * w / w.norm()  # the first tenth of every sequence scores highest
    block(x)
    m = routing_metrics(block)
    assert m["position_share"][0] == 1.0 and len(m["position_share"]) == 10
    assert 0 < m["score_entropy"] < 1
    assert any("first 10% of positions" in w for w in health_warnings(m))
    block(torch.randn(2, 100, D))
    assert not health_warnings(routing_metrics(block))

    moe = mode.DroplessMoE(D, 32, 4, top_k=1)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[2] = 1.0
    moe(torch.rand(64, D) + 0.5)  # every token prefers expert 2
    m = routing_metrics(moe)
    assert m["load_max"] == 1.0 and m["load_max_over_mean"] == 4.0
    assert health_warnings(m) == ["layer: one expert takes 100% of the assignments"]
    one = mode.DroplessMoE(D, 32, 1, top_k=1)  # the upcycling identity's layer: no collapse
    one(torch.randn(64, D))
    m = routing_metrics(one)
    assert m["load_max"] == 1.0 and not health_warnings(m)


def test_rope_backward_is_the_inverse_rotation_of_autograd_through_the_formula():
    from mode.layers.attention import _Rope, apply_rope, rope_rows, rope_table
    from tests.reference import rope_cos_sin_reference as rope_cos_sin

    gen = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 500, (2, 7), generator=gen).sort(dim=1).values
    cos, sin = rope_cos_sin(positions, 10, 10000.0)  # [B, 1, T, Dh/2]
    x = torch.randn(2, 7, 2, 3, 10, dtype=torch.float64, generator=gen, requires_grad=True)  # [B, T, q|k, H, Dh]
    g = torch.randn(2, 7, 2, 3, 10, dtype=torch.float64, generator=gen)
    ref = x.detach().clone().requires_grad_(True)
    # float64 through the reference formula (the fast path computes in float32: compare that too)
    c, s = (t.squeeze(1)[:, :, None, None, :].double() for t in (cos, sin))  # [B, T, 1, 1, Dh/2]
    x1, x2 = ref.chunk(2, dim=-1)
    out_ref = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    out_ref.backward(g)
    rows = rope_rows(positions, 10, 10000.0)
    c, s = rows[:, :, 0, None, None, :], rows[:, :, 1, None, None, :]
    out = apply_rope(x, c, s)
    out.backward(g)
    assert_close(out, out_ref, "reduction")
    assert_close(x.grad, ref.grad, "reduction")
    assert x.grad.abs().max() > 0.1  # a gradient far above the tolerance
    back = _Rope.apply(out.detach(), c, -s)
    assert_close(back, x.detach(), "reduction")  # orthogonal: -angle undoes it
    # The cached table holds the same rows as computing them from the positions.
    table = rope_table(500, 10, 10000.0, torch.device("cpu"))
    assert_close(table[positions], rows, "exact")
