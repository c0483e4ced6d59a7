"""The optimizer step as users run it: gradient accumulation, activation checkpointing, and
what the log measures (throughput, MFU, peak memory, a profiler trace)."""

import json

import pytest
import torch

from mode.config import load_config
from mode.experts.moe import MoELayer
from mode.flops import train_flops_per_step
from mode.layers.predictor import RoutingPredictor
from mode.layers.recompute import checkpoint_blocks
from mode.model import MoDETransformer
from mode.step import LMObjective, train_step
from mode.train import train
from tests.tiny import TINY_MODEL
from tests.tolerances import assert_close

SMALL = [
    *TINY_MODEL,
    "model.moe.lb_scope=sequence",  # a mean over sequences: linear in the micro-batches
    "model.moe.bias_rate=0.01",
    "train.grad_clip=0",
]


class RecordingSGD(torch.optim.SGD):
    """Plain SGD that keeps a copy of the gradients it was asked to apply."""

    def step(self, closure=None):
        self.grads = [p.grad.clone() for group in self.param_groups for p in group["params"]]
        return super().step(closure)


def one_step(preset: str, x, y, accum: int = 1, checkpoint: str = "none"):
    torch.manual_seed(0)
    model = MoDETransformer(load_config(preset, SMALL).model).train()
    checkpoint_blocks(model.blocks, checkpoint)
    opt = RecordingSGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)  # the same router jitter / RNG draws in every variant
    result = train_step(model, opt, x, y, accum_steps=accum)
    return model, opt, result


def routing_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state that moves once per optimizer step (predictor thresholds, expert biases)."""
    return {k: v.clone() for k, v in model.state_dict().items() if "threshold" in k or "selection_bias" in k}


@pytest.mark.parametrize("preset", ["mod", "moe", "mode_staged", "mode_integrated"])
def test_four_micro_batches_give_the_gradients_of_one_batch_four_times_larger(preset):
    gen = torch.Generator().manual_seed(2)
    x = torch.randint(0, 256, (8, 32), generator=gen)
    y = torch.randint(0, 256, (8, 32), generator=gen)
    whole, opt1, r1 = one_step(preset, x, y)
    micro, opt4, r4 = one_step(preset, x, y, accum=4)
    assert_close(r4.loss, r1.loss, "reduction")
    assert_close(r4.aux, r1.aux, "reduction")
    for g1, g4 in zip(opt1.grads, opt4.grads, strict=True):
        assert_close(g4, g1, "reduction")
    # Routing state moved once, toward the whole batch's statistics.
    s1, s4 = routing_state(whole), routing_state(micro)
    assert s1.keys() == s4.keys() and (s1 or preset == "mod")
    for k in s1:
        assert_close(s4[k], s1[k], "reduction", msg=k)


def test_predictor_threshold_moves_once_per_optimizer_step():
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(0, 256, (4, 32), generator=gen)
    model, _, _ = one_step("mod", x, x, accum=4)
    predictors = [m for m in model.modules() if isinstance(m, RoutingPredictor)]
    assert predictors and all(m.calibrated and m.pending.sum() == 0 for m in predictors)


@pytest.mark.parametrize("mode", ["full", "every_n"])
@pytest.mark.parametrize("preset", ["mod", "mode_staged", "mode_integrated"])
def test_activation_checkpointing_changes_nothing_but_memory(preset, mode):
    gen = torch.Generator().manual_seed(4)
    x = torch.randint(0, 256, (4, 32), generator=gen)
    y = torch.randint(0, 256, (4, 32), generator=gen)
    plain, opt_p, r_p = one_step(preset, x, y)
    ckpt, opt_c, r_c = one_step(preset, x, y, checkpoint=mode)
    assert ckpt.blocks[0].forward.__name__ == "checkpointed"
    assert_close(r_c.loss, r_p.loss, "exact")
    for gp, gc in zip(opt_p.grads, opt_c.grads, strict=True):
        assert_close(gc, gp, "reduction")
    # The re-run forward updated no routing state: it moved exactly as without checkpointing.
    sp, sc = routing_state(plain), routing_state(ckpt)
    for k in sp:
        assert_close(sc[k], sp[k], "exact", msg=k)


def routing_records(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The raw records a step's forwards leave for ``after_optimizer_step`` and the logs: each
    predictor's pending (sum of k-th scores, count), each MoE layer's accumulated load, each
    expert-parallel dispatcher's counters. Sums, not ratios: a record made twice shows."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, RoutingPredictor):
            out[f"{name}.pending"] = m.pending.clone()
        if isinstance(m, MoELayer) and m.bias_rate:
            out[f"{name}.load_sum"] = m._load_sum.clone()
        stats = getattr(getattr(m, "dispatcher", None), "stats", None)
        if stats:
            out[f"{name}.dispatch"] = torch.tensor([stats[k] for k in sorted(stats)])
    return out


def forward_backward_records(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Routing records after one forward and backward of ``model`` (no optimizer step)."""
    torch.manual_seed(1)
    loss, aux = LMObjective(model)(x, y)
    (loss + aux).backward()
    return routing_records(model)


@pytest.mark.parametrize("preset", ["mod", "moe", "mode_staged", "mode_integrated"])
def test_recomputed_forwards_record_nothing(preset):
    """Mutant: the recompute guard lets the re-run forward record again (its ratios hide it)."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randint(0, 256, (4, 32), generator=gen)
    records = {}
    for mode in ("none", "full"):
        torch.manual_seed(0)
        model = MoDETransformer(load_config(preset, SMALL).model).train()
        assert checkpoint_blocks(model.blocks, mode) == (2 if mode == "full" else 0)
        records[mode] = forward_backward_records(model, x, x)
    assert records["none"], "no routing records: the test would prove nothing"
    assert all(r.abs().sum() > 0 for r in records["none"].values())
    assert records["full"].keys() == records["none"].keys()
    for k, want in records["none"].items():
        assert_close(records["full"][k], want, "exact", msg=k)


def test_checkpointing_every_n_picks_every_nth_block():
    model = MoDETransformer(load_config("mod", ["model.n_layers=6", "model.d_model=32", "model.n_heads=4"]).model)
    assert checkpoint_blocks(model.blocks, "every_n", 3) == 2
    picked = [b.forward.__name__ == "checkpointed" for b in model.blocks]
    assert picked == [True, False, False, True, False, False]


def test_the_log_has_throughput_mfu_memory_and_a_profiler_trace(tmp_path):
    cfg = load_config(
        "mod",
        [
            *SMALL,
            "train.batch_size=4",
            "train.steps=4",
            "train.max_seconds=0",
            "train.eval_every=4",
            "train.eval_batches=1",
            "train.log_every=1",
            "train.progress=false",
            "train.grad_accum_steps=2",
            "train.profile_steps=[2,3]",
            f"train.out_dir={tmp_path}",
        ],
    )
    train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    for r in rows:
        assert r["tokens_per_s"] == pytest.approx(4 * 32 / r["step_time"])
        assert r["peak_memory_mb"] > 10
    info = json.loads((tmp_path / "run_info.json").read_text())
    for r in rows:  # MFU is the achieved rate over the peak the run states (no bound on a timing)
        assert r["flops_per_s"] == pytest.approx(train_flops_per_step(cfg.model, 4) / r["step_time"])
        assert r["mfu"] == pytest.approx(r["flops_per_s"] / info["peak_flops_per_rank"])
    assert info["peak_flops_per_rank"] > 1e9 and "matmul" in info["peak_how"]
    trace = json.loads((tmp_path / "profile_rank0.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert {"step 2", "step 3"} <= names and "step 1" not in names and "step 4" not in names


def test_bad_accumulation_and_profile_settings_name_the_field():
    with pytest.raises(ValueError, match="train.grad_accum_steps"):
        load_config(None, ["train.batch_size=6", "train.grad_accum_steps=4"])
    with pytest.raises(ValueError, match="train.profile_steps"):
        load_config(None, ["train.profile_steps=[3,2]"])
    with pytest.raises(ValueError, match="train.activation_checkpoint"):
        load_config(None, ["train.activation_checkpoint=ful"])


def test_a_peak_undercut_by_other_work_is_measured_again(tmp_path, caplog):
    """A peak measured while the machine was busy is too low, and the steps then show an MFU
    above 1: the run measures the peak again, says so, and states the new peak in
    ``run_info.json``. The busy first measurement is stood in for by planting a peak of
    1 FLOP/s in the per-process cache (this machine cannot be made busy on cue)."""
    from mode import telemetry

    key = (torch.device("cpu").type, None, torch.float32)
    telemetry._PEAKS[key] = (1.0, "planted: a measurement undercut by other work")
    try:
        cfg = load_config(
            "dense", [*SMALL, "train.steps=2", "train.max_seconds=0", "train.log_every=1", f"train.out_dir={tmp_path}"]
        )
        with caplog.at_level("WARNING", logger="mode"):
            train(cfg)
    finally:
        telemetry._PEAKS.pop(key, None)
    assert "which other work on the device undercut: measured again" in caplog.text
    info = json.loads((tmp_path / "run_info.json").read_text())
    assert info["peak_flops_per_rank"] > 1e6 and "measured again" in info["peak_how"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["mfu"] for r in rows] == pytest.approx([r["flops_per_s"] / info["peak_flops_per_rank"] for r in rows])
