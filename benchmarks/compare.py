"""Train every preset on the embedded corpus for the same wall-clock budget and compare.

    python benchmarks/compare.py                  # 10 minutes per preset on this machine
    python benchmarks/compare.py --quick          # 1 minute per preset
    python benchmarks/compare.py --seconds 240 --presets dense mod --label short

Per variant: parameters, active parameters, training FLOPs per step, median step time and
its ratio to dense, steps done, final validation loss (bits per byte) in top-k and in
causal routing mode. Plots validation loss against wall-clock and against cumulative FLOPs
(results/compare.png), writes results/compare.json, and checks the claims below on this
run's numbers (it reports them; it never tunes anything until they agree).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, print_table, write_json  # noqa: E402

from mode.config import load_config  # noqa: E402
from mode.flops import train_flops_per_step  # noqa: E402
from mode.train import active_params, train  # noqa: E402

PRESETS = ["dense", "mod", "moe", "moe_capacity", "mode_staged", "mode_integrated"]
BPB = 1 / math.log(2)


def run(preset: str, seconds: float, extra: list[str]) -> dict:
    cfg = load_config(preset, [f"train.max_seconds={seconds}", f"train.out_dir=runs/compare/{preset}", *extra])
    model, result = train(cfg)
    return {
        "variant": preset,
        "params": model.num_params(),
        "active_params": active_params(model),
        "gflop_step": train_flops_per_step(cfg.model, cfg.train.batch_size) / 1e9,
        "step_ms": 1000 * result.median_step_time,
        "steps": result.steps,
        "val_bpb": result.val_loss * BPB,
        "val_bpb_causal": result.val_loss_causal * BPB if not math.isnan(result.val_loss_causal) else None,
        "history": result.history,
    }


def claims(rows: dict[str, dict]) -> dict[str, dict]:
    """The issue's targets, evaluated on this run's numbers (None where a variant is missing)."""
    out = {}

    def add(name, value, ok):
        out[name] = {"value": value, "holds": ok}

    if "dense" in rows and "mod" in rows:
        r = rows["mod"]["step_ms"] / rows["dense"]["step_ms"]
        add("MoD step time <= 0.60x dense", r, r <= 0.60)
    mods = [v for v in ("mod", "mode_staged") if v in rows]
    if "dense" in rows and mods:
        best = min(mods, key=lambda v: rows[v]["val_bpb"])
        add(
            f"best MoD variant ({best}) val loss <= dense at equal wall-clock",
            rows[best]["val_bpb"] - rows["dense"]["val_bpb"],
            rows[best]["val_bpb"] <= rows["dense"]["val_bpb"],
        )
    if "mode_integrated" in rows and "moe_capacity" in rows:
        d = rows["mode_integrated"]["val_bpb"] - rows["moe_capacity"]["val_bpb"]
        add("integrated MoDE val loss < capacity MoE dropping the same share", d, d < 0)
    for v in ("mode_staged", "mode_integrated"):
        if v in rows and "moe" in rows:
            d = rows[v]["val_bpb"] - rows["moe"]["val_bpb"]
            add(f"{v} val loss < plain MoE at equal wall-clock", d, d < 0)
    return out


def plot(rows: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_f) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, r in rows.items():
        h = r["history"]
        if not h:
            continue
        loss = [p["val_loss"] * BPB for p in h]
        ax_t.plot([p["seconds"] for p in h], loss, marker=".", label=name)
        ax_f.plot([p["flops"] for p in h], loss, marker=".", label=name)
    ax_t.set_xlabel("training wall-clock (s)")
    ax_f.set_xlabel("cumulative training FLOPs")
    ax_f.set_xscale("log")
    for ax in (ax_t, ax_f):
        ax.set_ylabel("validation bits per byte")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("MoDE variants on Shakespeare (byte level, seq 256)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=PRESETS)
    p.add_argument("--seconds", type=float, default=600.0, help="training wall-clock per preset")
    p.add_argument("--quick", action="store_true", help="60 seconds per preset")
    p.add_argument("--label", default=None)
    p.add_argument("overrides", nargs="*", help="dotlist overrides for every preset, e.g. train.batch_size=4")
    args = p.parse_args()
    seconds = 60.0 if args.quick else args.seconds
    extra = ["train.progress=false", *args.overrides]
    if args.quick:
        extra.append("train.eval_every=20")
    rows = {}
    for preset in args.presets:
        torch.manual_seed(0)
        rows[preset] = run(preset, seconds, extra)
        print(f"{preset}: {rows[preset]['steps']} steps, val {rows[preset]['val_bpb']:.3f} bpb", flush=True)
    dense_ms = rows.get("dense", {}).get("step_ms")
    for r in rows.values():
        r["step_ratio"] = r["step_ms"] / dense_ms if dense_ms else None
    print(f"\ntraining budget {seconds:.0f} s per variant, threads={torch.get_num_threads()}")
    print_table(
        list(rows.values()),
        [
            ("variant", "variant", ""),
            ("params", "params", ","),
            ("active_params", "active", ","),
            ("gflop_step", "GFLOP/step", ".1f"),
            ("step_ms", "step ms", ".0f"),
            ("step_ratio", "vs dense", ".2f"),
            ("steps", "steps", "d"),
            ("val_bpb", "val bpb", ".3f"),
            ("val_bpb_causal", "causal bpb", ".3f"),
        ],
    )
    checked = claims(rows)
    for name, c in checked.items():
        print(f"claim: {name}: {c['value']:+.3f} -> {'holds' if c['holds'] else 'does NOT hold'}")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    png = RESULTS_DIR / (f"compare-{args.label}.png" if args.label else "compare.png")
    plot(rows, png)
    path = write_json(
        "compare", {"seconds": seconds, "overrides": args.overrides, "rows": rows, "claims": checked}, args.label
    )
    print(f"wrote {path} and {png}")


if __name__ == "__main__":
    main()
