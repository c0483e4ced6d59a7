"""Convert instead of retrain: a dense model trained for a wall-clock budget, converted to
``mod``, ``mode_staged`` and ``mode_integrated`` (``mode.convert.upcycle``) and trained for
an extra budget each, beside the dense model continued for that budget and each target
trained from scratch for the total budget.

    python -m benchmarks.upcycle                        # 90 s dense + 90 s extra (~17 min)
    python -m benchmarks.upcycle --dense-seconds 600 --extra-seconds 300
    python -m benchmarks.upcycle --checkpoint runs/dense/ckpt.pt --extra-seconds 120

Every continuation starts the same way: weights from the dense checkpoint (converted, or
copied for "dense continued"), a fresh AdamW and a fresh warm-up + cosine schedule over the
extra budget. Reports validation bits/byte right after conversion and at the end, median
step time and steps per variant; writes ``results/upcycle[-label].json`` and one plot of
validation loss against wall-clock (conversion point marked), ``results/upcycle[-label].png``.
Targets: right after conversion the MoD model's validation loss is within 5% of the dense
checkpoint's, its step is faster than the dense step, and after the extra budget its loss
is no worse than the dense model continued for the same time.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from benchmarks.common import print_table, result_path, write_json
from mode.checkpoint import checkpoint_config
from mode.config import load_config
from mode.convert import upcycle
from mode.data import load_splits
from mode.train import evaluate, train

BPB = 1 / math.log(2)
TARGETS = ["mod", "mode_staged", "mode_integrated"]


def config(preset: str, seconds: float, out: Path, extra: list[str]):
    return load_config(preset, [f"train.max_seconds={seconds}", f"train.out_dir={out}", "train.overwrite=true", *extra])


def run(name: str, phase: str, cfg, offset: float = 0.0, model=None) -> dict:
    """Train ``cfg`` (from ``model`` when given); its history shifted by ``offset`` seconds
    (the dense phase before it)."""
    _, result = train(cfg, model=model)
    return {
        "variant": name,
        "phase": phase,
        "steps": result.steps,
        "step_ms": 1000 * result.median_step_time,
        "val_bpb": result.val_loss * BPB,
        "history": [{**p, "seconds": p["seconds"] + offset} for p in result.history],
    }


def plot(rows: list[dict], convert_at: float, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in rows:
        xs = [p["seconds"] for p in r["history"]]
        ys = [p["val_loss"] * BPB for p in r["history"]]
        style = "-" if r["phase"] != "scratch" else ":"
        ax.plot(
            xs, ys, style, marker="." if r["phase"] == "converted" else None, label=f"{r['variant']} ({r['phase']})"
        )
    ax.axvline(convert_at, color="grey", linestyle="--", linewidth=1)
    ax.text(convert_at, ax.get_ylim()[1], " conversion", va="top", color="grey")
    ax.set_xlabel("training wall-clock (s)")
    ax.set_ylabel("validation bits/byte")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dense-seconds", type=float, default=90.0)
    parser.add_argument("--extra-seconds", type=float, default=90.0)
    parser.add_argument("--checkpoint", default=None, help="a trained dense checkpoint instead of the dense phase")
    parser.add_argument("--targets", nargs="+", default=TARGETS, choices=TARGETS)
    parser.add_argument("--no-scratch", action="store_true", help="leave out the from-scratch runs")
    parser.add_argument("--runs-dir", default="runs/upcycle")
    parser.add_argument("--label", default=None)
    parser.add_argument("overrides", nargs="*", help="dotlist overrides for every run, e.g. model.n_layers=4")
    args = parser.parse_args()
    runs = Path(args.runs_dir)
    extra = ["train.progress=false", *args.overrides]
    rows = []
    if args.checkpoint:
        ckpt = Path(args.checkpoint)
        dense_cfg = checkpoint_config(ckpt)
        convert_at = 0.0
    else:
        dense_cfg = config("dense", args.dense_seconds, runs / "dense", extra)
        rows.append(run("dense", "before conversion", dense_cfg))
        ckpt = runs / "dense" / "ckpt.pt"
        convert_at = rows[-1]["history"][-1]["seconds"] if rows[-1]["history"] else args.dense_seconds
    tc = dense_cfg.train
    _, val, _ = load_splits(dense_cfg.data.source, dense_cfg.model.seq_len, dense_cfg.data.val_fraction)

    def val_bpb(model) -> float:
        return evaluate(model, val, tc.batch_size, tc.eval_batches)[0] * BPB

    dense_bpb = val_bpb(upcycle(ckpt, dense_cfg))
    at_conversion = {"dense": dense_bpb}
    for name in ["dense", *args.targets]:
        cfg = config(name, args.extra_seconds, runs / f"{name}-from-dense", [*extra, f"train.init_from={ckpt}"])
        converted = upcycle(ckpt, cfg, seed=cfg.train.seed)  # what train.init_from would build
        at_conversion[name] = val_bpb(converted)
        row = run(name, "continued" if name == "dense" else "converted", cfg, offset=convert_at, model=converted)
        row["val_bpb_at_conversion"] = at_conversion[name]
        row["history"].insert(0, {"step": 0, "seconds": convert_at, "val_loss": at_conversion[name] / BPB})
        rows.append(row)
    if not args.no_scratch:
        total = convert_at + args.extra_seconds
        for name in args.targets:
            rows.append(run(name, "scratch", config(name, total, runs / f"{name}-scratch", extra)))

    by = {(r["variant"], r["phase"]): r for r in rows}
    mod = by.get(("mod", "converted"))
    cont = by[("dense", "continued")]
    checks = {}
    if mod is not None:
        checks = {
            "mod_loss_at_conversion_within_5pct": at_conversion["mod"] <= 1.05 * dense_bpb,
            "mod_step_faster": mod["step_ms"] < cont["step_ms"],
            "mod_no_worse_after_extra_budget": mod["val_bpb"] <= cont["val_bpb"],
        }
    print(f"dense checkpoint {ckpt}: validation {dense_bpb:.4f} bits/byte")
    print_table(
        rows,
        [
            ("variant", "variant", ""),
            ("phase", "phase", ""),
            ("val_bpb_at_conversion", "bpb at conversion", ".4f"),
            ("val_bpb", "bpb at end", ".4f"),
            ("steps", "steps", "d"),
            ("step_ms", "step ms", ".1f"),
        ],
    )
    for name, ok in checks.items():
        print(f"{name}: {'holds' if ok else 'MISSES'}")
    payload = {
        "args": vars(args),
        "dense_checkpoint": str(ckpt),
        "dense_val_bpb": dense_bpb,
        "convert_at_seconds": convert_at,
        "val_bpb_at_conversion": at_conversion,
        "rows": rows,
        "checks": checks,
    }
    print(f"wrote {write_json('upcycle', payload, args.label)}")
    png = result_path("upcycle", args.label, ".png")
    plot(rows, convert_at, png)


if __name__ == "__main__":
    main()
