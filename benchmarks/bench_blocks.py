"""MoD block vs dense block: forward+backward time beside the analytic FLOP ratio.

    python benchmarks/bench_blocks.py                 # d 512, 8 heads, seq 1024, batch 4, fp32
    python benchmarks/bench_blocks.py --repeats 9 --label mybox

Targets: MoD at capacity 0.125 <= 0.11x dense; at every capacity time ratio <= 1.15x FLOP ratio.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import fwd_bwd_step, median_time, print_table, write_json  # noqa: E402

from mode.config import load_config  # noqa: E402
from mode.flops import block_flops  # noqa: E402
from mode.layers.blocks import DenseBlock, MoDBlock  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--capacities", type=float, nargs="+", default=[1.0, 0.5, 0.25, 0.125, 0.0625])
    p.add_argument("--label", default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    d, h, T = args.d_model, args.n_heads, args.seq
    x = torch.randn(args.batch, T, d, requires_grad=True)
    gy = torch.randn(args.batch, T, d)
    dense = DenseBlock(d, h)
    dense_s = median_time(lambda: fwd_bwd_step(dense, x, gy), args.warmup, args.repeats)
    rows = [{"block": "dense", "capacity": 1.0, "ms": 1000 * dense_s, "time_ratio": 1.0, "flop_ratio": 1.0}]
    for c in args.capacities:
        cfg = load_config(
            None, [f"model.d_model={d}", f"model.n_heads={h}", f"model.seq_len={T}", f"model.mod.capacity={c}"]
        ).model
        mod = MoDBlock(d, h, capacity=c)
        mod.block.load_state_dict(dense.state_dict())
        s = median_time(lambda mod=mod: fwd_bwd_step(mod, x, gy), args.warmup, args.repeats)
        flop_ratio = block_flops("mod", cfg) / block_flops("dense", cfg)
        rows.append(
            {
                "block": "mod",
                "capacity": c,
                "ms": 1000 * s,
                "time_ratio": s / dense_s,
                "flop_ratio": flop_ratio,
                "time_over_flop": (s / dense_s) / flop_ratio,
            }
        )
    print(f"fwd+bwd, d={d}, heads={h}, seq={T}, batch={args.batch}, float32, threads={torch.get_num_threads()}")
    print_table(
        rows,
        [
            ("block", "block", ""),
            ("capacity", "capacity", ".4f"),
            ("ms", "ms", ".1f"),
            ("time_ratio", "time/dense", ".3f"),
            ("flop_ratio", "FLOP/dense", ".3f"),
            ("time_over_flop", "time/FLOP", ".2f"),
        ],
    )
    at_0125 = next((r for r in rows if r["block"] == "mod" and r["capacity"] == 0.125), None)
    targets = {
        "mod_0125_time_ratio_le_0.11": at_0125 is not None and at_0125["time_ratio"] <= 0.11,
        "time_within_1.15x_flop_ratio": all(r.get("time_over_flop", 1.0) <= 1.15 for r in rows),
    }
    print("targets:", targets)
    path = write_json("blocks", {"args": vars(args), "rows": rows, "targets": targets}, args.label)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
