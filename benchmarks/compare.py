"""Train every preset on the embedded corpus for the same wall-clock budget and compare.

    python -m benchmarks.compare                  # 10 minutes per preset on this machine
    python -m benchmarks.compare --quick          # 1 minute per preset
    python -m benchmarks.compare --seconds 240 --presets dense mod --label short
    python -m benchmarks.compare --timing-only    # step times of fresh models, side by side (~2 min)
    python -m benchmarks.compare --seeds 3        # each preset with 3 seeds, claims with 95% intervals
    python -m benchmarks.compare --data my.txt    # the ranking on your own text (bytes)
    python -m benchmarks.compare --equal steps --steps 2000 --presets mod mod_random --seeds 3
    python -m benchmarks.compare --equal flops --steps 2000 --presets mod mod_random --seeds 3

Per variant: parameters, active parameters, training FLOPs per step, median step time in its
own run, steps done, final validation loss (bits per byte) in top-k and in causal routing mode.
After training, the trained models' optimizer steps are also timed side by side, round-robin
(``--timing-rounds``, median after warm-up): the presets train one after another, and this
VM's speed drifts by up to ~10% between runs of a few minutes, so step-time ratios (the
"vs dense" column and the MoD step-time claim) come from that interleaved timing.
``--timing-only`` skips training and times freshly initialised models (results/compare-timing.json).
Plots validation loss against wall-clock and against cumulative FLOPs (results/compare.png),
writes results/compare.json, and checks the claims below on this run's numbers (it reports
them; it never tunes anything until they agree).

With ``--seeds N`` every preset trains N times (``train.seed`` = seed base + i: data order
and initialisation), seed by seed round-robin over the presets, so machine drift does not
land on one variant. The table gives mean and standard deviation; each loss claim is judged
from the per-seed paired differences (mean and 95% t interval, ``benchmarks/stats.py``):
``holds``, ``reversed`` or ``not shown``. ``--write-readme`` puts the claim table generated
from the JSON into docs/benchmarks.md between its ``claims`` markers.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from benchmarks.common import (
    add_compare_option,
    interleaved_median_times,
    load_run,
    print_comparison,
    print_table,
    result_path,
    write_json,
)
from benchmarks.stats import paired_interval, summarize, verdict
from mode.config import Config, load_config
from mode.data import load_splits
from mode.flops import active_params, train_flops_per_step
from mode.layers.kinds import BLOCK_KINDS
from mode.model import MoDETransformer
from mode.step import build_optimizer, train_step
from mode.train import train

PRESETS = [*BLOCK_KINDS, "early_exit"]  # every block kind has a preset of its name; early exit is dense + exits
BPB = 1 / math.log(2)


def preset_config(
    preset: str,
    seconds: float,
    extra: list[str],
    runs_dir: str = "runs/compare",
    seed: int | None = None,
    steps: int = 0,
) -> Config:
    """``preset`` for a comparison run: ``seconds`` of training (equal wall-clock), or, with
    ``steps > 0``, that many steps with no time budget (equal steps: the same tokens and, for
    presets of equal FLOPs per step, the same FLOPs)."""
    out = f"{runs_dir}/{preset}" + (f"/seed{seed}" if seed is not None else "")
    seeded = [f"train.seed={seed}"] if seed is not None else []
    budget = [f"train.max_seconds={seconds}"] if not steps else ["train.max_seconds=0", f"train.steps={steps}"]
    run = [*budget, f"train.out_dir={out}", "train.overwrite=true"]
    return load_config(preset, [*run, *seeded, *extra])


def run(preset: str, cfg: Config) -> tuple[dict, MoDETransformer]:
    model, result = train(cfg)
    row = describe(preset, cfg, model)
    row.update(
        {
            "step_ms": 1000 * result.median_step_time,
            "steps": result.steps,
            "val_bpb": result.val_loss * BPB,
            "val_bpb_causal": result.val_loss_causal * BPB if not math.isnan(result.val_loss_causal) else None,
            "history": result.history,
        }
    )
    return row, model


def describe(preset: str, cfg: Config, model: MoDETransformer) -> dict:
    return {
        "variant": preset,
        "params": model.num_params(),
        "active_params": active_params(model),
        "gflop_step": train_flops_per_step(cfg.model, cfg.train.batch_size) / 1e9,
    }


def interleaved_step_ms(models: dict[str, tuple[Config, MoDETransformer]], rounds: int) -> dict[str, float]:
    """Median ms of one optimizer step of each model, timed round-robin on training batches.

    Each model gets a fresh AdamW (its first steps are warm-up) and keeps training while it is
    timed, so routing stays as it was at the end of its run.
    """
    fns = {}
    for name, (cfg, model) in models.items():
        train_split, _, _ = load_splits(cfg.data.source, cfg.model.seq_len, cfg.data.val_fraction, cfg.data.cache_dir)
        opt = build_optimizer(model, cfg.train)
        gen = torch.Generator().manual_seed(cfg.train.seed)
        model.train()

        def step(model=model, opt=opt, split=train_split, gen=gen, cfg=cfg) -> None:
            x, y = split.batch(cfg.train.batch_size, gen)
            train_step(model, opt, x, y, cfg.train.grad_clip)

        fns[name] = step
    times = interleaved_median_times(fns, warmup=2, repeats=rounds, settle_s=0.5)
    return {name: 1000 * t for name, t in times.items()}


SEEDED_METRICS = ("val_bpb", "val_bpb_causal", "step_ms", "steps")


def merge_seeds(runs: list[dict]) -> dict:
    """One preset's row from its per-seed rows: every metric's mean (under its own name), its
    standard deviation (``<metric>_sd``) and per-seed values (``per_seed``)."""
    row = {k: v for k, v in runs[0].items() if k not in SEEDED_METRICS}
    row["seeds"] = [r["seed"] for r in runs]
    row["per_seed"] = {m: [r[m] for r in runs] for m in SEEDED_METRICS if runs[0].get(m) is not None}
    for metric, values in row["per_seed"].items():
        s = summarize(values)
        row[metric], row[f"{metric}_sd"] = s["mean"], s["sd"]
    return row


def claims(rows: dict[str, dict], at: str = "equal wall-clock") -> dict[str, dict]:
    """The README's claims, evaluated on this run (``at``: "equal wall-clock" or "equal
    steps", how the runs were budgeted, named in the claims that depend on it): loss claims
    from the per-seed paired differences (mean, 95% interval, verdict: one seed gives "not
    shown"), the step-time
    claim from the interleaved timing (one measurement: "holds" or "reversed"). Claims whose
    variants were not run are left out."""
    out = {}

    def loss_claim(name: str, a: str, b: str) -> None:
        iv = paired_interval(rows[a]["per_seed"]["val_bpb"], rows[b]["per_seed"]["val_bpb"])
        out[name] = {**iv, "value": iv["mean"], "verdict": verdict(iv), "holds": verdict(iv) == "holds"}

    if "dense" in rows and "mod" in rows and rows["mod"].get("step_ratio") is not None:
        r = rows["mod"]["step_ratio"]
        out["MoD step time <= 0.60x dense"] = {
            "value": r, "verdict": "holds" if r <= 0.60 else "reversed", "holds": r <= 0.60, "n": 1,
        }  # fmt: skip
    rows = {name: r for name, r in rows.items() if "per_seed" in r and "val_bpb" in r["per_seed"]}
    mods = [v for v in ("mod", "mode_staged") if v in rows]
    if "dense" in rows and mods:
        best = min(mods, key=lambda v: rows[v]["val_bpb"])
        loss_claim(f"best MoD variant ({best}) val loss < dense at {at}", best, "dense")
    if "mod" in rows and "mod_random" in rows:
        loss_claim("learned MoD routing val loss < random routing (mod_random)", "mod", "mod_random")
    if "mod" in rows and "early_exit" in rows:
        loss_claim(f"MoD val loss < early exit at {at}", "mod", "early_exit")
    if "mode_integrated" in rows and "moe_capacity" in rows:
        loss_claim("integrated MoDE val loss < capacity MoE dropping the same share", "mode_integrated", "moe_capacity")
    for v in ("mode_staged", "mode_integrated"):
        if v in rows and "moe" in rows:
            loss_claim(f"{v} val loss < plain MoE at {at}", v, "moe")
    return out


AT = {"time": "equal wall-clock", "steps": "equal steps", "flops": "equal FLOPs"}


def equal_budget_steps(presets: list[str], extra: list[str], equal: str, steps: int) -> dict[str, int]:
    """Steps each preset trains: 0 (a wall-clock budget) under ``equal="time"``, ``steps`` each
    under "steps", and under "flops" ``steps`` for the preset with the most training FLOPs per
    step and for each other the most steps within the same FLOPs (rounded down)."""
    if equal == "time":
        return dict.fromkeys(presets, 0)
    if equal == "steps":
        return dict.fromkeys(presets, steps)
    per_step = {}
    for preset in presets:
        cfg = load_config(preset, extra)
        per_step[preset] = train_flops_per_step(cfg.model, cfg.train.batch_size)
    budget = steps * max(per_step.values())
    return {preset: int(budget // f) for preset, f in per_step.items()}


def _budget(payload: dict) -> str:
    if payload.get("equal") == "flops":
        return f"equal training FLOPs ({payload['steps']} steps of the costliest preset; {payload['steps_per_preset']})"
    if payload.get("equal") == "steps":
        return f"{payload['steps']} steps (equal steps)"
    return f"{payload['seconds']:.0f} s (equal wall-clock)"


def claims_markdown(payload: dict) -> str:
    """The claim table of a compare.py JSON, as README markdown (generated, never typed)."""
    seeds = payload.get("seeds") or [None]
    lines = [
        f"Generated by `compare.py --write-readme` from `{payload.get('json_name', 'compare.json')}`: "
        f"{_budget(payload)} per run, {len(seeds)} seed(s) {seeds}, corpus {payload.get('corpus', '?')}. "
        "Loss claims: mean paired difference (bits/byte) over seeds and its 95% interval.",
        "",
        "| claim | value | 95% interval | seeds | verdict |",
        "|---|---|---|---|---|",
    ]
    for name, c in payload["claims"].items():
        interval = f"[{c['lo']:+.3f}, {c['hi']:+.3f}]" if c.get("lo") is not None else "-"
        lines.append(f"| {name} | {c['value']:+.3f} | {interval} | {c.get('n', 1)} | **{c['verdict']}** |")
    return "\n".join(lines) + "\n"


def evidence_markdown(payloads: list[dict]) -> str:
    """One table of every loss claim of several compare.py JSONs (the routing controls at
    equal steps, FLOPs or time, on each corpus and capacity), generated, never typed."""
    lines = [
        "Generated by `compare.py --evidence` from "
        + ", ".join(f"`{p.get('json_name', '?')}`" for p in payloads)
        + ". Mean paired difference (bits/byte) over seeds and its 95% interval.",
        "",
        "| claim | budget | corpus | overrides | value | 95% interval | seeds | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for payload in payloads:
        overrides = " ".join(o for o in payload.get("overrides", []) if "capacity" in o) or "none"
        for name, c in payload["claims"].items():
            if c.get("lo") is None:  # a step-time claim: one measurement, no interval
                continue
            lines.append(
                f"| {name} | {_budget(payload)} | {payload.get('corpus', '?')} | {overrides} | {c['value']:+.3f} "
                f"| [{c['lo']:+.3f}, {c['hi']:+.3f}] | {c.get('n', 1)} | **{c['verdict']}** |"
            )
    return "\n".join(lines) + "\n"


def write_readme_claims(markdown: str, readme: Path, marker: str = "claims") -> None:
    """Replace the text between ``<!-- <marker>:begin -->`` and ``<!-- <marker>:end -->``."""
    text = readme.read_text()
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    if begin not in text or end not in text:
        raise SystemExit(f"{readme} has no {begin} ... {end} markers")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    readme.write_text(f"{head}{begin}\n{markdown}{end}{tail}")


def plot(rows: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_f) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, r in rows.items():
        h = r["history"]
        if not h:  # --timing-only
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
    p.add_argument(
        "--equal",
        choices=["time", "steps", "flops"],
        default="time",
        help="compare at equal wall-clock (--seconds, default), equal steps (--steps: same tokens) or equal "
        "training FLOPs (the preset with the most FLOPs per step takes --steps, each other as many as its "
        "FLOPs allow)",
    )
    p.add_argument("--steps", type=int, default=2000, help="steps per run under --equal steps (or flops)")
    p.add_argument("--label", default=None)
    p.add_argument("--runs-dir", default="runs/compare", help="checkpoints and metrics: <runs-dir>/<preset>/")
    p.add_argument("--timing-rounds", type=int, default=9, help="interleaved step-time rounds (0: skip)")
    p.add_argument("--timing-only", action="store_true", help="no training: time fresh models side by side")
    p.add_argument("--seeds", type=int, default=1, help="training runs per preset, seeds interleaved (full run: 3)")
    p.add_argument("--seed-base", type=int, default=1337, help="seed of the first run (train.seed); then +1, +2, ...")
    p.add_argument("--data", default=None, help="a corpus instead of Shakespeare (data.source: text or token file)")
    p.add_argument(
        "--write-readme",
        nargs="?",
        const="docs/benchmarks.md",
        default=None,
        metavar="FILE",
        help="write the claim table into docs/benchmarks.md (or the given file) between its claims markers",
    )
    p.add_argument(
        "--evidence",
        nargs="+",
        default=None,
        metavar="JSON",
        help="no training: write the loss claims of these compare JSONs as one table into docs/benchmarks.md "
        "(or --write-readme FILE) between its evidence markers",
    )
    p.add_argument("overrides", nargs="*", help="dotlist overrides for every preset, e.g. train.batch_size=4")
    add_compare_option(p)
    args = p.parse_args()
    if args.evidence:
        payloads = [json.loads(Path(f).read_text()) for f in args.evidence]
        target = Path(args.write_readme or "docs/benchmarks.md")
        write_readme_claims(evidence_markdown(payloads), target, "evidence")
        print(f"wrote the evidence table of {len(payloads)} runs into {target}")
        return
    if args.timing_only and args.timing_rounds < 1:
        p.error("--timing-only needs --timing-rounds >= 1")
    result_name = "compare-timing" if args.timing_only else "compare"
    before = load_run(result_name, args.compare)
    seconds = 60.0 if args.quick else args.seconds
    extra = ["train.progress=false", *args.overrides]
    if args.data:
        extra.append(f"data.source={args.data}")
    if args.quick:
        extra.append("train.eval_every=20")
    rows, models = {}, {}
    steps_of = equal_budget_steps(args.presets, extra, args.equal, args.steps)
    seeds = [args.seed_base + i for i in range(args.seeds)]
    per_seed: dict[str, list[dict]] = {p: [] for p in args.presets}
    for seed in seeds:  # round-robin: every preset once per seed
        for preset in args.presets:
            torch.manual_seed(0)
            cfg = preset_config(
                preset, seconds, extra, args.runs_dir, seed if args.seeds > 1 else None, steps_of[preset]
            )
            if args.timing_only:
                model = MoDETransformer(cfg.model)
                per_seed[preset].append(describe(preset, cfg, model) | {"history": [], "seed": seed})
            else:
                row, model = run(preset, cfg)
                per_seed[preset].append(row | {"seed": seed})
                print(f"{preset} (seed {seed}): {row['steps']} steps, val {row['val_bpb']:.3f} bpb", flush=True)
            models[preset] = (cfg, model)
    rows = {p: merge_seeds(runs) if not args.timing_only else runs[0] for p, runs in per_seed.items()}
    if args.timing_rounds:
        for name, ms in interleaved_step_ms(models, args.timing_rounds).items():
            rows[name]["step_ms_interleaved"] = ms
    dense_ms = rows.get("dense", {}).get("step_ms_interleaved")
    for r in rows.values():
        r["step_ratio"] = r["step_ms_interleaved"] / dense_ms if dense_ms else None
    if args.timing_only:
        print(f"\nfresh models, threads={torch.get_num_threads()}")
    else:
        budget = {"time": f"{seconds:.0f} s", "steps": f"{args.steps} steps"}.get(
            args.equal, f"equal FLOPs, {steps_of}"
        )
        print(f"\ntraining budget {budget} per variant, threads={torch.get_num_threads()}")
    print_table(
        list(rows.values()),
        [
            ("variant", "variant", ""),
            ("params", "params", ","),
            ("active_params", "active", ","),
            ("gflop_step", "GFLOP/step", ".1f"),
            ("step_ms", "step ms (own run)", ".0f"),
            ("step_ms_interleaved", "step ms (side by side)", ".0f"),
            ("step_ratio", "vs dense", ".2f"),
            ("steps", "steps", ".0f"),
            ("val_bpb", "val bpb", ".3f"),
            ("val_bpb_sd", "sd", ".3f"),
            ("val_bpb_causal", "causal bpb", ".3f"),
        ],
    )
    checked = claims(rows, AT[args.equal])
    for name, c in checked.items():
        interval = f" [{c['lo']:+.3f}, {c['hi']:+.3f}]" if c.get("lo") is not None else ""
        print(f"claim: {name}: {c['value']:+.3f}{interval} -> {c['verdict']}")
    data = load_config(args.presets[0], extra).data
    corpus = data.source
    train_split, val_split, _ = (
        load_splits(corpus, 8, data.val_fraction, data.cache_dir) if not args.timing_only else (None, None, None)
    )
    payload = {
        "seconds": 0 if args.timing_only or args.equal != "time" else seconds,
        "equal": args.equal,
        "steps": args.steps if args.equal != "time" else None,
        "steps_per_preset": steps_of if args.equal != "time" else None,
        "overrides": args.overrides,
        "seeds": seeds,
        "corpus": corpus,
        "corpus_tokens": (len(train_split.tokens) + len(val_split.tokens)) if train_split is not None else None,
        "rows": rows,
        "claims": checked,
        "json_name": f"{result_name}-{args.label}.json" if args.label else f"{result_name}.json",
    }
    path = write_json(result_name, payload, args.label)
    print(f"wrote {path}")
    if args.write_readme and not args.timing_only:
        write_readme_claims(claims_markdown(payload), Path(args.write_readme))
        print(f"wrote the claim table into {args.write_readme}")
    if not args.timing_only:
        png = result_path("compare", args.label, ".png")
        plot(rows, png)
        print(f"wrote {png}")
    if before is not None:
        fields = [("step_ms_interleaved", ".0f"), ("step_ratio", ".3f")]
        print_comparison(rows, before, ["variant"], fields if args.timing_only else [*fields, ("val_bpb", ".3f")])


if __name__ == "__main__":
    main()
