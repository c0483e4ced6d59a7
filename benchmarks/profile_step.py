"""Where one optimizer step's time goes: ``torch.profiler`` over a few steps of each preset
(the same step as ``bench_train.py``), the top ops by self time, the device's busy share of
the wall-clock (CUDA), and the host syncs per step with the Python lines that cause them.

    python -m benchmarks.profile_step --presets dense mod              # CPU, bench_train's size
    python -m benchmarks.profile_step --device cuda --presets dense mod moe \\
        --batch 16 --seq 1024 --layers 8 --d-model 1024 --n-heads 16

A step whose device is busy for much less than its wall-clock is bound by the host: kernel
launches, or syncs (``.item()``, ``nonzero``, data-dependent shapes) that stop the host from
queueing work ahead of the device. Writes ``results/profile[-label].json``.
"""

from __future__ import annotations

import argparse
import time
import traceback
import warnings
from pathlib import Path

import torch
from torch.autograd import DeviceType

from benchmarks.bench_train import PRESETS, build
from benchmarks.common import print_table, write_json

# Host-side events that wait for the device (CUDA) or read a tensor's value on the host.
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense")


def python_frame(name: str) -> bool:
    """Events that ``with_stack`` adds for Python calls (``path.py(line): function``)."""
    return ".py(" in name or name.startswith("<built-in")


def sync_sites(events: list, steps: int, n_sites: int) -> list[dict]:
    """Where the sync events come from: the innermost three Python frames of this repository
    above each (walking the profiler's parent links), most frequent first."""
    counts: dict[tuple[str, tuple[str, ...]], int] = {}
    for e in events:
        if e.name not in SYNC_EVENTS:
            continue
        frames, parent = [], e.cpu_parent
        while parent is not None and len(frames) < 3:
            if python_frame(parent.name) and ("mode/" in parent.name or "benchmarks/" in parent.name):
                frames.append(parent.name)
            parent = parent.cpu_parent
        site = (e.name, tuple(frames))
        counts[site] = counts.get(site, 0) + 1
    sites = [{"event": ev, "per_step": n / steps, "stack": list(st)} for (ev, st), n in counts.items()]
    return sorted(sites, key=lambda s: -s["per_step"])[:n_sites]


def synchronizing_lines(step, x: torch.Tensor, y: torch.Tensor, precision: str) -> list[dict]:
    """CUDA: one step under ``torch.cuda.set_sync_debug_mode("warn")``, which warns at every
    operation that waits for the device; the innermost lines of this repository's Python
    stack at each warning (where the sync comes from), most frequent first."""
    counts: dict[str, int] = {}

    def record(message, *args, **kwargs) -> None:
        if "synchroniz" not in str(message):
            return
        ours = [f for f in traceback.extract_stack() if "/mode/" in f.filename or "/benchmarks/" in f.filename]
        site = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(ours[-3:])) or "?"
        counts[site] = counts.get(site, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(x, y, precision)
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [{"line": k, "count": v} for k, v in sorted(counts.items(), key=lambda kv: -kv[1])]


def profile_preset(preset: str, args, device: torch.device) -> dict:
    cfg, model, step = build(preset, args, device)
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, cfg.model.vocab_size, (args.batch, args.seq), generator=gen).to(device) for _ in range(2))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(args.warmup):
        step(x, y, args.precision)
    sync()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, with_stack=True) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step(x, y, args.precision)
        sync()
        wall_ms = (time.perf_counter() - t0) * 1e3 / args.steps
    sync_lines = synchronizing_lines(step, x, y, args.precision) if device.type == "cuda" else []
    events = prof.events()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    busy_ms = sum(e.time_range.elapsed_us() for e in kernels) / 1e3 / args.steps if kernels else None
    key = "self_device_time_total" if kernels else "self_cpu_time_total"
    ops = [a for a in prof.key_averages() if not python_frame(a.key)]
    top = sorted(ops, key=lambda a: -getattr(a, key))[: args.top]
    syncs = {name: sum(1 for e in events if e.name == name) / args.steps for name in SYNC_EVENTS}
    return {
        "preset": preset,
        "wall_ms": wall_ms,
        "device_busy_ms": busy_ms,
        "device_busy_share": busy_ms / wall_ms if busy_ms is not None else None,
        "kernels_per_step": len(kernels) / args.steps if kernels else None,
        "syncs_per_step": {k: v for k, v in syncs.items() if v},
        "sync_sites": sync_sites(events, args.steps, args.sites),
        "synchronizing_lines": sync_lines,
        "top_ops": [
            {
                "op": a.key,
                "calls_per_step": a.count / args.steps,
                "self_ms_per_step": getattr(a, key) / 1e3 / args.steps,
            }
            for a in top
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["dense", "mod"], choices=PRESETS)
    parser.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=320)
    parser.add_argument("--n-heads", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3, help="profiled steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--top", type=int, default=15, help="ops listed per preset")
    parser.add_argument("--sites", type=int, default=8, help="sync sites listed per preset")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--label", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    results = [profile_preset(p, args, device) for p in args.presets]
    print(f"batch {args.batch} x {args.seq}, {args.layers} layers, d {args.d_model}, {args.precision}, {device}")
    rows = [
        {
            "preset": r["preset"],
            "wall": r["wall_ms"],
            "busy": r["device_busy_ms"],
            "share": r["device_busy_share"],
            "kernels": r["kernels_per_step"],
            "syncs": sum(r["syncs_per_step"].values()),
        }
        for r in results
    ]
    columns = [("preset", "preset", "s"), ("wall", "wall ms/step", ".1f"), ("busy", "device busy ms", ".1f")]
    columns += [("share", "busy share", ".2f"), ("kernels", "kernels/step", ".0f"), ("syncs", "syncs/step", ".1f")]
    print_table(rows, columns)
    for r in results:
        print(f"\n{r['preset']}: top ops by self time (ms per step)")
        for op in r["top_ops"]:
            print(f"  {op['self_ms_per_step']:9.3f}  x{op['calls_per_step']:<7.1f} {op['op']}")
        for site in r["sync_sites"]:
            print(f"  sync {site['event']} x{site['per_step']:.1f}/step at {' <- '.join(site['stack']) or '?'}")
        for line in r["synchronizing_lines"]:
            print(f"  synchronizing op x{line['count']} at {line['line']}")
    write_json("profile", {"args": vars(args), "results": results}, label=args.label)


if __name__ == "__main__":
    main()
