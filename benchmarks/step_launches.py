"""Kernel launches of one compiled training step per preset, beside nanoGPT's: the CPU proxy of
a GPU step's launch count (``benchmarks/launch_proxy.py``: inductor's Triton code for the CPU,
run under Triton's interpreter).

    python -m benchmarks.step_launches                      # every preset, 4 layers, d 128
    python -m benchmarks.step_launches --presets dense mod --metrics

Every model is compiled as ``train.compile=true`` compiles it (``mode.compile.compile_blocks``,
``fullgraph=True``), nanoGPT (``nanogpt_ref.py``, fused AdamW, clipping) the same way, block by
block. The step is ``mode.step.train_step`` after one warm-up step, a step the training loop
does not log unless ``--metrics``. ``TARGETS`` are the GPU-step issue's bounds; the table says
which hold. Writes ``results/launches[-label].json``.

On a GPU, ``--cuda`` counts the same step's kernels with the CUDA profiler instead (no
interpreter): ``gpu_check.sh`` writes them beside the proxy's, which calibrates it.

Run it as a script, in its own process: importing it switches ``torch.compile`` to the Triton
interpreter for the whole process (``launch_proxy.interpret``), unless ``--cuda`` is given.
"""

from __future__ import annotations

import sys

from benchmarks.launch_proxy import LaunchCounter, interpret

CUDA = "--cuda" in sys.argv
DEVICE = "cuda" if CUDA else "cpu"
if not CUDA:
    interpret()  # before anything imports Triton

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from benchmarks.common import print_table, write_json  # noqa: E402
from benchmarks.step_ops import make_step, step_parser  # noqa: E402

PRESETS = ["dense", "mod", "mod_random", "moe", "mode_staged", "mode_integrated"]
# ratio name -> (numerator, denominator, bound): compiled launches per step, side by side.
TARGETS = {
    "dense/nanogpt": ("dense", "nanogpt", 1.10),
    "mod/dense": ("mod", "dense", 1.15),
    "mod_random/dense": ("mod_random", "dense", 1.05),
    "moe/dense": ("moe", "dense", 1.20),
    "mode_staged/dense": ("mode_staged", "dense", 1.35),
    "mode_integrated/dense": ("mode_integrated", "dense", 1.25),
}
# Launches outside compiled regions: at most nanoGPT's plus this many, in every preset.
EAGER_SLACK = 8


def count_compiled_step(
    preset: str,
    layers: int = 4,
    d_model: int = 128,
    n_heads: int = 4,
    seq: int = 32,
    batch: int = 2,
    metrics: bool = False,
) -> LaunchCounter:
    """The launches of one compiled training step of ``preset`` (or "nanogpt") after a
    warm-up step (which compiles and makes the optimizer state)."""
    step = make_step(preset, layers, d_model, n_heads, seq, batch, metrics=metrics, compiled=True, device=DEVICE)
    step()
    if CUDA:
        step()
        return CudaKernels.of(step)
    with LaunchCounter() as launches:
        step()
    return launches


class CudaKernels(LaunchCounter):
    """The kernels the CUDA profiler saw in one call of ``step`` (all in ``triton``: the
    profiler does not tell compiled code from eager here; the proxy's split is its own)."""

    @classmethod
    def of(cls, step) -> CudaKernels:
        from torch.autograd import DeviceType  # noqa: PLC0415

        counter = cls()
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            step()
            torch.cuda.synchronize()
        for event in prof.events():
            if event.device_type == DeviceType.CUDA and not event.name.startswith("Memcpy"):
                counter.triton += 1
                counter.by_name[event.name] += 1
        return counter


def main() -> None:
    parser = step_parser(__doc__, PRESETS, d_model=128, seq=32, batch=2)
    parser.add_argument("--top", type=int, default=12, help="eager ops listed per preset")
    parser.add_argument("--label", default=None)
    parser.add_argument("--cuda", action="store_true", help="count CUDA kernels with the profiler (on a GPU)")
    parser.add_argument("--json", default=None, help="write the results to this path instead of results/")
    args = parser.parse_args()
    shape = (args.layers, args.d_model, args.n_heads, args.seq, args.batch)
    counts = {p: count_compiled_step(p, *shape, args.metrics) for p in ["nanogpt", *args.presets]}
    base = counts["nanogpt"]
    rows = [
        {
            "preset": p,
            "launches": c.launches,
            "x_nanogpt": c.launches / base.launches,
            "triton": c.triton,
            "extern": c.extern,
            "eager": c.eager,
            "eager_bound": base.eager + EAGER_SLACK,
            "eager_meets": c.eager <= base.eager + EAGER_SLACK,
        }
        for p, c in counts.items()
    ]
    print(
        f"one compiled training step: {args.layers} layers, d {args.d_model}, batch {args.batch} x {args.seq}, "
        f"{'a logging step' if args.metrics else 'a step without routing metrics'}; "
        + ("CUDA kernels, CUDA profiler" if CUDA else "Triton kernels under the interpreter (CPU proxy of a GPU step)")
    )
    print_table(
        rows,
        [
            ("preset", "preset", "s"),
            ("launches", "launches", "d"),
            ("x_nanogpt", "x nanoGPT", ".2f"),
            ("triton", "Triton kernels", "d"),
            ("extern", "extern calls", "d"),
            ("eager", "outside compiled", "d"),
            ("eager_meets", f"<= nanoGPT + {EAGER_SLACK}", ""),
        ],
    )
    ratios = []
    for name, (num, den, bound) in TARGETS.items():
        if num in counts and den in counts:
            value = counts[num].launches / counts[den].launches
            ratios.append({"ratio": name, "value": value, "bound": bound, "meets": value <= bound})
    print()
    print_table(
        ratios,
        [
            ("ratio", "launches ratio", "s"),
            ("value", "value", ".3f"),
            ("bound", "bound", ".2f"),
            ("meets", "meets", ""),
        ],
    )
    payload = {
        "args": vars(args),
        "rows": rows,
        "ratios": ratios,
        "eager_ops": {p: dict(c.eager_ops.most_common(args.top)) for p, c in counts.items()},
        "kernels": {p: dict(c.by_name.most_common()) for p, c in counts.items()},
    }
    if args.json:
        Path(args.json).write_text(json.dumps(payload, indent=2))
        print(f"wrote {args.json}")
    else:
        print(f"wrote {write_json('launches', payload, args.label)}")


if __name__ == "__main__":
    main()
