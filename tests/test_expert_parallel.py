"""Expert parallelism on real gloo process groups (2 and 4 CPU ranks) against one process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mode import DroplessMoE, IntegratedMoDEBlock, StagedMoDEBlock, checkpoint
from mode.config import load_config
from mode.model import MoDETransformer
from mode.parallel.expert_parallel import dispatch_stats, parallelize
from mode.parallel.mesh import ONE_PROCESS, check_sizes, init_mesh
from tests.dist_utils import run_workers
from tests.tiny import TINY
from tests.tolerances import assert_close

pytestmark = pytest.mark.slow  # real gloo process groups and torchrun

D, F_, E, N_PER_RANK = 16, 32, 8, 12
ROOT = Path(__file__).resolve().parent.parent


def build(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "moe":
        layer = DroplessMoE(D, F_, E, 2, lb_coef=0.0, z_coef=0.0)
    elif kind == "staged":
        layer = StagedMoDEBlock(D, 4, capacity=0.5, n_experts=E, top_k=2, lb_coef=0.0, z_coef=0.0)
    else:
        layer = IntegratedMoDEBlock(D, 4, n_experts=E, n_noop=4, top_k=2, lb_coef=0.0, z_coef=0.0)
    return layer


def inputs(kind: str, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    shape = (world * N_PER_RANK, D) if kind == "moe" else (world * 2, 6, D)
    # Positive inputs and a router that dislikes the last rank's experts: that rank gets no tokens.
    x = torch.rand(*shape, generator=gen) + 0.1
    return x, torch.randn(*shape, generator=gen)


def starve_last_rank(layer: torch.nn.Module, world: int) -> None:
    with torch.no_grad():
        for m in layer.modules():
            if isinstance(m, DroplessMoE):
                m.router.weight[E - E // world : E] = -1.0


def ep_worker(rank: int, world: int, kind: str, out_dir: str) -> None:
    ctx = init_mesh(dp=1, ep=world)
    layer = build(kind)
    starve_last_rank(layer, world)
    parallelize(layer, ctx)
    x, g = inputs(kind, world)
    rows = slice(rank * (x.shape[0] // world), (rank + 1) * (x.shape[0] // world))
    x_local = x[rows].clone().requires_grad_(True)
    y = layer(x_local)
    (y * g[rows]).sum().backward()
    replicated = {n: p.grad.clone() for n, p in layer.named_parameters() if "experts" not in n}
    for grad in replicated.values():
        dist.all_reduce(grad)  # each rank holds its tokens' share of the replicated gradients
    experts = {n: p.grad for n, p in layer.named_parameters() if "experts" in n}
    torch.save(
        {
            "y": y.detach(),
            "x_grad": x_local.grad,
            "replicated": replicated,
            "experts": experts,
            "stats": dispatch_stats(layer),
        },
        Path(out_dir) / f"rank{rank}.pt",
    )


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", ["moe", "staged", "integrated"])
def test_expert_parallel_equals_single_process(kind, world, tmp_path):
    run_workers(ep_worker, world, kind, str(tmp_path))
    layer = build(kind)
    starve_last_rank(layer, world)
    x, g = inputs(kind, world)
    x = x.requires_grad_(True)
    y = layer(x)
    (y * g).sum().backward()
    per_rank = x.shape[0] // world
    E_local = E // world
    for rank in range(world):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        assert_close(got["y"], y[rows].detach(), "layer")
        assert_close(got["x_grad"], x.grad[rows], "layer")
        params = dict(layer.named_parameters())
        for name, grad in got["replicated"].items():
            assert_close(grad, params[name].grad, "layer", msg=name)
        for name, grad in got["experts"].items():
            full = params[name].grad[rank * E_local : (rank + 1) * E_local]
            assert_close(grad, full, "layer", msg=name)
            if kind == "moe" and rank == world - 1:
                assert torch.all(grad == 0)  # this rank's experts received no tokens
        assert got["stats"]["calls"] == 1


TRAIN = [*TINY, "model.layout=dense,moe", "model.moe.lb_coef=0"]


def torchrun(nproc: int, overrides: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "-m",
        "mode.train",
        *overrides,
    ]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def losses(out_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_torchrun_dp2_ep2_matches_single_process_and_reloads_with_ep1(tmp_path):
    proc = torchrun(4, [*TRAIN, "parallel.dp_size=2", "parallel.ep_size=2", f"train.out_dir={tmp_path / 'ep'}"])
    # The workers' first traceback is at the top of stderr; torchrun's summary at the end.
    assert proc.returncode == 0, proc.stderr[:4000] + "\n...\n" + proc.stderr[-1500:]
    from mode.checkpoint import checkpoint_config, load_checkpoint
    from mode.step import build_optimizer
    from mode.train import train

    cfg = load_config(None, [*TRAIN, f"train.out_dir={tmp_path / 'single'}"])
    single_model, _ = train(cfg)
    ep_losses, single_losses = losses(tmp_path / "ep"), losses(tmp_path / "single")
    assert len(ep_losses) == len(single_losses) == 10
    for a, b in zip(ep_losses, single_losses, strict=True):
        assert abs(a - b) <= 1e-4, (ep_losses, single_losses)
    # The sharded checkpoint written with ep_size=2 loads into one plain process (ep_size=1),
    # through the same entry point as a single-process checkpoint, with the config it saved.
    path = tmp_path / "ep" / "ckpt"
    assert checkpoint_config(path).parallel.ep_size == 2
    reloaded = MoDETransformer(checkpoint_config(path).model).eval()
    assert load_checkpoint(path, reloaded) == 10
    opt = build_optimizer(reloaded, cfg.train)
    assert load_checkpoint(path, reloaded, opt) == 10  # the sharded optimizer state too
    assert all(float(state["step"]) == 10 for state in opt.state.values())
    idx = torch.randint(0, 256, (2, 32))
    single_model.eval()
    assert_close(reloaded(idx)[0], single_model(idx)[0], "model")


def test_mismatched_sizes_give_clear_errors():
    with pytest.raises(ValueError, match="dp_size \\* parallel.ep_size"):
        check_sizes(4, 2, 1)
    with pytest.raises(ValueError, match="not divisible by parallel.ep_size"):
        check_sizes(4, 1, 4, n_experts=6)
    with pytest.raises(ValueError, match="parallel.ep_size"):
        load_config("moe", ["parallel.ep_size=3"])


def test_torchrun_with_wrong_world_size_fails_clearly(tmp_path):
    proc = torchrun(2, [*TRAIN, "parallel.dp_size=2", "parallel.ep_size=2", f"train.out_dir={tmp_path}"])
    assert proc.returncode != 0
    assert "world_size=2 must equal parallel.dp_size * parallel.ep_size" in proc.stderr


CKPT_MODEL = [
    "model.d_model=32",
    "model.n_heads=4",
    "model.n_layers=2",
    "model.seq_len=16",
    "model.layout=dense,mode_staged",
    "model.moe.n_experts=4",
    "model.mod.capacity=0.5",
]


def ckpt_worker(rank: int, world: int, path: str) -> None:
    ctx = init_mesh(dp=1, ep=world)
    cfg = load_config(None, CKPT_MODEL).model
    torch.manual_seed(0)
    model = parallelize(MoDETransformer(cfg), ctx).eval()
    checkpoint.save_sharded(path, model, ctx, extra={"step": 3})
    torch.manual_seed(123)  # different weights until loaded
    fresh = parallelize(MoDETransformer(cfg), ctx).eval()
    assert checkpoint.load_sharded(path, fresh, ctx)["step"] == 3
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(rank))
    assert_close(fresh(idx)[0], model(idx)[0], "exact")


def test_sharded_checkpoint_reloads_on_the_same_layout(tmp_path):
    run_workers(ckpt_worker, 2, str(tmp_path / "ckpt"))
    assert (tmp_path / "ckpt" / ".metadata").exists()


def test_crash_mid_save_leaves_the_last_good_checkpoint(tmp_path):
    cfg = load_config(None, CKPT_MODEL).model
    torch.manual_seed(0)
    model = MoDETransformer(cfg).eval()
    path = tmp_path / "ckpt"
    checkpoint.save_sharded(path, model, ONE_PROCESS, extra={"step": 1})
    with torch.no_grad():
        model.tok_emb.weight.add_(1.0)
    with pytest.raises(Exception):  # noqa: B017 (the pickler's error type is not ours to pin)
        checkpoint.save_sharded(path, model, ONE_PROCESS, extra={"step": 2, "unpicklable": lambda: None})
    torch.manual_seed(0)
    restored = MoDETransformer(cfg).eval()
    assert checkpoint.load_sharded(path, restored, ONE_PROCESS)["step"] == 1
    torch.manual_seed(0)
    assert_close(restored.tok_emb.weight, MoDETransformer(cfg).tok_emb.weight, "exact")
    # Written outside mode.train (no RNG state, no config): the model still loads.
    from mode.checkpoint import checkpoint_config, load_checkpoint

    assert load_checkpoint(path, MoDETransformer(cfg)) == 1
    with pytest.raises(ValueError, match="no training config"):
        checkpoint_config(path)


def bias_worker(rank: int, world: int, out_dir: str) -> None:
    from mode.train import train

    overrides = ["model.layout=mode_staged,moe", "model.mod.causal=predictor", "model.moe.bias_rate=0.01"]
    cfg = load_config(None, [*TRAIN, *overrides, "train.steps=3", "parallel.dp_size=2", f"train.out_dir={out_dir}"])
    model, _ = train(cfg)
    state = model.state_dict()
    moved = {k: v for k, v in state.items() if k.endswith(("selection_bias", "threshold"))}
    assert sum(k.endswith("selection_bias") for k in moved) == 2 and sum(k.endswith("threshold") for k in moved) == 1
    for name, value in moved.items():
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        gathered = [torch.empty_like(value) for _ in range(world)]
        dist.all_gather(gathered, value.contiguous())
        assert value.abs().sum() > 0, name  # the state moved
        for other in gathered:
            assert torch.equal(other, value), name  # and stayed identical on every replica


def test_routing_state_stays_identical_across_data_parallel_ranks(tmp_path):
    """Each rank's recorded expert load and k-th scores are summed over the ranks
    (``mode.routed.step_records``) before the selection biases and the predictor's running
    threshold move."""
    run_workers(bias_worker, 2, str(tmp_path))


# -- a rank with nothing to dispatch ---------------------------------------------------------
# Rank 1 either sends every local token to a no-op expert (integrated MoDE) or has an empty
# local batch. Its combine must stay connected to the all-to-all outputs, or its backward
# skips both collectives while rank 0 waits in them (a hang). The process group gets a short
# timeout so that a regression fails the test instead of hanging CI.
NOOP = 4


def starving_direction() -> torch.Tensor:
    return torch.randn(D, generator=torch.Generator().manual_seed(3))


def starving_layer(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "integrated":
        layer = IntegratedMoDEBlock(D, 4, n_experts=E, n_noop=NOOP, top_k=2, lb_coef=0.01, z_coef=0.001)
    elif kind == "staged":
        layer = StagedMoDEBlock(D, 4, capacity=0.5, n_experts=E, top_k=2, lb_coef=0.01, z_coef=0.001)
    else:
        layer = DroplessMoE(D, F_, E, 2, n_noop=NOOP, lb_coef=0.01, z_coef=0.001)
    with torch.no_grad():
        for m in layer.modules():
            if isinstance(m, DroplessMoE):
                # No-op logits follow the input's projection on one direction v, real experts
                # stay near zero: +v goes to no-op experts only, -v to real experts only.
                m.router.weight.mul_(0.01)
                m.router.weight[E:] = starving_direction()
    return layer


def starving_inputs(kind: str, case: str) -> list[torch.Tensor]:
    """Per-rank inputs for 2 ranks: rank 0 routes to real experts, rank 1 to no-ops or nothing
    (the integrated block's LayerNorm keeps the direction of a large +-v input)."""
    gen = torch.Generator().manual_seed(2)
    shape = (12, D) if kind == "moe" else (2, 6, D)
    v = 10 * starving_direction()
    x0 = -v + 0.1 * torch.randn(*shape, generator=gen)
    x1 = v + 0.1 * torch.randn(*shape, generator=gen)
    if case == "empty":
        x1 = x1[:0]
    return [x0, x1]


def starving_worker(rank: int, world: int, kind: str, case: str, out_dir: str) -> None:
    from datetime import timedelta

    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    ctx = init_mesh(dp=1, ep=world)
    layer = parallelize(starving_layer(kind), ctx)
    x = starving_inputs(kind, case)[rank].clone().requires_grad_(True)
    y = layer(x)
    loss = (y * y).sum() + sum(v for m in layer.modules() for v in getattr(m, "aux_losses", {}).values())
    loss.backward()
    # A rank with no tokens leaves some replicated weights without a gradient (zero).
    grads = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in layer.named_parameters()}
    replicated = {n: g for n, g in grads.items() if "experts" not in n}
    for grad in replicated.values():
        dist.all_reduce(grad)
    experts = {n: g for n, g in grads.items() if "experts" in n}
    dispatched = [m.metrics["dispatched"] for m in layer.modules() if isinstance(m, DroplessMoE)][0]
    torch.save(
        {"y": y.detach(), "x_grad": x.grad, "replicated": replicated, "experts": experts, "dispatched": dispatched},
        Path(out_dir) / f"rank{rank}.pt",
    )


@pytest.mark.parametrize(
    "kind,case",
    [("moe", "all_noop"), ("moe", "empty"), ("integrated", "all_noop"), ("integrated", "empty"), ("staged", "empty")],
)
def test_rank_with_nothing_to_dispatch_does_not_hang(kind, case, tmp_path):
    run_workers(starving_worker, 2, kind, case, str(tmp_path))
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert got[1]["dispatched"] == 0 < got[0]["dispatched"]  # the scenario holds
    # Each rank's result equals running the layer on that rank's input alone, single process
    # (its losses are per rank), and the gradients sum over the ranks.
    layer = starving_layer(kind)
    for rank, x in enumerate(starving_inputs(kind, case)):
        x = x.clone().requires_grad_(True)
        y = layer(x)
        loss = (y * y).sum() + sum(v for m in layer.modules() for v in getattr(m, "aux_losses", {}).values())
        loss.backward()
        assert torch.isfinite(loss)
        assert_close(got[rank]["y"], y.detach(), "layer")
        assert_close(got[rank]["x_grad"], x.grad, "layer")
    params = dict(layer.named_parameters())
    for name, grad in got[0]["replicated"].items():
        assert_close(grad, params[name].grad, "layer", msg=name)
    for rank in range(2):
        for name, grad in got[rank]["experts"].items():
            full = params[name].grad[rank * E // 2 : (rank + 1) * E // 2]
            assert_close(grad, full, "layer", msg=name)
