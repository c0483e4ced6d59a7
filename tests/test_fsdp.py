"""FSDP2 x expert parallelism on real gloo process groups (4 CPU ranks) against one process:
the loss curves of every 2-D layout, the global-batch balance loss, and checkpoints that
reshard between layouts."""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mode import checkpoint
from mode.config import load_config
from mode.model import MoDETransformer
from mode.parallel.apply import parallelize_model
from mode.parallel.mesh import ONE_PROCESS, init_mesh
from mode.step import build_optimizer
from mode.train import train
from tests.dist_utils import run_workers
from tests.tiny import TINY
from tests.tolerances import assert_close

pytestmark = pytest.mark.slow  # real gloo process groups

PRESETS = ["moe", "mode_staged", "mode_integrated"]
STEPS = 5  # enough for a layout that computes otherwise to drift past 1e-4 (the micro-batch control does)
SMALL = [*TINY, "model.moe.lb_coef=0.05", f"train.steps={STEPS}", f"train.eval_every={STEPS}"]
IDX = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(5))


def config(preset: str, out: Path, scope: str = "global_batch", dp: int = 1, ep: int = 1):
    return load_config(
        preset,
        [
            *SMALL,
            f"model.moe.lb_scope={scope}",
            f"parallel.dp_size={dp}",
            f"parallel.ep_size={ep}",
            f"train.out_dir={out}",
        ],
    )


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def full_optimizer_state(model, opt, ctx) -> dict[str, torch.Tensor]:
    """Every parameter's AdamW moments as whole tensors (collective under ``ctx``)."""
    out = {}
    for name, state in checkpoint.optimizer_state_dict(model, opt, ctx).items():
        for key in ("exp_avg", "exp_avg_sq"):
            t = state[key]
            out[f"{name}.{key}"] = t.full_tensor() if isinstance(t, torch.distributed.tensor.DTensor) else t
    return out


def logits_of(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(IDX)[0]


def layout_worker(rank, world, dp, ep, root, load_from):
    """Train every preset on the dp x ep layout; for "moe", also load ``load_from``'s
    checkpoint (another layout's) into a fresh model of this layout and keep its logits."""
    root = Path(root)
    scopes = [("moe", "micro_batch")] if dp > 1 and ep == 1 else []
    for preset, scope in [(p, "global_batch") for p in PRESETS] + scopes:
        model, _ = train(config(preset, root / f"{dp}x{ep}" / f"{preset}-{scope}", scope, dp, ep))
        if preset == "moe" and scope == "global_batch":
            ctx = init_mesh(dp, ep, 4)
            opt = build_optimizer(model, config(preset, root).train)
            checkpoint.load(root / f"{dp}x{ep}" / "moe-global_batch" / "ckpt", model, opt, ctx=ctx)
            state = full_optimizer_state(model, opt, ctx)
            logits = logits_of(model)
            if rank == 0:
                torch.save({"logits": logits, "optim": state}, root / f"{dp}x{ep}" / "final.pt")
    if load_from:
        reloaded_into_this_layout(rank, dp, ep, root, load_from)


def reloaded_into_this_layout(rank, dp, ep, root, load_from):
    root = Path(root)
    cfg = config("moe", root, dp=dp, ep=ep)
    ctx = init_mesh(dp, ep, 4)
    torch.manual_seed(123)  # different initial weights: the load must overwrite all of them
    model = parallelize_model(MoDETransformer(cfg.model), cfg, ctx)
    opt = build_optimizer(model, cfg.train)
    assert checkpoint.load(root / load_from / "moe-global_batch" / "ckpt", model, opt, ctx=ctx).step == STEPS
    state = full_optimizer_state(model, opt, ctx)
    logits = logits_of(model)
    if rank == 0:
        torch.save({"logits": logits, "optim": state}, root / f"{load_from}-into-{dp}x{ep}.pt")
    dist.barrier()


def reload_worker(rank, world, dp, ep, root, load_from):
    reloaded_into_this_layout(rank, dp, ep, root, load_from)


@pytest.mark.slow
def test_fsdp_layouts_match_one_process_and_checkpoints_reshard(tmp_path):
    # Layouts in an order that lets each load the one before: 2x2 -> 1x4 -> 4x1, then 1x4 -> 2x2.
    run_workers(layout_worker, 4, 2, 2, str(tmp_path), "")
    run_workers(layout_worker, 4, 1, 4, str(tmp_path), "2x2")
    run_workers(layout_worker, 4, 4, 1, str(tmp_path), "1x4")
    run_workers(reload_worker, 4, 2, 2, str(tmp_path), "1x4")

    for preset in PRESETS:
        _, result = train(config(preset, tmp_path / "1x1" / preset))
        single = losses(tmp_path / "1x1" / preset)
        assert len(single) == STEPS
        for layout in ("2x2", "1x4", "4x1"):
            got = losses(tmp_path / layout / f"{preset}-global_batch")
            diff = max(abs(a - b) for a, b in zip(got, single, strict=True))
            assert diff <= 1e-4, (preset, layout, got, single)
    # The control: with each rank balancing its own micro-batch, dp=4 is not the one-process run.
    local = losses(tmp_path / "4x1" / "moe-micro_batch")
    assert max(abs(a - b) for a, b in zip(local, losses(tmp_path / "1x1" / "moe"), strict=True)) > 1e-4

    # Checkpoints reshard: 2x2 -> 1x1 (a plain process, optimizer included), 2x2 -> 1x4,
    # 1x4 -> 4x1 and 1x4 -> 2x2 give the logits and AdamW moments of the model that was saved.
    cfg = config("moe", tmp_path)
    model = MoDETransformer(cfg.model)
    opt = build_optimizer(model, cfg.train)
    assert checkpoint.load(tmp_path / "2x2" / "moe-global_batch" / "ckpt", model, opt).step == STEPS
    saved_2x2 = torch.load(tmp_path / "2x2" / "final.pt")
    assert_close(logits_of(model), saved_2x2["logits"], "layer")
    single_state = full_optimizer_state(model, opt, ONE_PROCESS)
    assert single_state.keys() == saved_2x2["optim"].keys()
    for name, value in saved_2x2["optim"].items():
        assert torch.equal(single_state[name], value), name
    saved_1x4 = torch.load(tmp_path / "1x4" / "final.pt")
    for moved, saved in [("2x2-into-1x4", saved_2x2), ("1x4-into-4x1", saved_1x4), ("1x4-into-2x2", saved_1x4)]:
        got = torch.load(tmp_path / f"{moved}.pt")
        assert_close(got["logits"], saved["logits"], "layer", msg=moved)
        for name, value in saved["optim"].items():
            assert torch.equal(got["optim"][name], value), (moved, name)


def bf16_worker(rank, world, root):
    """dp=1 x ep=2 in bf16: record the dtype of the weights each module computes with."""
    seen = {}

    def record(name):
        def hook(module, args):
            seen[name] = next(module.parameters()).dtype

        return hook

    cfg = config("mode_staged", Path(root) / "bf16-1x2", ep=2)
    cfg.train.precision = "bf16"
    from mode.routed import Router

    torch.manual_seed(cfg.train.seed)  # the initial weights train() would build
    model = MoDETransformer(cfg.model)
    for name, m in model.named_modules():
        if isinstance(m, Router) or name.endswith("attn.qkv") or name.endswith("experts"):
            m.register_forward_pre_hook(record(name))
    train(cfg, model=model)
    if rank == 0:
        torch.save({k: str(v) for k, v in seen.items()}, Path(root) / "dtypes.pt")


@pytest.mark.slow
def test_bf16_under_fsdp_gathers_blocks_in_bf16_routers_in_fp32_and_tracks_fp32(tmp_path):
    run_workers(bf16_worker, 2, str(tmp_path))
    dtypes = torch.load(tmp_path / "dtypes.pt")
    assert any(k.endswith("router") for k in dtypes) and any(k.endswith("qkv") for k in dtypes)
    for name, dtype in dtypes.items():
        want = "torch.float32" if name.endswith("router") else "torch.bfloat16"
        assert dtype == want, (name, dtype)
    fp32 = tmp_path / "fp32"
    train(config("mode_staged", fp32))
    bf16, reference = losses(tmp_path / "bf16-1x2"), losses(fp32)
    # bf16 rounding (8 mantissa bits) over 10 steps of a tiny model: within 0.01 nats of fp32
    # (measured: ~5e-4; a block gathered in the wrong dtype or a wrongly scaled gradient is off
    # by more than 0.02 by the second step).
    assert max(abs(a - b) for a, b in zip(bf16, reference, strict=True)) < 0.01, (bf16, reference)


def accum_worker(rank, world, root):
    cfg = config("moe", Path(root) / "dp2-accum2", scope="sequence", dp=2)
    cfg.train.grad_accum_steps = 2  # per rank: 4 rows as 2 micro-batches of 2
    train(cfg)


@pytest.mark.slow
def test_accumulation_under_fsdp_equals_one_process_on_the_whole_batch(tmp_path):
    run_workers(accum_worker, 2, str(tmp_path))
    train(config("moe", tmp_path / "one", scope="sequence"))
    got, want = losses(tmp_path / "dp2-accum2"), losses(tmp_path / "one")
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-4, (got, want)
