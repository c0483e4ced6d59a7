"""The README's main job: train tiny variants side by side on the embedded corpus and compare.

python -m mode.demo                       # dense vs MoD, ~1 minute each
python -m mode.demo --variants dense mod --seconds 30
"""

from __future__ import annotations

import argparse
import math

import torch

from mode.config import load_config
from mode.data import decode, encode
from mode.devices import resolve_device
from mode.flops import train_flops_per_step
from mode.precision import bf16_speedup, resolve
from mode.train import train

LAYOUTS = {"dense": "dense", "mod": "dense,mod"}


def run_demo(
    variants: list[str], seconds: float, sample_bytes: int = 200, overrides: list[str] | None = None
) -> list[dict]:
    """Train each variant of the ``demo`` preset for ``seconds``; returns one row per variant."""
    rows = []
    for variant in variants:
        extra = [
            f"name={variant}",
            f"train.max_seconds={seconds}",
            f"train.out_dir=runs/demo/{variant}",
            "train.overwrite=true",  # the demo owns its directories: a second demo replaces the first
            "train.progress=false",
        ]
        if variant in LAYOUTS:
            extra.append(f"model.layout={LAYOUTS[variant]}")
        else:
            extra += [f"model.layout={variant}"]
        cfg = load_config("demo", extra + list(overrides or []))
        device = resolve_device(cfg.train.device)
        precision = resolve(cfg.train.precision, device)
        how = f" ({cfg.train.precision}: bf16 matmuls {bf16_speedup(str(device)):.1f}x fp32 here)"
        print(f"training {variant} ({cfg.model.layout}) for {seconds:.0f} s in {precision}{how} ...", flush=True)
        model, result = train(cfg)
        print(f"  {result.steps} steps, val loss {result.val_loss:.3f}", flush=True)
        model.eval()
        torch.manual_seed(0)
        sample = decode(model.generate(encode("ROMEO:"), sample_bytes, temperature=0.8, top_k=50)[0])
        rows.append(
            {
                "variant": variant,
                "precision": result.precision,
                "params": model.num_params(),
                "steps": result.steps,
                "step_ms": 1000 * result.median_step_time,
                "gflops_step": train_flops_per_step(cfg.model, cfg.train.batch_size) / 1e9,
                "train_loss": result.train_loss,
                "val_loss": result.val_loss,
                "val_bpb": result.val_loss / math.log(2),
                "sample": sample,
            }
        )
    return rows


def format_table(rows: list[dict]) -> str:
    dense_ms = next((r["step_ms"] for r in rows if r["variant"] == "dense"), None)
    head = (
        f"{'variant':<16}{'params':>10}{'GFLOP/step':>12}{'step ms':>9}{'vs dense':>9}{'steps':>7}"
        f"{'train loss':>12}{'val loss':>10}{'val bpb':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = f"{r['step_ms'] / dense_ms:.2f}x" if dense_ms else "-"
        lines.append(
            f"{r['variant']:<16}{r['params']:>10,}{r['gflops_step']:>12.2f}{r['step_ms']:>9.1f}{ratio:>9}"
            f"{r['steps']:>7}{r['train_loss']:>12.3f}{r['val_loss']:>10.3f}{r['val_bpb']:>9.3f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=["dense", "mod"])
    parser.add_argument("--seconds", type=float, default=60.0, help="training wall-clock per variant")
    parser.add_argument("--sample-bytes", type=int, default=200)
    parser.add_argument("overrides", nargs="*", help="dotlist overrides applied to every variant")
    args = parser.parse_args(argv)
    rows = run_demo(args.variants, args.seconds, args.sample_bytes, args.overrides)
    print("\n" + format_table(rows))
    for r in rows:
        print(f"\n--- sample from {r['variant']} ---\n{r['sample']}")


if __name__ == "__main__":
    main()
