"""Where ``backend="auto"`` should switch from grouped GEMMs to ``chunked`` on CPU.

    python -m benchmarks.bench_moe_auto               # fp32 + bf16, d 256/512/1024, 512-8192 tokens
    python -m benchmarks.bench_moe_auto --quick       # fewer sizes

For each (dtype, d_model, tokens) a ``DroplessMoE`` (8 experts, top-2, ffn 4d/top_k) runs one
training step's forward + backward with the ``chunked`` backend and with the grouped
``torch`` backend (permute -> ``torch._grouped_mm`` -> combine), the two timed round-robin
(median of repeats). ``buffer MiB`` is the size of the [M, D] sorted-token buffer that the
grouped path builds and ``chunked`` avoids (M = tokens * top_k); ``auto picks`` is what
``grouped_gemm.resolve_name`` chooses for that size (``CHUNKED_MIN_BYTES``). A row is a
miss when auto picks the slower one by more than 5%.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from benchmarks.common import (
    add_compare_option,
    fwd_bwd_step,
    interleaved_median_times,
    load_run,
    print_comparison,
    print_table,
    write_json,
)
from mode.experts.grouped_gemm import CHUNKED_MIN_BYTES, resolve_name
from mode.experts.moe import DroplessMoE

FULL = [(d, n) for d in (256, 512) for n in (512, 1024, 2048, 4096, 8192)] + [(1024, 1536), (1024, 4096)]
QUICK = [(256, 1024), (512, 2048), (512, 8192)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="three sizes instead of twelve")
    p.add_argument("--label", default=None)
    add_compare_option(p)
    args = p.parse_args()
    before = load_run("moe_auto", args.compare)
    torch.manual_seed(0)
    E, K = args.experts, args.top_k
    rows = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for d, n in QUICK if args.quick else FULL:
            f = 4 * d // K
            chunked = DroplessMoE(d, f, E, K, backend="chunked")
            grouped = DroplessMoE(d, f, E, K, backend="torch")
            grouped.load_state_dict(chunked.state_dict())
            chunked.to(dtype), grouped.to(dtype)
            x = torch.randn(n, d, dtype=dtype, requires_grad=True)
            g = torch.randn(n, d, dtype=dtype)
            t = interleaved_median_times(
                {"chunked": partial(fwd_bwd_step, chunked, x, g), "torch": partial(fwd_bwd_step, grouped, x, g)},
                args.warmup,
                args.repeats,
                settle_s=0.1,
            )
            picks = resolve_name("auto", "cpu", dtype, d, f, rows=n * K)
            ratio = t["chunked"] / t["torch"]
            faster = "chunked" if ratio < 1 else "torch"
            rows.append(
                {
                    "dtype": dtype_name,
                    "d_model": d,
                    "tokens": n,
                    "buffer_mib": n * K * d * x.element_size() / 2**20,
                    "chunked_ms": 1000 * t["chunked"],
                    "torch_ms": 1000 * t["torch"],
                    "chunked_over_torch": ratio,
                    "auto_picks": picks,
                    "miss": picks != faster and abs(ratio - 1) > 0.05,
                }
            )
    print(f"DroplessMoE fwd+bwd, E={E}, top-{K}, ffn=4d/top_k, cpu, threads={torch.get_num_threads()}")
    print_table(
        rows,
        [
            ("dtype", "dtype", ""),
            ("d_model", "d", ""),
            ("tokens", "tokens", ""),
            ("buffer_mib", "buffer MiB", ".1f"),
            ("chunked_ms", "chunked ms", ".1f"),
            ("torch_ms", "torch ms", ".1f"),
            ("chunked_over_torch", "chunked/torch", ".3f"),
            ("auto_picks", "auto picks", ""),
            ("miss", "miss", ""),
        ],
    )
    misses = sum(r["miss"] for r in rows)
    mib = CHUNKED_MIN_BYTES / 2**20
    print(f"threshold {mib:.0f} MiB: {misses} of {len(rows)} sizes picked the slower path by > 5%")
    path = write_json(
        "moe_auto",
        {"args": vars(args), "chunked_min_bytes": CHUNKED_MIN_BYTES, "rows": rows, "misses": misses},
        args.label,
    )
    print(f"wrote {path}")
    if before is not None:
        print_comparison(
            rows,
            before,
            ["dtype", "d_model", "tokens"],
            [("chunked_ms", ".2f"), ("torch_ms", ".2f"), ("chunked_over_torch", ".3f")],
        )


if __name__ == "__main__":
    main()
