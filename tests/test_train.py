"""Training smoke tests on a real slice of the embedded corpus, with real checkpoints on disk."""

import json

import pytest
import torch

from mode.checkpoint import checkpoint_config, load_checkpoint
from mode.config import load_config
from mode.model import MoDETransformer
from mode.train import train
from tests.tiny import TINY

# Wider and longer than the shared tiny run: these runs must learn (the loss falls by a nat).
TINY = [*TINY, "model.d_model=64", "model.seq_len=64", "train.eval_batches=2", "train.warmup_steps=5"]


def test_mod_lm_loss_falls_in_30_steps(tmp_path):
    cfg = load_config("mod", TINY + ["train.steps=30", "train.eval_every=30", f"train.out_dir={tmp_path}"])
    _, result = train(cfg)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    first, last = lines[0]["loss"], lines[-1]["loss"]
    assert last < first - 1.0, (first, last)  # from ~5.5 nats toward byte statistics
    assert result.val_loss < 4.0
    assert "blocks.1/routed_share" in lines[-1]


def test_checkpoint_resume_continues_identically(tmp_path):
    # NOTE: no time budget: with the presets' max_seconds the cosine schedule's progress is
    # max(step share, elapsed / max_seconds), so the first step after warm-up took an lr that
    # depended on each run's wall-clock (1e-5 apart): the loss then differed in its last bits
    # about once in six runs, more on a loaded machine. Step-only schedules resume exactly.
    base = TINY + ["train.steps=10", "train.eval_every=5", "train.max_seconds=0"]
    _, straight = train(load_config("mod", base + [f"train.out_dir={tmp_path / 'a'}"]))
    cfg_b = load_config("mod", base + [f"train.out_dir={tmp_path / 'b'}"])
    _, first_half = train(cfg_b, stop_at=5)
    assert first_half.steps == 5 and load_checkpoint(tmp_path / "b" / "ckpt.pt", MoDETransformer(cfg_b.model)) == 5
    cfg_resumed = load_config("mod", base + [f"train.out_dir={tmp_path / 'b'}", "train.resume=true"])
    _, resumed = train(cfg_resumed)
    assert resumed.steps == 10
    a, b = MoDETransformer(cfg_b.model), MoDETransformer(cfg_b.model)
    load_checkpoint(tmp_path / "a" / "ckpt.pt", a)
    load_checkpoint(tmp_path / "b" / "ckpt.pt", b)
    # Parameters and buffers (e.g. the routing predictor's running threshold) resume exactly.
    assert any(name.endswith("predictor.threshold") for name in a.state_dict())
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), name  # bit for bit
    assert checkpoint_config(tmp_path / "b" / "ckpt.pt") == cfg_resumed  # the config that wrote it
    assert resumed.train_loss == straight.train_loss


def test_print_flops_lists_every_preset(capsys):
    from mode.config import preset_names
    from mode.train import main

    main(["--print-flops"])
    out = capsys.readouterr().out
    for name in preset_names():
        if name != "base":
            assert name in out
    assert "active params" in out


def _records(out_dir) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_resume_continues_the_time_budget_and_its_schedule(tmp_path):
    """A preempted time-budgeted run resumes with the time it already spent: the learning
    rate continues from where it was (no jump back to the peak), and a run whose budget is
    spent trains no further step when resumed."""
    from mode.step import lr_at

    base = TINY + ["train.steps=100000", "train.warmup_steps=1", "train.eval_every=100000", f"train.out_dir={tmp_path}"]
    cfg = load_config("dense", base + ["train.max_seconds=600"])
    train(cfg, stop_at=4)
    _, resumed = train(load_config("dense", base + ["train.max_seconds=600", "train.resume=true"]), stop_at=5)
    assert resumed.steps == 5
    before, after = _records(tmp_path)[3], _records(tmp_path)[4]
    assert (before["step"], after["step"]) == (4, 5)
    assert after["elapsed"] > before["elapsed"]
    # Step 5's rate is the schedule at the time spent before it, not at a restarted clock.
    assert after["lr"] == lr_at(4, cfg.train, before["elapsed"])
    assert after["lr"] < before["lr"]

    spent = load_config("dense", base + ["train.max_seconds=0.5", "train.overwrite=true"])  # a new run there
    _, first = train(spent)
    assert 0 < first.steps < 100000
    _, again = train(load_config("dense", base + ["train.max_seconds=0.5", "train.resume=true"]))
    assert again.steps == first.steps


def test_same_seed_same_losses_on_cpu(tmp_path):
    # A step-based schedule: with the preset's time budget (max_seconds) the learning rate
    # after warm-up follows the wall-clock, so a loaded machine gave a different last update
    # (the flake this test once had under pytest-xdist).
    base = TINY + ["train.steps=6", "train.eval_every=6", "model.layout=dense,mode_staged", "model.moe.n_experts=4"]
    base += ["train.max_seconds=0"]
    _, a = train(load_config("mod", base + [f"train.out_dir={tmp_path / 'a'}"]))
    _, b = train(load_config("mod", base + [f"train.out_dir={tmp_path / 'b'}"]))
    assert [r["loss"] for r in _records(tmp_path / "a")] == [r["loss"] for r in _records(tmp_path / "b")]
    assert a.val_loss == b.val_loss


def test_the_last_line_reports_causal_routing_only_for_a_model_that_has_it(tmp_path, capsys):
    from mode.train import main

    for preset in ("dense", "mod"):
        main(["--config", preset, *TINY, "train.steps=2", "train.eval_every=2", f"train.out_dir={tmp_path / preset}"])
    dense, mod = [line for line in capsys.readouterr().out.splitlines() if "median step" in line]
    assert dense.startswith("dense:") and "causal" not in dense and "nan" not in dense, dense
    assert mod.startswith("mod:") and "causal-routing val loss" in mod and "nan" not in mod, mod


def test_the_progress_bar_follows_a_time_budget_and_shows_no_loss_before_one_exists(tmp_path, capsys):
    """A run the time budget ends (100000 steps, 3 s) fills its bar to 100% of the budget, not
    a few steps of 100000; before the first evaluation no validation loss is shown (no nan)."""
    overrides = ["train.progress=true", "train.steps=100000", "train.max_seconds=3", "train.eval_every=100000"]
    train(load_config("dense", [*TINY, *overrides, f"train.out_dir={tmp_path / 'time'}"]))
    bar = capsys.readouterr().err.replace("\r", "\n").splitlines()
    shown = [line for line in bar if "of the budget" in line]
    assert shown and "100% of the budget" in shown[-1] and "/100000" not in "".join(bar), shown[-3:]
    assert not any("nan" in line for line in shown[:-1]), shown
    train(load_config("dense", [*TINY, "train.progress=true", "train.steps=3", f"train.out_dir={tmp_path / 'steps'}"]))
    assert "3/3" in capsys.readouterr().err


def test_the_last_record_of_a_time_budgeted_run_carries_the_routing_metrics(tmp_path):
    """The step a time budget ends is planned as the last before it runs (mode.cadence): it
    computes its routing metrics, so the last record has every one a logged step has, and a
    router collapse planted in the model is warned of there."""
    import torch

    from mode.model import MoDETransformer

    common = [*TINY, "model.layout=dense,moe", "model.moe.top_k=1", "model.moe.bias_rate=1e-6"]
    cfg = load_config("moe", [*common, "train.steps=2", "train.log_every=1", f"train.out_dir={tmp_path / 'a'}"])
    train(cfg)
    logged = set(_records(tmp_path / "a")[-1])
    timed = ["train.steps=100000", "train.max_seconds=1.5", "train.log_every=100000", "train.eval_every=100000"]
    cfg = load_config("moe", [*common, *timed, f"train.out_dir={tmp_path / 'b'}"])
    model = MoDETransformer(cfg.model)
    with torch.no_grad():
        model.blocks[1].mlp.selection_bias[0] = 1e4  # every token picks expert 0: a collapsed router
    train(cfg, model)
    records = _records(tmp_path / "b")
    assert len(records) == 1 and records[0]["step"] > 1  # only the last step is recorded
    routing = {k for k in logged if "/" in k}
    assert routing and routing <= set(records[0]), routing - set(records[0])
    assert any("one expert takes 100%" in w for w in records[0]["warnings"])


def test_the_cadence_answers_every_job_of_a_step_once():
    from mode.cadence import Cadence

    tc = load_config("dense", ["train.steps=10", "train.log_every=3", "train.eval_every=4", "train.ckpt_every=5"]).train
    cadence = Cadence(tc, stop_at=None)
    plans = {done: cadence.plan(done) for done in range(1, 11)}
    assert [d for d, p in plans.items() if p.record] == [3, 4, 5, 6, 8, 9, 10]
    assert [d for d, p in plans.items() if p.evaluate] == [4, 8, 10]
    assert [d for d, p in plans.items() if p.save] == [5, 10]
    assert [d for d, p in plans.items() if p.last] == [10]
    assert all(p.metrics == p.record for p in plans.values())
    # the budget spent on an unrecorded step: one more step, planned last; on a recorded one: it ends there
    assert not cadence.after(plans[1], overdue=True).last and cadence.plan(2, overdue=True).last
    assert cadence.after(plans[3], overdue=True).last and cadence.after(plans[3], overdue=True).evaluate
    assert Cadence(tc, stop_at=7).plan(7).last


def test_training_validation_is_the_mean_loss_over_the_same_fixed_windows():
    """``mode.train.evaluate`` (the loop mode-eval shares, ``mode.evaluation``): the mean of
    the model's own losses over windows drawn by a generator seeded 0, the same on every call."""
    import torch

    from mode.data import load_corpus
    from mode.model import MoDETransformer
    from mode.train import evaluate

    cfg = load_config("mod", TINY)
    model = MoDETransformer(cfg.model).train()
    val = load_corpus(cfg.data.source, cfg.model.seq_len, cfg.data.val_fraction, cfg.data.cache_dir).val
    loss, metrics = evaluate(model, val, 4, 3)
    assert model.training  # as it was
    gen, want = torch.Generator().manual_seed(0), []
    model.eval()
    with torch.no_grad():
        for _ in range(3):
            x, y = val.batch(4, gen)
            want.append(model(x, y)[1].item())
    assert loss == pytest.approx(sum(want) / 3, rel=1e-6)
    assert evaluate(model, val, 4, 3)[0] == pytest.approx(loss, rel=1e-6)
    assert any(k.endswith("/routed_share") or "routed" in k for k in metrics), sorted(metrics)
