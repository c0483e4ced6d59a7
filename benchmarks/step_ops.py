"""CPU proxies of the GPU training step: for one optimizer step of every preset, the aten ops
dispatched, those that compute (views aside: to first order the kernels an eager GPU step
launches), and the sync-class ops (host reads
of device values, data-dependent shapes) with the Python line of each, beside nanoGPT's step
(``nanogpt_ref.py`` with the fused AdamW it uses on a GPU) at the same size.

    python -m benchmarks.step_ops                      # 4 layers, d 64, batch 4 x 64
    python -m benchmarks.step_ops --presets dense mod --layers 8

The step is ``mode.step.train_step`` after one warm-up step (optimizer state exists), with
the expert backend a CUDA run resolves to (``torch`` grouped_mm: the CPU's ``auto`` would
pick the CPU-only ``chunked`` loop for large batches). ``BOUNDS`` are held by
``tests/test_step_ops.py``; the compiled step's launches are ``step_launches.py``'s. Writes
``results/ops[-label].json``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from benchmarks.common import print_table, write_json
from benchmarks.nanogpt_ref import GPT
from mode.compile import compile_blocks
from mode.config import load_config
from mode.model import MoDETransformer
from mode.opcount import OpCounter
from mode.precision import autocast
from mode.step import build_optimizer, train_step

PRESETS = ["dense", "mod", "mod_random", "moe", "moe_capacity", "mode_staged", "mode_integrated", "early_exit"]
# ratio name -> (numerator, denominator, bound or None): eager ops per step, side by side.
# The routed presets' ratios are reported, not bounded: in eager mode a routed block runs a
# dense block's ops on fewer tokens plus its routing's; the launch targets are the compiled
# step's (``step_launches.py``).
BOUNDS = {
    "dense/nanogpt": ("dense", "nanogpt", 1.25),
    "mod/dense": ("mod", "dense", None),
    "moe/dense": ("moe", "dense", None),
}


def overrides(layers: int, d_model: int, n_heads: int, seq: int, batch: int) -> list[str]:
    return [
        f"model.n_layers={layers}",
        f"model.d_model={d_model}",
        f"model.n_heads={n_heads}",
        f"model.seq_len={seq}",
        f"train.batch_size={batch}",
        "train.grad_clip=1.0",
        "model.moe.backend=torch",
    ]


def make_step(
    preset: str,
    layers: int = 4,
    d_model: int = 64,
    n_heads: int = 4,
    seq: int = 64,
    batch: int = 4,
    precision: str = "fp32",
    metrics: bool = False,
    compiled: bool = False,
    device: str = "cpu",
) -> Callable[[], None]:
    """One training step of ``preset`` (or "nanogpt": ``nanogpt_ref.GPT``, fused AdamW,
    clipping) on a fixed batch, as a function; ``compiled``: every block compiled as
    ``train.compile=true`` does (``fullgraph``). A step the training loop does not log
    (``metrics=False``) unless asked."""
    cfg = load_config("dense" if preset == "nanogpt" else preset, overrides(layers, d_model, n_heads, seq, batch))
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, cfg.model.vocab_size, (batch, seq), generator=gen).to(device) for _ in range(2))
    if preset == "nanogpt":
        model = GPT(cfg.model.vocab_size, seq, d_model, layers, n_heads).to(device)
        if compiled:
            compile_blocks(model, fullgraph=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), fused=True)

        def step() -> None:
            with autocast(precision, x.device):
                _, loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step
    model = MoDETransformer(cfg.model).to(device)
    if compiled:
        compile_blocks(model, fullgraph=True)
    opt = build_optimizer(model, cfg.train)
    return lambda: train_step(model, opt, x, y, cfg.train.grad_clip, precision=precision, metrics=metrics)


def count_step(
    preset: str,
    layers: int = 4,
    d_model: int = 64,
    n_heads: int = 4,
    seq: int = 64,
    batch: int = 4,
    precision: str = "fp32",
    metrics: bool = False,
) -> OpCounter:
    """The ops of one eager training step of ``preset`` (``make_step``) after a warm-up step."""
    step = make_step(preset, layers, d_model, n_heads, seq, batch, precision, metrics)
    step()
    with OpCounter() as ops:
        step()
    return ops


def step_parser(doc: str, presets: list[str], d_model: int, seq: int, batch: int) -> argparse.ArgumentParser:
    """The options of a one-step count: presets, the shape (4 layers, 4 heads), ``--metrics``."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=presets, choices=presets)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=d_model)
    parser.add_argument("--n-heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=seq)
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--metrics", action="store_true", help="count a logging step (routing metrics on)")
    return parser


def main() -> None:
    parser = step_parser(__doc__, PRESETS, d_model=64, seq=64, batch=4)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--top", type=int, default=8, help="ops listed per preset")
    parser.add_argument("--label", default=None)
    args = parser.parse_args()
    shape = (args.layers, args.d_model, args.n_heads, args.seq, args.batch)
    counts = {p: count_step(p, *shape, args.precision, args.metrics) for p in ["nanogpt", *args.presets]}
    rows = [{"preset": p, "ops": c.total, "kernels": c.kernels, "syncs": c.syncs} for p, c in counts.items()]
    print(
        f"one training step: {args.layers} layers, d {args.d_model}, batch {args.batch} x {args.seq}, "
        f"{args.precision}, CPU, {'a logging step' if args.metrics else 'a step without routing metrics'}"
    )
    columns = [("preset", "preset", "s"), ("ops", "ops dispatched", "d"), ("kernels", "computing ops", "d")]
    print_table(rows, [*columns, ("syncs", "sync-class ops", "d")])
    ratios = []
    for name, (num, den, bound) in BOUNDS.items():
        if num in counts and den in counts:
            value = counts[num].total / counts[den].total
            meets = None if bound is None else value <= bound
            ratios.append({"ratio": name, "value": value, "bound": bound, "meets": meets})
    print()
    shown = [
        {
            **r,
            "bound": "-" if r["bound"] is None else f"{r['bound']:.2f}",
            "meets": "-" if r["meets"] is None else r["meets"],
        }
        for r in ratios
    ]
    print_table(
        shown,
        [("ratio", "ops ratio", "s"), ("value", "value", ".3f"), ("bound", "bound", "s"), ("meets", "meets", "")],
    )
    for p, c in counts.items():
        for site, n in c.sync_sites().items():
            print(f"  {p}: sync x{n} {site}")
    payload = {
        "args": vars(args),
        "rows": rows,
        "ratios": ratios,
        "sync_sites": {p: c.sync_sites() for p, c in counts.items()},
        "top_ops": {p: dict(c.by_op.most_common(args.top)) for p, c in counts.items()},
    }
    print(f"wrote {write_json('ops', payload, args.label)}")


if __name__ == "__main__":
    main()
