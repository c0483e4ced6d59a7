"""``train.compile``: every block kind compiles whole (``fullgraph=True``: a graph break
raises) and gives eager's values and every gradient; compiled blocks give the eager step's
losses, and after warm-up a step compiles nothing new (no recompiles, though the dropless
MoE's expert sizes and the routed token counts change every step).

One model holds every block kind, so each kind is compiled once for all the checks (a cold
compile of a block costs seconds on a CPU); the MoD and MoE blocks' own compile tests were
folded into it."""

import copy
import json

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from mode.compile import compile_blocks
from mode.config import load_config
from mode.model import MoDETransformer
from mode.step import LMObjective, build_optimizer, train_step
from mode.train import train
from tests.tiny import TINY_MODEL
from tests.tolerances import assert_close

pytestmark = pytest.mark.slow  # torch.compile

# Every block kind of every preset, in one model: each kind is compiled once. Under inductor
# (C++ code generation: ~10 s of CPU per kind, cold) the kinds that hold the others: a MoD
# block computes a dense block inside, a staged MoDE block an MoE block; those two are compiled
# whole on their own by the test below, traced only (aot_eager).
EVERY_KIND = "mod,mod_random,moe_capacity,mode_staged,mode_integrated"
SMALL = TINY_MODEL  # the every-kind model overrides n_layers
# Warm-up: the first step compiles each block kind; later steps recompile a few graphs once,
# when a data-dependent size first differs from the value compiled in (automatic dynamic
# shapes then make it symbolic: the capacity MoE's kept assignments, the dropless MoE's
# assignment count); after that, nothing, however the sizes move.
WARMUP, AFTER, MAX_WARMUP_RECOMPILES = 6, 6, 4


def test_every_kind_compiles_whole_matches_eager_and_stops_compiling_after_warmup():
    torch._dynamo.reset()
    counters.clear()
    layout = [f"model.layout={EVERY_KIND}", "model.n_layers=5", "model.moe.n_noop=4", "model.mod.causal=predictor"]
    cfg = load_config(None, [*SMALL, *layout])
    torch.manual_seed(0)
    eager = MoDETransformer(cfg.model)
    compiled = copy.deepcopy(eager)
    compile_blocks(compiled, fullgraph=True)  # each kind whole: a graph break raises
    # Values and every gradient (LM loss and every router's auxiliary losses), before any step.
    x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(2))
    grads, losses = [], []
    for model in (eager, compiled):
        torch.manual_seed(1)  # random routing draws the same tokens
        loss, aux = LMObjective(model)(x, x)
        (loss + aux).backward()
        losses.append(torch.stack([loss, aux]).detach())
        grads.append({n: p.grad for n, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    assert_close(losses[1], losses[0], "layer_grad")
    for name, g in grads[0].items():
        got = grads[1][name]
        if g is None:  # a compiled graph returns zeros where eager leaves None
            assert got is None or not got.any(), name
            continue
        assert_close(got, g, "layer_grad", msg=name)
    assert {n.split(".")[1] for n in grads[0] if n.startswith("blocks.")} == {str(i) for i in range(5)}
    opts = build_optimizer(eager, cfg.train), build_optimizer(compiled, cfg.train)
    gen = torch.Generator().manual_seed(1)
    after_warmup = None
    for step in range(WARMUP + AFTER):
        if step == 1:
            after_first = counters["stats"]["unique_graphs"]
        if step == WARMUP:
            after_warmup = counters["stats"]["unique_graphs"]
        x = torch.randint(0, 256, (4, 32), generator=gen)
        y = torch.randint(0, 256, (4, 32), generator=gen)
        torch.manual_seed(step)
        ref = train_step(eager, opts[0], x, y, grad_clip=1.0)
        torch.manual_seed(step)
        got = train_step(compiled, opts[1], x, y, grad_clip=1.0)
        assert_close(got.loss, ref.loss, "training", msg=f"step {step}")
        assert_close(got.aux, ref.aux, "training", msg=f"step {step}")
    assert after_first > 0, "nothing was compiled"
    assert after_warmup - after_first <= MAX_WARMUP_RECOMPILES
    assert counters["stats"]["unique_graphs"] == after_warmup, "recompiled after warm-up"


def test_dense_and_moe_blocks_compile_whole_on_their_own():
    """The two kinds the inductor test above compiles only inside others, whole (a graph break
    raises) with eager's values and gradients, traced by dynamo and AOT autograd."""
    cfg = load_config(None, [*SMALL, "model.layout=dense,moe"])
    torch.manual_seed(0)
    eager = MoDETransformer(cfg.model)
    compiled = copy.deepcopy(eager)
    compile_blocks(compiled, fullgraph=True, backend="aot_eager")
    x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(2))
    results = []
    for model in (eager, compiled):
        loss, aux = LMObjective(model)(x, x)
        (loss + aux).backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    assert_close(results[1][0], results[0][0], "layer_grad")
    for name, g in results[0][1].items():
        assert_close(results[1][1][name], g, "layer_grad", msg=name)


@pytest.mark.slow
def test_train_compile_flag_trains(tmp_path):
    overrides = [*SMALL, "train.compile=true", "train.steps=3", "train.batch_size=4"]
    # dense blocks: what is proven here is that train() compiles the blocks in place and trains;
    # every kind's compiled values and gradients are the test above's
    cfg = load_config("dense", [*overrides, "train.max_seconds=0", "train.eval_every=3", "train.eval_batches=1"])
    cfg.train.out_dir, cfg.train.progress, cfg.train.log_every = str(tmp_path), False, 1
    model, result = train(cfg)
    assert result.steps == 3 and result.val_loss == result.val_loss  # finite, not NaN
    assert all(b._compiled_call_impl is not None for b in model.blocks)  # nn.Module.compile in place
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3


# The steps of the recompile check: the first step (a logging one, as the training
# loop's), then 2 logging and 3 non-logging steps, interleaved.
LOGGED_STEPS = [True, True, False, False, True, False]


@pytest.mark.parametrize(
    "preset", ["dense", "mod", "mod_random", "moe", "moe_capacity", "mode_staged", "mode_integrated", "early_exit"]
)
def test_no_recompile_after_the_first_step(preset):
    """Every compile happens in the first step: the routing-metrics flag is no guard (metrics
    are computed in the graph), and no size or state a later step brings recompiles a block
    or a compiled step piece. Dynamo's guards decide recompiles before any backend runs, so
    ``aot_eager`` (no code generation) counts what inductor would."""
    torch._dynamo.reset()
    counters.clear()
    cfg = load_config(preset, [*SMALL, "train.grad_clip=1.0"])
    torch.manual_seed(0)
    model = MoDETransformer(cfg.model)
    compile_blocks(model, fullgraph=True, backend="aot_eager")
    opt = build_optimizer(model, cfg.train)
    gen = torch.Generator().manual_seed(0)
    graphs = []
    for metrics in LOGGED_STEPS:
        x, y = (torch.randint(0, cfg.model.vocab_size, (4, 32), generator=gen) for _ in range(2))
        train_step(model, opt, x, y, cfg.train.grad_clip, metrics=metrics)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0, "nothing was compiled"
    assert graphs == [graphs[0]] * len(graphs), f"graphs compiled after each step: {graphs}"


@pytest.mark.parametrize("preset", ["mod", "mode_staged"])
def test_causal_evaluation_compiles_whole_once(preset):
    """An evaluation in causal routing through compiled blocks: no graph break (``fullgraph``
    raises on one) and one compile per block kind for every batch, whatever each row routes
    (compiled code packs the routed tokens to the sequence length, a static size); the
    values are eager's."""
    torch._dynamo.reset()
    counters.clear()
    cfg = load_config(preset, [*SMALL, "model.mod.causal=predictor"])
    torch.manual_seed(0)
    eager = MoDETransformer(cfg.model).eval()
    compiled = copy.deepcopy(eager)
    compile_blocks(compiled, fullgraph=True, backend="aot_eager")
    gen = torch.Generator().manual_seed(3)
    graphs = []
    with torch.no_grad():
        for _ in range(3):
            x = torch.randint(0, cfg.model.vocab_size, (3, 32), generator=gen)
            want, _ = eager(x, routing="causal")
            got, _ = compiled(x, routing="causal")
            assert_close(got, want, "layer_grad")
            graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs == [graphs[0]] * 3, graphs
