"""Expert-parallel dispatch on gloo ranks: bytes sent by the all-to-all (counted, and the
analytic formula), and step time, for plain MoE and staged MoDE (capacity 0.125).

    python -m benchmarks.bench_ep                 # 2 and 4 ranks on this machine
    python -m benchmarks.bench_ep --ranks 2 --steps 5

Counted bytes are the forward all-to-all rows this rank sent to other ranks (dispatch and
combine), times the row size; the backward sends the same again. Analytic, for uniform
routing: 2 * layers * tokens * top_k * (P - 1) / P * D * bytes (tokens = routed tokens:
all of them for MoE, capacity * T per sequence for staged MoDE).
Target: staged MoDE dispatch volume <= 0.15x plain MoE.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from benchmarks.common import add_compare_option, load_run, print_comparison, print_table, write_json
from mode.config import load_config
from mode.model import MoDETransformer
from mode.parallel.expert_parallel import dispatch_stats, parallelize, reset_dispatch_stats
from mode.parallel.mesh import destroy, init_mesh

MODEL = [
    "model.d_model=256",
    "model.n_heads=4",
    "model.n_layers=4",
    "model.seq_len=256",
    "model.moe.n_experts=8",
    "model.moe.top_k=2",
    "model.mod.capacity=0.125",
    "model.mod.causal=none",
]


def worker(rank: int, world: int, port: int, preset: str, batch: int, steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        ctx = init_mesh(dp=1, ep=world)
        cfg = load_config(preset, MODEL).model
        torch.manual_seed(0)
        model = parallelize(MoDETransformer(cfg), ctx)
        gen = torch.Generator().manual_seed(rank)
        idx = torch.randint(0, 256, (batch, cfg.seq_len), generator=gen)
        times, counted = [], []
        for _ in range(steps + 1):  # the first step is a warm-up
            reset_dispatch_stats(model)
            t0 = time.perf_counter()
            _, loss = model(idx, idx)
            loss.backward()
            times.append(time.perf_counter() - t0)
            counted.append(dispatch_stats(model)["bytes_sent"])
        torch.save(
            {"step_s": statistics.median(times[1:]), "bytes": statistics.median(counted[1:])},
            Path(out) / f"{preset}-{rank}.pt",
        )
    finally:
        destroy()


def analytic_bytes(cfg, world: int, batch: int, preset: str) -> float:
    n_layers = sum(k in ("moe", "mode_staged") for k in cfg.block_kinds())
    T = cfg.seq_len
    tokens = batch * (int(cfg.mod.capacity * T) if preset == "mode_staged" else T)
    return 2 * n_layers * tokens * cfg.moe.top_k * (world - 1) / world * cfg.d_model * 4


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--label", default=None)
    add_compare_option(p)
    args = p.parse_args()
    before = load_run("ep", args.compare)
    rows = []
    for world in args.ranks:
        for preset in ("moe", "mode_staged"):
            with tempfile.TemporaryDirectory() as out:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
                mp.spawn(worker, args=(world, port, preset, args.batch, args.steps, out), nprocs=world, join=True)
                per_rank = [torch.load(Path(out) / f"{preset}-{r}.pt") for r in range(world)]
            cfg = load_config(preset, MODEL).model
            rows.append(
                {
                    "ranks": world,
                    "variant": preset,
                    "counted_mb": sum(r["bytes"] for r in per_rank) / world / 1e6,
                    "analytic_mb": analytic_bytes(cfg, world, args.batch, preset) / 1e6,
                    "step_ms": 1000 * max(r["step_s"] for r in per_rank),
                }
            )
    for r in rows:
        moe = next(x for x in rows if x["ranks"] == r["ranks"] and x["variant"] == "moe")
        r["vs_moe"] = r["counted_mb"] / moe["counted_mb"]
    print(
        f"forward all-to-all bytes per rank per step (fp32, {args.batch} x 256 tokens per rank, d 256, "
        f"E 8, top-2, 2 MoE layers); backward sends the same again"
    )
    print_table(
        rows,
        [
            ("ranks", "ranks", "d"),
            ("variant", "variant", ""),
            ("counted_mb", "counted MB", ".3f"),
            ("analytic_mb", "analytic MB", ".3f"),
            ("vs_moe", "vs MoE", ".3f"),
            ("step_ms", "step ms", ".0f"),
        ],
    )
    targets = {
        f"{r['ranks']} ranks: staged MoDE volume <= 0.15x MoE": {"ratio": r["vs_moe"], "met": r["vs_moe"] <= 0.15}
        for r in rows
        if r["variant"] == "mode_staged"
    }
    for k, t in targets.items():
        print(f"target {k}: {t['ratio']:.3f} -> {'met' if t['met'] else 'MISSED'}")
    path = write_json("ep", {"args": vars(args), "model": MODEL, "rows": rows, "targets": targets}, args.label)
    print(f"wrote {path}")
    if before is not None:
        print_comparison(rows, before, ["ranks", "variant"], [("counted_mb", ".3f"), ("step_ms", ".0f")])


if __name__ == "__main__":
    main()
