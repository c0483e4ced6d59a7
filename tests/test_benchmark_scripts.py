"""Smoke tests: the benchmark scripts run end to end at tiny sizes and write their JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every test runs a benchmark script in a subprocess

ROOT = Path(__file__).resolve().parents[1]


def run_script(name: str, args: list[str], out: Path, stdout: list[str] | None = None) -> dict:
    """Run ``python -m benchmarks.<name>`` (name without .py accepted with it) writing into
    ``out``; returns {file name: JSON} of what is there."""
    env = os.environ | {"MODE_BENCH_RESULTS": str(out)}
    proc = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name.removesuffix('.py')}", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    if stdout is not None:
        stdout.append(proc.stdout)
    return {p.name: json.loads(p.read_text()) for p in out.glob("*.json")}


TINY_BLOCKS = ["--d-model", "32", "--n-heads", "2", "--seq", "64", "--batch", "2", "--repeats", "1", "--warmup", "0"]


def test_bench_blocks_tiny(tmp_path):
    results = run_script("bench_blocks.py", [*TINY_BLOCKS, "--capacities", "0.5", "0.125"], tmp_path)
    payload = results["blocks.json"]
    rows = {r["capacity"]: r for r in payload["rows"] if r["block"] == "mod"}
    assert set(rows) == {0.5, 0.125}
    for r in rows.values():
        # Without the masked half the FLOP ratio is larger (the dense block loses more attention).
        assert r["flop_ratio_unmasked"] > r["flop_ratio"]
        assert r["faults"] is None or r["faults"] >= 0
    assert "allocator_env" in payload["environment"]


def test_compare_option_diffs_matching_rows_and_rejects_a_missing_run(tmp_path):
    run_script("bench_blocks.py", [*TINY_BLOCKS, "--capacities", "0.5", "--label", "a"], tmp_path)
    out: list[str] = []
    args = [*TINY_BLOCKS, "--capacities", "0.5", "0.25", "--label", "b", "--compare", "a"]
    results = run_script("bench_blocks.py", args, tmp_path, out)
    assert {"blocks-a.json", "blocks-b.json"} <= set(results)
    table = out[0].split("compared with the run of", 1)[1].splitlines()[2:]
    assert [line.split()[:2] for line in table] == [["dense", "1.0"], ["mod", "0.5"]]  # 0.25 is new: no row
    now = results["blocks-b.json"]["rows"][1]["ms"]
    before = results["blocks-a.json"]["rows"][1]["ms"]
    assert float(table[1].split()[4]) == pytest.approx(now / before, abs=1e-3)
    env = os.environ | {"MODE_BENCH_RESULTS": str(tmp_path)}
    missing = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_blocks", "--compare", "nope"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert missing.returncode != 0 and "no earlier run" in missing.stderr


@pytest.mark.parametrize("presets", [["dense", "mod", "mode_integrated"]])
def test_compare_timing_only_tiny(tmp_path, presets):
    overrides = ["model.d_model=32", "model.n_heads=2", "model.n_layers=2", "model.seq_len=32", "train.batch_size=2"]
    args = [*overrides, "--timing-only", "--timing-rounds", "1", "--presets", *presets]
    payload = run_script("compare.py", args, tmp_path)["compare-timing.json"]
    rows = payload["rows"]
    assert set(rows) == set(presets)
    assert rows["dense"]["step_ratio"] == pytest.approx(1.0)
    assert all(r["step_ms_interleaved"] > 0 for r in rows.values())
    assert "MoD step time <= 0.60x dense" in payload["claims"]


def test_compare_trains_then_times_side_by_side(tmp_path):
    overrides = ["model.d_model=32", "model.n_heads=2", "model.n_layers=2", "model.seq_len=32", "train.batch_size=2"]
    args = [*overrides, "train.eval_every=5", "train.eval_batches=1", "--seconds", "2", "--timing-rounds", "1"]
    args += ["--runs-dir", str(tmp_path / "runs")]
    payload = run_script("compare.py", [*args, "--presets", "dense", "mod"], tmp_path)["compare.json"]
    rows = payload["rows"]
    assert all(r["steps"] > 0 and r["history"] and r["step_ms_interleaved"] > 0 for r in rows.values())
    assert rows["mod"]["step_ratio"] == pytest.approx(
        rows["mod"]["step_ms_interleaved"] / rows["dense"]["step_ms_interleaved"]
    )
    assert {"MoD step time <= 0.60x dense", "best MoD variant (mod) val loss < dense at equal wall-clock"} <= set(
        payload["claims"]
    )
    assert payload["claims"]["best MoD variant (mod) val loss < dense at equal wall-clock"]["verdict"] == "not shown"
    assert (tmp_path / "compare.png").is_file()
    assert (tmp_path / "runs" / "mod" / "metrics.jsonl").is_file()


def test_compare_with_seeds_interleaves_and_writes_the_readme_claims(tmp_path):
    overrides = ["model.d_model=32", "model.n_heads=2", "model.n_layers=2", "model.seq_len=32", "train.batch_size=2"]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- claims:begin -->\nold table\n<!-- claims:end -->\nrest\n")
    args = [*overrides, "train.eval_every=5", "train.eval_batches=1", "--seconds", "1", "--timing-rounds", "0"]
    args += ["--runs-dir", str(tmp_path / "runs"), "--seeds", "2", "--data", str(corpus), "--write-readme", str(readme)]
    presets = ["dense", "mod", "mod_random", "early_exit"]
    payload = run_script("compare.py", [*args, "--presets", *presets], tmp_path)["compare.json"]
    assert payload["seeds"] == [1337, 1338] and payload["corpus"] == str(corpus)
    assert payload["corpus_tokens"] == len(corpus.read_bytes())
    for name, row in payload["rows"].items():
        assert row["seeds"] == [1337, 1338] and len(row["per_seed"]["val_bpb"]) == 2
        assert row["val_bpb"] == pytest.approx(sum(row["per_seed"]["val_bpb"]) / 2)
        assert (tmp_path / "runs" / name / "seed1338" / "metrics.jsonl").is_file()
    # Seed by seed, round-robin over the presets: every preset's seed 1337 run before any 1338 run.
    mtimes = {
        (p, s): (tmp_path / "runs" / p / f"seed{s}" / "config.json").stat().st_mtime
        for p in payload["rows"]
        for s in (1337, 1338)
    }
    assert max(mtimes[p, 1337] for p in payload["rows"]) < min(mtimes[p, 1338] for p in payload["rows"])
    random_claim = payload["claims"]["learned MoD routing val loss < random routing (mod_random)"]
    assert random_claim["n"] == 2 and random_claim["lo"] <= random_claim["value"] <= random_claim["hi"]
    assert random_claim["verdict"] in ("holds", "reversed", "not shown")
    assert payload["claims"]["MoD val loss < early exit at equal wall-clock"]["n"] == 2
    text = readme.read_text()
    assert "old table" not in text and text.startswith("intro") and text.rstrip().endswith("rest")
    assert "learned MoD routing val loss < random routing (mod_random)" in text and "| claim |" in text


def test_compare_at_equal_steps_trains_each_run_the_same_steps(tmp_path):
    overrides = ["model.d_model=32", "model.n_heads=2", "model.n_layers=2", "model.seq_len=32", "train.batch_size=2"]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    args = [*overrides, "train.eval_every=4", "train.eval_batches=1", "--equal", "steps", "--steps", "4"]
    args += ["--timing-rounds", "0", "--runs-dir", str(tmp_path / "runs"), "--seeds", "2", "--data", str(corpus)]
    payload = run_script("compare.py", [*args, "--presets", "dense", "mod", "mod_random"], tmp_path)["compare.json"]
    assert payload["equal"] == "steps" and payload["steps"] == 4 and payload["seconds"] == 0
    for row in payload["rows"].values():
        assert row["per_seed"]["steps"] == [4, 4]
    assert "best MoD variant (mod) val loss < dense at equal steps" in payload["claims"]
    assert payload["claims"]["learned MoD routing val loss < random routing (mod_random)"]["n"] == 2


def test_compare_at_equal_flops_gives_the_cheaper_preset_the_steps_its_flops_allow(tmp_path):
    """--equal flops: the costliest preset trains --steps, each other floor(its FLOPs budget /
    its own training FLOPs per step), computed from the model's FLOP count (``mode.flops``)."""
    from mode.config import load_config
    from mode.flops import train_flops_per_step

    overrides = ["model.d_model=32", "model.n_heads=2", "model.n_layers=2", "model.seq_len=32", "train.batch_size=2"]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    args = [*overrides, "train.eval_every=4", "train.eval_batches=1", "--equal", "flops", "--steps", "6"]
    args += ["--timing-rounds", "0", "--runs-dir", str(tmp_path / "runs"), "--data", str(corpus)]
    payload = run_script("compare.py", [*args, "--presets", "dense", "mod"], tmp_path)["compare.json"]
    flops = {p: train_flops_per_step(load_config(p, overrides).model, 2) for p in ("dense", "mod")}
    assert flops["mod"] < flops["dense"]  # MoD skips most tokens in every other block
    expected = {"dense": 6, "mod": int(6 * flops["dense"] // flops["mod"])}
    assert payload["equal"] == "flops" and payload["steps_per_preset"] == expected
    assert {name: row["steps"] for name, row in payload["rows"].items()} == expected
    assert "best MoD variant (mod) val loss < dense at equal FLOPs" in payload["claims"]


def test_routing_diagnostics_on_tiny_trained_runs(tmp_path):
    """The diagnostics of real (tiny) checkpoints: shares are routed fractions of their groups,
    the groups' shares average back to the layer's (k / T), the final checkpoint agrees with
    itself, and random routing's layers take the same tokens in evaluation (seeded per forward)."""
    from mode.config import load_config
    from mode.train import train
    from tests.tiny import TINY

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Ünïcode and ASCII: the quick brown fox jumps over the lazy dog. " * 300)
    ckpt = {}
    for preset in ("mod", "mod_random", "dense"):
        out = tmp_path / preset
        extra = ["model.n_layers=4", "train.ckpt_every=5", "train.keep_checkpoints=3"] if preset == "mod" else []
        train(load_config(preset, [*TINY, f"data.source={corpus}", f"train.out_dir={out}", *extra]))
        ckpt[preset] = out / "ckpt.pt"
    mod = ["--learned", str(ckpt["mod"]), "--random", str(ckpt["mod_random"]), "--dense", str(ckpt["dense"])]
    args = [*mod, "--history", str(ckpt["mod"]), "--batches", "2", "--batch-size", "2"]
    payload = run_script("routing_diagnostics.py", args, tmp_path)["routing-diagnostics.json"]
    k_share = int(payload["capacity"] * 32) / 32
    for kind in ("learned", "random"):
        for layer in payload[kind]["layers"].values():
            assert layer["routed_share"] == pytest.approx(k_share)
            by_position = layer["by_position"]  # equal-size bins: their mean is the layer's share
            assert sum(by_position) / len(by_position) == pytest.approx(k_share)
            assert all(v is None or 0 <= v <= 1 for v in layer["by_frequency"] + layer["by_dense_loss"])
    assert len(payload["learned"]["layers"]) == 2 and all(0 <= a <= 1 for a in payload["learned"]["layer_agreement"])
    assert payload["random"]["layer_agreement"] == []  # one routed layer in the tiny 2-layer model
    rows = payload["stability"]["overlap_with_final"]
    assert [r["step"] for r in rows] == [5, 10] and all(v == 1.0 for k, v in rows[-1].items() if k != "step")
    assert (tmp_path / "routing-diagnostics.png").is_file()


def test_compare_evidence_writes_every_loss_claim_of_the_runs_as_one_table(tmp_path):
    runs = [ROOT / "benchmarks" / "results" / f"compare-equal-steps-{n}.json" for n in ("1500-c0125", "1500-c05")]
    doc = tmp_path / "benchmarks.md"
    doc.write_text("a\n<!-- evidence:begin -->\nold\n<!-- evidence:end -->\nb\n")
    subprocess.run(
        [sys.executable, "-m", "benchmarks.compare", "--evidence", *map(str, runs), "--write-readme", str(doc)],
        cwd=ROOT, check=True, capture_output=True,
    )  # fmt: skip
    text = doc.read_text()
    assert "old" not in text and text.startswith("a\n") and text.rstrip().endswith("b")
    rows = [line for line in text.splitlines() if line.startswith("| learned MoD routing")]
    assert len(rows) == 2 and "model.mod.capacity=0.5" in rows[1]
    for row, run in zip(rows, runs, strict=True):
        claim = json.loads(run.read_text())["claims"]["learned MoD routing val loss < random routing (mod_random)"]
        assert f"{claim['value']:+.3f}" in row and f"**{claim['verdict']}**" in row


def test_bench_sampling_tiny_compares_target_values(tmp_path):
    overrides = ["model.d_model=32", "model.n_heads=2", "model.n_layers=2", "model.seq_len=32", "train.batch_size=2"]
    args = ["--seconds", "2", "--new-tokens", "8", "--repeats", "1", "--eval-batches", "1"]
    args += ["--compare", str(ROOT / "benchmarks" / "results" / "sampling.json")]
    out: list[str] = []
    overrides.append(f"train.out_dir={tmp_path / 'run'}")
    payload = run_script("bench_sampling.py", [*overrides, *args], tmp_path, out)["sampling.json"]
    table = out[0].split("compared with the run of", 1)[1]
    assert all(name in table for name in payload["targets"])


def test_bench_train_tiny(tmp_path):
    tiny = ["--batch", "2", "--seq", "32", "--layers", "2", "--d-model", "32", "--n-heads", "2"]
    args = [*tiny, "--repeats", "1", "--warmup", "0", "--presets", "dense", "mod", "nanogpt", "dense_norope"]
    results = run_script("bench_train.py", [*args, "--modes", "fp32_eager", "bf16_eager"], tmp_path)
    payload = results["train.json"]
    assert {(r["preset"], r["mode"]) for r in payload["rows"]} == {
        (p, m) for p in ("dense", "mod", "nanogpt", "dense_norope") for m in ("fp32_eager", "bf16_eager")
    }
    for r in payload["rows"]:
        peak = payload["peak_flops"][r["mode"].split("_")[0]]["flops"]
        assert r["ms"] > 0 and r["peak_mib"] > 0
        assert r["mfu"] == pytest.approx(r["flops"] / (r["ms"] / 1000) / peak)  # a rate, never asserted on
    ratios = {(r["ratio"], r["mode"]): r for r in payload["ratios"]}
    assert ratios["dense/nanogpt", "fp32_eager"]["target"] == 1.05
    assert ratios["mod/dense", "bf16_eager"]["meets"] in (True, False)
    assert set(payload["peak_flops"]) == {"fp32", "bf16"}


def test_upcycle_tiny(tmp_path):
    tiny = ["model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.seq_len=32", "model.moe.n_experts=4"]
    tiny += ["train.batch_size=4", "train.eval_every=5", "train.eval_batches=1", "train.warmup_steps=2"]
    args = ["--dense-seconds", "1", "--extra-seconds", "1", "--targets", "mod", "mode_integrated"]
    args += ["--runs-dir", str(tmp_path / "runs"), *tiny]
    results = run_script("upcycle.py", args, tmp_path)
    payload = results["upcycle.json"]
    phases = {(r["variant"], r["phase"]) for r in payload["rows"]}
    assert phases == {
        ("dense", "before conversion"),
        ("dense", "continued"),
        ("mod", "converted"),
        ("mode_integrated", "converted"),
        ("mod", "scratch"),
        ("mode_integrated", "scratch"),
    }
    assert set(payload["checks"]) == {
        "mod_loss_at_conversion_within_5pct",
        "mod_step_faster",
        "mod_no_worse_after_extra_budget",
    }
    converted = next(r for r in payload["rows"] if r["phase"] == "converted")
    assert converted["history"][0]["seconds"] == payload["convert_at_seconds"] > 0
    assert (tmp_path / "upcycle.png").exists()


def test_bench_kernels_small_on_cpu_with_the_interpreter_smoke_test(tmp_path):
    pytest.importorskip("triton", reason="the interpreter smoke test needs Triton: pip install triton")
    out: list[str] = []
    args = ["--device", "cpu", "--small", "--interpret-smoke", "--repeats", "1", "--warmup", "0"]
    payload = run_script("bench_kernels.py", args, tmp_path, out)["kernels.json"]
    assert payload["triton"] == "not timed on a CPU"
    assert {(r["op"], r["path"]) for r in payload["rows"]} == {
        ("mod gather", "torch"),
        ("mod gated scatter fwd+bwd", "torch"),
        ("experts fwd", "torch"),
        ("experts fwd+bwd", "torch"),
    }
    smoke = payload["interpreter_smoke"]
    assert smoke[0] == "mod gather: equal"
    for line in smoke[1:]:  # "...: max |diff| 1.2e-07"
        assert float(line.rsplit(" ", 1)[1]) < 1e-5, line


def test_gpu_check_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_check.sh")], check=True)


def test_sweep_points_and_pareto_front_by_hand():
    from benchmarks.sweep import pareto_front, sweep_points

    points = sweep_points(["dense", "mod", "mod_random", "early_exit"], [0.5, 0.25], ["every", "every_fourth"], [0.125])
    names = [p["name"] for p in points]
    assert names[0] == "dense" and names[-1] == "early_exit" and len(names) == 1 + 4 + 1 + 1
    every_fourth = next(p for p in points if p["name"] == "mod every_fourth c=0.25")
    assert every_fourth["overrides"] == ["model.layout=dense,dense,dense,mod", "model.mod.capacity=0.25"]
    assert next(p for p in points if p["family"] == "mod_random")["overrides"] == ["model.mod.capacity=0.125"]
    rows = [
        {"name": "a", "t": 1.0, "val_bpb": 3.0},
        {"name": "b", "t": 2.0, "val_bpb": 2.0},
        {"name": "c", "t": 2.0, "val_bpb": 2.5},  # dominated by b (same time, higher loss)
        {"name": "d", "t": 3.0, "val_bpb": 2.0},  # dominated by b (same loss, slower)
        {"name": "e", "t": 4.0, "val_bpb": 1.0},
        {"name": "f", "t": None, "val_bpb": 0.5},  # no time on this axis: takes no part
    ]
    assert pareto_front(rows, "t") == {"a", "b", "e"}


def test_sweep_tiny(tmp_path):
    overrides = ["model.d_model=32", "model.n_heads=2", "model.n_layers=4", "model.seq_len=32", "train.batch_size=2"]
    args = [*overrides, "train.eval_every=5", "train.eval_batches=1", "--no-sweep-model", "--seconds", "0.5"]
    args += ["--runs-dir", str(tmp_path / "runs"), "--seeds", "2", "--capacities", "0.5", "--layouts", "every_other"]
    args += ["--families", "dense", "mod", "mod_random", "early_exit", "--random-capacities", "0.5"]
    args += ["--thresholds", "0.0", "1.0", "--prompt-len", "4", "--new-tokens", "3", "--decode-rounds", "1"]
    payload = run_script("sweep.py", args, tmp_path)["sweep.json"]
    rows = {r["name"]: r for r in payload["rows"]}
    expected = {"dense", "mod every_other c=0.5", "mod_random every_other c=0.5", "early_exit t=0", "early_exit t=1"}
    assert set(rows) == expected and payload["seeds"] == [1337, 1338]
    assert all(r["seeds"] == 2 and r["val_bpb"] > 0 and r["step_ms"] > 0 for r in rows.values())
    assert rows["mod_random every_other c=0.5"]["decode_ms"] is None  # no per-token decisions
    assert all(r["decode_ms"] > 0 for n, r in rows.items() if not n.startswith("mod_random"))
    # Threshold 0: every token exits after the first block (min_layer 1 of 4); 1: none exits.
    assert rows["early_exit t=0"]["compute_share"] == pytest.approx(0.25)
    assert rows["early_exit t=1"]["compute_share"] == pytest.approx(1.0)
    assert any(r["pareto_decode_ms"] for r in rows.values()) and any(r["pareto_step_ms"] for r in rows.values())
    assert (tmp_path / "sweep.png").is_file()
    assert (tmp_path / "runs" / "mod_every_other_c0.5" / "seed1338" / "metrics.jsonl").is_file()


def test_profile_step_tiny_names_the_host_reads(tmp_path):
    args = ["--presets", "dense", "mod", "--batch", "2", "--seq", "32", "--layers", "2", "--d-model", "32"]
    args += ["--n-heads", "2", "--steps", "2", "--warmup", "1", "--top", "5", "--device", "cpu"]
    payload = run_script("profile_step.py", args, tmp_path)["profile.json"]
    rows = {r["preset"]: r for r in payload["results"]}
    assert set(rows) == {"dense", "mod"}
    for r in rows.values():
        assert r["wall_ms"] > 0 and r["device_busy_ms"] is None  # CPU: no device timeline
        assert 0 < len(r["top_ops"]) <= 5 and all(op["self_ms_per_step"] >= 0 for op in r["top_ops"])
        assert not any(".py(" in op["op"] for op in r["top_ops"])  # Python frames are left out
        # Host reads are traced to our Python lines. On the CPU the profiler also sees the
        # reads inside CPU kernels (fused AdamW's, ``_assert_async``'s), which a GPU does on
        # the device: tests/test_step_ops.py counts the step's own (none).
        sites = {" ".join(s["stack"]): s["per_step"] for s in r["sync_sites"]}
        assert sites and all("mode/" in k and v > 0 for k, v in sites.items()), sites


def test_gpu_verdicts_reads_the_runs_and_never_calls_a_missing_one_met(tmp_path):
    def train_run(modes_ms: dict) -> dict:
        rows = [{"preset": p, "mode": "bf16_eager", "ms": ms} for p, ms in modes_ms.items()]
        return {"args": {"layers": 2, "d_model": 64, "modes": ["bf16_eager"]}, "rows": rows}

    (tmp_path / "train-a.json").write_text(json.dumps(train_run({"dense": 10.0, "nanogpt": 10.0, "mod": 8.0})))
    (tmp_path / "train-b.json").write_text(json.dumps(train_run({"dense": 10.0, "nanogpt": 9.0, "dense_norope": 9.0})))
    subprocess.run([sys.executable, "-m", "benchmarks.gpu_verdicts", str(tmp_path)], check=True, cwd=ROOT)
    rows = json.loads((tmp_path / "verdicts.json").read_text())
    got = {(r["target"], r["where"].split(":")[0]): r["verdict"] for r in rows}
    assert got[("dense/nanogpt", "train-a")] == "met"  # 1.00 <= 1.05
    assert got[("mod/dense", "train-a")] == "MISSED"  # 0.80 > 0.65
    assert got[("dense/nanogpt", "train-b")] == "MISSED"  # 1.11 > 1.05
    assert got[("RoPE share of the dense step", "train-b")] == "MISSED"  # 10% > 5%
    assert ("mod/dense", "train-b") not in got  # no mod in that run: not reported as met


def test_soak_tiny(tmp_path):
    payload = run_script("soak.py", ["--steps", "3", "--log-every", "1", "--presets", "mod", "moe"], tmp_path)[
        "soak.json"
    ]
    rows = {r["preset"]: r for r in payload["results"]}
    assert set(rows) == {"mod", "moe"}
    for r in rows.values():
        assert r["steps"] == 3 and r["all_finite"] and r["skipped"] == 0
    assert any(k.endswith("load_max") for k in rows["moe"]["health_last"])


def test_routing_task_stream_answers_and_a_tiny_run(tmp_path):
    """The synthetic routing task: the stream's answer after every marker is the payload before
    it (checked on the generated ids), and a 20-step run of both MoD routings writes their
    accuracies, routed shares and the paired claim."""
    import numpy as np

    from benchmarks.routing_task import MARKER, PAYLOAD, answers, make_stream

    ids = make_stream(5_000, 0)
    markers = np.flatnonzero(ids[:-1] == MARKER)
    assert len(markers) > 50 and all(ids[m + 1] in PAYLOAD for m in markers)
    import torch

    x = torch.tensor([[70, 3, 4, MARKER, 70, 5, 71, 6, MARKER, 71, 7]])
    mask, want = answers(x)
    assert mask[0].nonzero().flatten().tolist() == [3, 8] and want[0, 3] == 70 and want[0, 8] == 71
    payload = run_script("routing_task", ["--steps", "20", "--seeds", "2", "--kinds", "mod", "mod_random"], tmp_path)
    result = payload["routing-task.json"]
    assert {r["kind"] for r in result["rows"]} == {"mod", "mod_random"} and len(result["runs"]) == 4
    assert all(0 <= r["answer_accuracy"] <= 1 and 0 < r["routed_filler"] < 1 for r in result["runs"])
    (claim,) = result["claims"].values()
    assert claim["n"] == 2 and claim["verdict"] in ("holds", "reversed", "not shown")
