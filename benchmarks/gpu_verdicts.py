"""Every target of the GPU-step issue with its verdict, read from the JSON files that
``gpu_check.sh`` leaves in one folder (``train-*.json``, ``profile.json``, ``moe.json``,
``blocks.json``, ``kernels.json``). Prints a table and writes ``verdicts.json`` there.

    python -m benchmarks.gpu_verdicts benchmarks/results/gpu

A target whose measurement is absent (a step that failed or timed out) is listed as
"not measured", never as met.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import print_table

# ratio of bench_train step times -> the largest value that meets the target
TRAIN_TARGETS = {
    "dense/nanogpt": 1.05,
    "mod/dense": 0.65,
    "mod/mod_random": 1.05,
    "moe/dense": 1.10,
    "mode_staged/dense": 0.70,
    "mode_integrated/dense": 0.95,
}
ROPE_SHARE = 0.05  # of the dense step: 1 - dense_norope / dense
SYNCS = 2.0  # per step
BUSY_SHARE = 0.90
KERNELS_VS_REFERENCE = 1.25
MOE_DROPLESS, MOE_CAPACITY, MOD_BLOCK = 1.25, 1.35, 0.15
COPY_BANDWIDTH = 0.60


def _load(folder: Path, pattern: str) -> list[tuple[str, dict]]:
    return [(p.stem, json.loads(p.read_text())) for p in sorted(folder.glob(pattern))]


def _row(target: str, where: str, value: float | None, bound: float, at_most: bool = True) -> dict:
    meets = None if value is None else (value <= bound if at_most else value >= bound)
    return {
        "target": target,
        "where": where,
        "value": value,
        "bound": f"{'<=' if at_most else '>='} {bound}",
        "verdict": "not measured" if meets is None else ("met" if meets else "MISSED"),
    }


def train_rows(folder: Path) -> list[dict]:
    rows = []
    for name, run in _load(folder, "train*.json"):
        ms = {(r["preset"], r["mode"]): r["ms"] for r in run["rows"]}
        shape = f"{name}: {run['args']['layers']} layers, d {run['args']['d_model']}"
        for mode in run["args"]["modes"]:
            for ratio, bound in TRAIN_TARGETS.items():
                num, den = ratio.split("/")
                if (num, mode) in ms and (den, mode) in ms:
                    rows.append(_row(ratio, f"{shape}, {mode}", ms[num, mode] / ms[den, mode], bound))
            if ("dense", mode) in ms and ("dense_norope", mode) in ms:
                share = 1 - ms["dense_norope", mode] / ms["dense", mode]
                rows.append(_row("RoPE share of the dense step", f"{shape}, {mode}", share, ROPE_SHARE))
    return rows


def profile_rows(folder: Path) -> list[dict]:
    rows = []
    for name, run in _load(folder, "profile*.json"):
        by = {r["preset"]: r for r in run["results"]}
        for preset, r in by.items():
            if r["device_busy_ms"] is None:
                continue  # a CPU run: no device to wait for
            syncs = sum(v for k, v in r["syncs_per_step"].items() if k.startswith("cuda"))
            rows.append(_row("device syncs per step", f"{name}: {preset}", syncs, SYNCS))
            rows.append(_row("device busy share", f"{name}: {preset}", r["device_busy_share"], BUSY_SHARE, False))
        kernels = {p: r["kernels_per_step"] for p, r in by.items() if r["kernels_per_step"] is not None}
        if "dense" in kernels and "nanogpt" in kernels:
            rows.append(
                _row("kernels dense / nanogpt", name, kernels["dense"] / kernels["nanogpt"], KERNELS_VS_REFERENCE)
            )
        if "dense" in kernels and "mod" in kernels:
            rows.append(_row("kernels mod / dense", name, kernels["mod"] / kernels["dense"], 1.0))
    return rows


def layer_rows(folder: Path) -> list[dict]:
    rows = []
    for name, run in _load(folder, "moe*.json"):
        for r in run["rows"]:
            if r["case"] != "balanced":
                continue
            if r["layer"].startswith("dropless[auto") or r["layer"] == "dropless[torch, index moves]":
                rows.append(_row(f"{r['layer']} / dense MLP", f"{name} {r['dtype']}", r["vs_dense"], MOE_DROPLESS))
            if r["layer"] == "capacity cf=1.25":
                rows.append(_row("capacity cf 1.25 / dense MLP", f"{name} {r['dtype']}", r["vs_dense"], MOE_CAPACITY))
    for name, run in _load(folder, "blocks*.json"):
        for r in run["rows"]:
            if r["block"] == "mod" and r["capacity"] == 0.125:
                rows.append(_row("MoD block c 0.125 / dense block", name, r["time_ratio"], MOD_BLOCK))
    for name, run in _load(folder, "kernels*.json"):
        for r in run["rows"]:
            if r["op"].startswith("mod "):
                rows.append(
                    _row(f"{r['op']} [{r['path']}] share of copy bw", name, r.get("of copy bw"), COPY_BANDWIDTH, False)
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    args = parser.parse_args()
    rows = train_rows(args.folder) + profile_rows(args.folder) + layer_rows(args.folder)
    if not rows:
        print(f"no results in {args.folder}")
    print_table(
        rows,
        [
            ("target", "target", "s"),
            ("where", "where", "s"),
            ("value", "value", ".3f"),
            ("bound", "bound", "s"),
            ("verdict", "verdict", "s"),
        ],
    )
    (args.folder / "verdicts.json").write_text(json.dumps(rows, indent=2))
    print(f"wrote {args.folder / 'verdicts.json'}")


if __name__ == "__main__":
    main()
