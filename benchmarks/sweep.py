"""Capacity and layout sweep on one latency axis: MoD and staged MoDE at several capacities and
layouts, the random-routing control and early exit, each point's validation loss against its
decode latency per token (batch 1, KV cache) and its training step time.

    python -m benchmarks.sweep                        # the full sweep, one seed (~33 min on the 2-core VM)
    python -m benchmarks.sweep --seeds 2              # the README's run (64 min)
    python -m benchmarks.sweep --seconds 120 --seeds 2
    python -m benchmarks.sweep --families mod --capacities 0.5 0.125 --layouts every_other

Points (one training run each, the same script and budget for every point):
  dense                          the reference (every block, every token);
  mod / mode_staged              capacity in --capacities x layout in --layouts, where
                                 every = every block routed, every_other = dense,X (the seed
                                 paper's layout), every_fourth = dense,dense,dense,X;
  mod_random                     every other block at --random-capacities (the paper's control);
  early_exit                     one trained model, evaluated at each of --thresholds (the
                                 threshold sets the compute share at inference, not training).
Validation loss (bits/byte, top-k routing; early exit with its exits) is the mean over
--seeds runs, seed by seed round-robin over the points. Decode latency is timed after all
training, round-robin over the points (median of --decode-rounds after a warm-up): greedy
generation of --new-tokens after a --prompt-len prompt, causal routing (MoD's per-token
decisions; ``mod_random`` cannot decide per token and has none). Step time is the median
step of the point's own training run (runs a few minutes apart: machine drift of 5-12%
applies to that axis). A point is on the Pareto front of an axis when no other point has
both lower (or equal) loss and lower (or equal) time on it, one of them strictly.
Writes results/sweep.json and results/sweep.png (loss against both axes).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from benchmarks.common import interleaved_median_times, print_table, result_path, write_json
from benchmarks.stats import summarize
from mode.config import Config, load_config
from mode.data import load_splits
from mode.flops import train_flops_per_step
from mode.model import MoDETransformer
from mode.train import evaluate, train

BPB = 1 / math.log(2)
LAYOUTS = {"every": "{kind}", "every_other": "dense,{kind}", "every_fourth": "dense,dense,dense,{kind}"}
FAMILIES = ("dense", "mod", "mode_staged", "mod_random", "early_exit")
# The sweep's model: smaller than base.yaml's so that a point trains for a few hundred steps
# within its budget on the 2-core VM (every point gets the same overrides).
SWEEP_MODEL = ["model.d_model=128", "model.n_heads=4", "model.n_layers=8", "model.seq_len=256"]


def sweep_points(
    families: list[str], capacities: list[float], layouts: list[str], random_capacities: list[float]
) -> list[dict]:
    """Every training run of the sweep: ``{"name", "family", "preset", "capacity", "layout",
    "overrides"}`` (capacity and layout None where they do not apply)."""
    points = []
    if "dense" in families:
        points.append({"name": "dense", "family": "dense", "preset": "dense", "capacity": None, "layout": None})
    for family in ("mod", "mode_staged"):
        if family not in families:
            continue
        for layout in layouts:
            for capacity in capacities:
                points.append(
                    {
                        "name": f"{family} {layout} c={capacity:g}",
                        "family": family,
                        "preset": family,
                        "capacity": capacity,
                        "layout": layout,
                        "overrides": [f"model.layout={LAYOUTS[layout].format(kind=family)}"],
                    }
                )
    if "mod_random" in families:
        for capacity in random_capacities:
            points.append(
                {
                    "name": f"mod_random every_other c={capacity:g}",
                    "family": "mod_random",
                    "preset": "mod_random",
                    "capacity": capacity,
                    "layout": "every_other",
                }
            )
    if "early_exit" in families:
        points.append({"name": "early_exit", "family": "early_exit", "preset": "early_exit", "capacity": None})
    for p in points:
        p.setdefault("layout", None)
        p["overrides"] = p.get("overrides", []) + ([f"model.mod.capacity={p['capacity']}"] if p["capacity"] else [])
    return points


def point_config(point: dict, seconds: float, extra: list[str], runs_dir: str, seed: int) -> Config:
    out = f"{runs_dir}/{point['name'].replace(' ', '_').replace('=', '')}/seed{seed}"
    return load_config(
        point["preset"],
        [
            *point["overrides"],
            f"train.max_seconds={seconds}",
            f"train.out_dir={out}",
            "train.overwrite=true",
            f"train.seed={seed}",
            *extra,
        ],
    )


def pareto_front(rows: list[dict], x: str, y: str = "val_bpb") -> set[str]:
    """Names of the rows no other row dominates on (``x``, ``y``), both lower-is-better; rows
    without an ``x`` value take no part."""
    pts = [(r["name"], r[x], r[y]) for r in rows if r.get(x) is not None]
    front = set()
    for name, a, b in pts:
        dominated = any(c <= a and d <= b and (c < a or d < b) for other, c, d in pts if other != name)
        if not dominated:
            front.add(name)
    return front


def decode_fn(model: MoDETransformer, prompt: torch.Tensor, new_tokens: int, threshold: float | None):
    """A call that generates ``new_tokens`` greedily with the KV cache (early exit at
    ``threshold`` when given)."""

    def generate() -> None:
        if threshold is not None:
            model.early_exit.threshold = threshold
        model.generate(prompt, new_tokens, temperature=0, use_cache=True)

    return generate


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"dense": "black", "mod": "tab:blue", "mode_staged": "tab:orange", "mod_random": "tab:gray"}
    colors["early_exit"] = "tab:green"
    markers = {None: "o", "every": "s", "every_other": "o", "every_fourth": "^"}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, key, label in (
        (axes[0], "decode_ms", "decode ms / token (batch 1, KV cache)"),
        (axes[1], "step_ms", "training step ms"),
    ):
        front = sorted((r for r in rows if r.get(f"pareto_{key}")), key=lambda r: r[key])
        ax.plot(
            [r[key] for r in front],
            [r["val_bpb"] for r in front],
            "-",
            color="lightgray",
            zorder=0,
            label="Pareto front",
        )
        seen = set()
        for r in rows:
            if r.get(key) is None:
                continue
            tag = (r["family"], r["layout"])
            ax.scatter(
                r[key], r["val_bpb"], color=colors[r["family"]], marker=markers.get(r["layout"], "o"),
                label=f"{r['family']} {r['layout'] or ''}".strip() if tag not in seen else None,
            )  # fmt: skip
            seen.add(tag)
            note = (
                f"{r['capacity']:g}"
                if r.get("capacity")
                else (f"t={r['threshold']:g}" if r.get("threshold") is not None else "")
            )
            if note:
                ax.annotate(note, (r[key], r["val_bpb"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel(label)
        ax.set_ylabel("validation bits / byte")
        ax.grid(alpha=0.3)
    entries: dict[str, object] = {}  # one legend for both panels (mod_random has no decode point)
    for ax in axes:
        for handle, name in zip(*ax.get_legend_handles_labels(), strict=True):
            entries.setdefault(name, handle)
    axes[0].legend(list(entries.values()), list(entries.keys()), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    p.add_argument("--capacities", nargs="+", type=float, default=[0.5, 0.25, 0.125, 0.0625])
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--random-capacities", nargs="+", type=float, default=[0.5, 0.125])
    p.add_argument("--thresholds", nargs="+", type=float, default=[0.4, 0.6, 0.8, 0.9, 1.0])
    p.add_argument("--seconds", type=float, default=60.0, help="training wall-clock per point and seed")
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--seed-base", type=int, default=1337)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--decode-rounds", type=int, default=5)
    p.add_argument("--runs-dir", default="runs/sweep")
    p.add_argument("--label", default=None)
    p.add_argument("--no-sweep-model", action="store_true", help="keep base.yaml's model size")
    p.add_argument("overrides", nargs="*", help="dotlist overrides for every point, e.g. train.batch_size=4")
    args = p.parse_args()
    for c in [*args.capacities, *args.random_capacities]:
        if not 0.0 < c <= 1.0:
            p.error(f"capacity {c}: must be in (0, 1]")
    for t in args.thresholds:
        if not 0.0 <= t <= 1.0:
            p.error(f"threshold {t}: must be in [0, 1]")
    if args.seeds < 1 or args.decode_rounds < 1:
        p.error("--seeds and --decode-rounds must be >= 1")
    extra = ["train.progress=false", *([] if args.no_sweep_model else SWEEP_MODEL), *args.overrides]
    points = sweep_points(args.families, args.capacities, args.layouts, args.random_capacities)
    seeds = [args.seed_base + i for i in range(args.seeds)]
    losses: dict[str, list[float]] = {}
    first: dict[str, tuple[Config, MoDETransformer, float]] = {}
    for seed in seeds:  # round-robin: every point once per seed
        for point in points:
            cfg = point_config(point, args.seconds, extra, args.runs_dir, seed)
            torch.manual_seed(seed)
            model, result = train(cfg)
            model.eval()
            if point["family"] == "early_exit":
                _, val, _ = load_splits(cfg.data.source, cfg.model.seq_len, cfg.data.val_fraction, cfg.data.cache_dir)
                for t in args.thresholds:
                    model.early_exit.threshold = t
                    loss, metrics = evaluate(model, val, cfg.train.batch_size, cfg.train.eval_batches)
                    losses.setdefault(f"early_exit t={t:g}", []).append(loss * BPB)
                    losses.setdefault(f"early_exit t={t:g} share", []).append(metrics["early_exit/compute_share"])
            else:
                losses.setdefault(point["name"], []).append(result.val_loss * BPB)
            print(f"{point['name']} (seed {seed}): {result.steps} steps, {result.val_loss * BPB:.3f} bpb", flush=True)
            if seed == seeds[0]:
                first[point["name"]] = (cfg, model, 1000 * result.median_step_time)
    rows, fns = [], {}
    prompt = torch.randint(0, 256, (1, args.prompt_len), generator=torch.Generator().manual_seed(0))
    for point in points:
        cfg, model, step_ms = first[point["name"]]
        gflop = train_flops_per_step(cfg.model, cfg.train.batch_size) / 1e9
        base = {k: point[k] for k in ("family", "capacity", "layout")} | {"step_ms": step_ms, "gflop_step": gflop}
        variants = (
            [(f"early_exit t={t:g}", t) for t in args.thresholds]
            if point["family"] == "early_exit"
            else [(point["name"], None)]
        )
        for name, threshold in variants:
            stats = summarize(losses[name])
            row = base | {"name": name, "val_bpb": stats["mean"], "val_bpb_sd": stats["sd"], "seeds": stats["n"]}
            row["threshold"] = threshold
            if threshold is not None:
                row["compute_share"] = summarize(losses[f"{name} share"])["mean"]
            row["decode_ms"] = None
            if model.supports_causal():
                fns[name] = decode_fn(model, prompt, args.new_tokens, threshold)
            rows.append(row)
    print(f"\ntiming decode, {len(fns)} points round-robin x {args.decode_rounds}", flush=True)
    with torch.no_grad():
        times = interleaved_median_times(fns, warmup=1, repeats=args.decode_rounds, settle=0, settle_s=0.0)
    for row in rows:
        if row["name"] in times:
            row["decode_ms"] = 1000 * times[row["name"]] / args.new_tokens
    for key in ("decode_ms", "step_ms"):
        front = pareto_front(rows, key)
        for row in rows:
            row[f"pareto_{key}"] = row["name"] in front
    print(f"\n{args.seconds:.0f} s per point, {len(seeds)} seed(s), threads={torch.get_num_threads()}")
    print_table(
        rows,
        [
            ("name", "point", ""),
            ("gflop_step", "GFLOP/step", ".1f"),
            ("step_ms", "step ms", ".0f"),
            ("decode_ms", "decode ms/tok", ".2f"),
            ("val_bpb", "val bpb", ".3f"),
            ("val_bpb_sd", "sd", ".3f"),
            ("compute_share", "EE share", ".2f"),
            ("pareto_decode_ms", "front (decode)", ""),
            ("pareto_step_ms", "front (step)", ""),
        ],
    )
    payload = {
        "seconds": args.seconds,
        "seeds": seeds,
        "model_overrides": extra,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "rows": rows,
    }
    path = write_json("sweep", payload, args.label)
    png = result_path("sweep", args.label, ".png")
    plot(rows, png)
    print(f"wrote {path} and {png}")


if __name__ == "__main__":
    main()
