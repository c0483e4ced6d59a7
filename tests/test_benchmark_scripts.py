"""Smoke tests: the benchmark scripts run end to end at tiny sizes and write their JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_script(name: str, args: list[str], out: Path) -> dict:
    env = os.environ | {"MODE_BENCH_RESULTS": str(out)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / name), *args], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {p.name: json.loads(p.read_text()) for p in out.glob("*.json")}


def test_bench_blocks_tiny(tmp_path):
    args = ["--d-model", "32", "--n-heads", "2", "--seq", "64", "--batch", "2", "--repeats", "1", "--warmup", "0"]
    results = run_script("bench_blocks.py", [*args, "--capacities", "0.5", "0.125"], tmp_path)
    payload = results["blocks.json"]
    rows = {r["capacity"]: r for r in payload["rows"] if r["block"] == "mod"}
    assert set(rows) == {0.5, 0.125}
    for r in rows.values():
        # Without the masked half the FLOP ratio is larger (the dense block loses more attention).
        assert r["flop_ratio_unmasked"] > r["flop_ratio"]
        assert r["faults"] is None or r["faults"] >= 0
    assert "allocator_env" in payload["environment"]


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
