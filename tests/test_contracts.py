"""Behaviours that deliberate single-line bugs ("mutants") slipped past: each test here fails
for one of them (the list is in the reliability issue; the mutants are named per test)."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import mode
from mode.layers.mod import GATES, MoDBlock
from mode.routing.causal import causal_decisions
from mode.routing.losses import load_balance_loss
from tests.dist_utils import run_workers
from tests.test_causal import make_model
from tests.tolerances import assert_close

D = 16


def test_causal_forward_keeps_the_residual_form():
    """Mutant: ``g(r) * (x + f(x))`` in the causal forward (and decode, which equals it)."""
    torch.manual_seed(0)
    block = MoDBlock(D, 2, capacity=0.5, causal="router_bce").eval()
    torch.nn.init.normal_(block.router.weight, std=0.5)
    x = torch.randn(2, 12, D)
    with torch.no_grad():
        out = block(x, routing="causal")
        scores = block.router_logits(x)
        routed = causal_decisions(block.decision_logits(x, scores))
        # Reference, one row at a time: the routed tokens run the block among themselves (causal
        # by position) and take x + g(r) * f(x); the others stay x.
        ref = x.clone()
        for b in range(2):
            idx = routed[b].nonzero().squeeze(-1)
            delta = block.block.delta(x[b, idx][None], idx[None])[0]
            ref[b, idx] = x[b, idx] + GATES["sigmoid"](scores[b, idx]).unsqueeze(-1) * delta
    assert 0 < routed.sum() < routed.numel()
    assert_close(out, ref, "layer")
    assert torch.equal(out[~routed], x[~routed])  # skipped tokens: exactly x


def test_decode_writes_kv_only_for_routed_tokens():
    """Mutant: decode appends every row's K/V, skipped or not. A decoded cache must hold the same
    entries per row as the prefill of the whole sequence, for every causal method and block."""
    for layout, causal in [("mod", "router_bce"), ("mod", "predictor"), ("mode_staged", "predictor")]:
        model = make_model(layout, causal)
        B, T0, steps = 2, 6, 26
        seq = torch.randint(0, 256, (B, T0 + steps))
        caches = model.new_caches(B)
        with torch.no_grad():
            model(seq[:, :T0], routing="causal", caches=caches)
            for s in range(steps):
                model.decode(seq[:, T0 + s : T0 + s + 1], T0 + s, caches)
            full = model.new_caches(B)
            model(seq, routing="causal", caches=full)
        for block, inc, ref in zip(model.blocks, caches, full, strict=True):
            assert torch.equal(inc.lengths, ref.lengths), (layout, causal)
            if isinstance(block, MoDBlock):
                assert (inc.lengths < T0 + steps).all(), (layout, causal)  # some decoded tokens skipped


def test_sequence_scope_balance_loss_is_the_mean_over_sequences():
    """Mutant: ``lb_scope="sequence"`` silently computed as the batch loss."""
    torch.manual_seed(0)
    layer = mode.DroplessMoE(D, 32, 4, top_k=1, lb_scope="sequence", lb_coef=1.0)
    v = torch.randn(D)
    x = torch.stack([v + 0.3 * torch.randn(8, D), -v + 0.3 * torch.randn(8, D)])  # two unlike sequences
    layer(x)
    with torch.no_grad():
        logits = layer.router_logits(x.view(-1, D))
        probs = torch.softmax(logits, -1).view(2, 8, -1)
        experts = logits.argmax(-1).view(2, 8, 1)
        per_sequence = (load_balance_loss(probs[0], experts[0]) + load_balance_loss(probs[1], experts[1])) / 2
        batch = load_balance_loss(probs.view(16, -1), experts.view(16, 1))
    assert_close(layer.metrics["lb_loss"], per_sequence, "reduction")
    assert abs(float(per_sequence) - float(batch)) > 1e-3


def test_router_jitter_is_training_only():
    """Mutant: jitter applied in ``eval()``."""
    torch.manual_seed(0)
    layer = mode.DroplessMoE(D, 32, 4, jitter=0.5).eval()
    x = torch.randn(32, D)
    with torch.no_grad():
        a, b = layer(x), layer(x)
        layer.jitter = 0.0
        clean = layer(x)
    assert torch.equal(a, b) and torch.equal(a, clean)
    layer.train().jitter = 0.5
    with torch.no_grad():
        assert not torch.equal(layer.router_logits(x), layer.router_logits(x))


def test_aux_loss_free_bias_uses_each_steps_own_load():
    """Mutant: the accumulated expert load never reset after an optimizer step."""
    torch.manual_seed(0)
    layer = mode.DroplessMoE(D, 32, 4, top_k=1, bias_rate=0.1).train()
    v = torch.randn(D)
    layer(v + 0.1 * torch.randn(64, D))
    layer.after_optimizer_step()
    assert layer._load_sum.eq(0).all()
    before = layer.selection_bias.clone()
    x2 = -v + 0.1 * torch.randn(64, D)
    layer(x2)
    load2 = layer.metrics["load"]
    layer.after_optimizer_step()
    expected = before + 0.1 * torch.sign(load2.mean() - load2)
    assert_close(layer.selection_bias, expected, "elementwise")


def a2a_worker(rank: int, world: int, out_dir: str) -> None:
    from mode.parallel.all_to_all import all_to_all
    from mode.parallel.mesh import init_mesh

    ctx = init_mesh(dp=1, ep=world)
    send = [[1, 3], [2, 1]][rank]  # uneven, and different from what each rank receives
    recv = [[1, 2], [3, 1]][rank]
    x = (torch.arange(sum(send), dtype=torch.float32) + 10 * rank).unsqueeze(-1).repeat(1, 2).requires_grad_(True)
    y = all_to_all(x, send, recv, ctx.ep_group)
    weight = torch.arange(1, y.shape[0] + 1, dtype=torch.float32).unsqueeze(-1) * (rank + 1)
    (y * weight).sum().backward()
    torch.save({"y": y.detach(), "grad": x.grad}, Path(out_dir) / f"a2a{rank}.pt")
    dist.barrier()


@pytest.mark.slow
def test_all_to_all_backward_takes_the_reverse_route(tmp_path):
    """Mutant: the all-to-all backward with its split sizes swapped."""
    run_workers(a2a_worker, 2, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"a2a{r}.pt") for r in range(2))
    # Rank 0 sent row 0 to itself and rows 1-3 to rank 1; rank 1 sent rows 0-1 to rank 0, row 2 to itself.
    assert r0["y"][:, 0].tolist() == [0.0, 10.0, 11.0] and r1["y"][:, 0].tolist() == [1.0, 2.0, 3.0, 12.0]
    # x.grad[i] is the weight of the row it became: rank 0's y rows weigh 1..3, rank 1's 2 * (1..4).
    assert r0["grad"][:, 0].tolist() == [1.0, 2.0, 4.0, 6.0]
    assert r1["grad"][:, 0].tolist() == [2.0, 3.0, 8.0]
