"""Long-run guard: every preset trained for many steps at the test size under bf16 on the
embedded corpus, watching that the loss stays finite and the routing healthy (no router
collapse warning, no skipped step). Minutes, not for CI.

    python -m benchmarks.soak                       # 2000 steps of every preset
    python -m benchmarks.soak --steps 200 --presets mod moe

Prints one row per preset (first and last logged loss, skipped steps, warnings, the last
routing health figures) and writes ``results/soak[-label].json``.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

from benchmarks.common import print_table, write_json
from mode.config import load_config
from mode.train import train

PRESETS = ["dense", "mod", "mod_random", "moe", "moe_capacity", "mode_staged", "mode_integrated", "early_exit"]
TEST_SIZE = ["model.d_model=64", "model.n_heads=4", "model.n_layers=4", "model.seq_len=64", "model.moe.n_experts=4"]


def soak(preset: str, steps: int, log_every: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        overrides = [
            *TEST_SIZE,
            f"train.steps={steps}",
            "train.max_seconds=0",
            "train.batch_size=8",
            "train.precision=bf16",
            f"train.log_every={log_every}",
            f"train.eval_every={steps}",
            "train.eval_batches=2",
            "train.progress=false",
            "train.device=cpu",
            f"train.out_dir={out}",
            "train.overwrite=true",
        ]
        cfg = load_config(preset, overrides)
        t0 = time.perf_counter()
        _, result = train(cfg)
        seconds = time.perf_counter() - t0
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows]
    last = rows[-1]
    health = {k: v for k, v in last.items() if k.endswith(("load_max", "score_entropy", "noop_share", "exit_share"))}
    return {
        "preset": preset,
        "steps": result.steps,
        "seconds": seconds,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "val_loss": result.val_loss,
        "all_finite": all(math.isfinite(v) for v in losses) and math.isfinite(result.val_loss),
        "skipped": sum(1 for r in rows if r.get("skipped")),
        "warnings": sorted({w for r in rows for w in r.get("warnings", [])}),
        "health_last": health,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=PRESETS, choices=PRESETS)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--label", default=None)
    args = parser.parse_args()
    results = [soak(p, args.steps, args.log_every) for p in args.presets]
    for r in results:
        r["n_warnings"] = len(r["warnings"])
    print(f"{args.steps} steps each, test size, bf16, CPU")
    print_table(
        results,
        [
            ("preset", "preset", "s"),
            ("steps", "steps", "d"),
            ("seconds", "s", ".0f"),
            ("first_loss", "first loss", ".3f"),
            ("last_loss", "last loss", ".3f"),
            ("val_loss", "val loss", ".3f"),
            ("all_finite", "finite", ""),
            ("skipped", "skipped", "d"),
            ("n_warnings", "warnings", "d"),
        ],
    )
    for r in results:
        for w in r["warnings"]:
            print(f"  {r['preset']}: {w}")
    print(f"wrote {write_json('soak', {'args': vars(args), 'results': results}, args.label)}")


if __name__ == "__main__":
    main()
