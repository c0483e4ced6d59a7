"""Activation memory of MoD vs dense, layer and model, across sequence lengths (CPU or CUDA).

    python -m benchmarks.bench_memory                       # seq 1024-8192, d 256, batch 1
    python -m benchmarks.bench_memory --seqs 1024 2048 --label short

Two measures of one training step (forward + backward), both exact on any device:

- ``saved``: bytes of the distinct storages autograd keeps for the backward
  (``torch.autograd.graph.saved_tensors_hooks``): the activation memory proper.
- ``peak``: the peak of bytes held by tensors created during the step (a dispatch mode that
  adds each new storage when an op returns it and subtracts it when it is freed): activations,
  temporaries and gradients on top of the weights, like ``torch.cuda.max_memory_allocated``
  minus what was allocated before the step.

Target: a MoD layer at capacity 0.125 saves <= 0.3x the activation memory of a dense layer.
Writes ``results/memory[-label].json`` and ``results/memory[-label].png``.
"""

from __future__ import annotations

import argparse
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from benchmarks.common import add_compare_option, load_run, print_comparison, print_table, result_path, write_json
from mode.config import load_config
from mode.layers.blocks import DenseBlock
from mode.layers.mod import MoDBlock
from mode.model import MoDETransformer
from mode.routed import aux_loss

TARGET = 0.3
MiB = 2**20


class PeakTensorMemory(TorchDispatchMode):
    """Peak bytes of storages created while active (freed ones are subtracted)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self.seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.seen and storage.nbytes():
                    self.seen.add(key)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key, storage.nbytes())
        return out


def measure(module: torch.nn.Module, step) -> tuple[int, int]:
    """(saved bytes, peak bytes) of ``step()``, which runs a forward and returns the output and
    the gradient to call ``output.backward(gradient)`` with. Weights that autograd saves (e.g.
    for a linear's input gradient) are not activations and are left out."""
    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in weights:
            saved[st.data_ptr()] = st.nbytes()
        return t

    peak = PeakTensorMemory()
    with peak, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, grad = step()
    with peak:
        out.backward(grad)
    return sum(saved.values()), peak.peak


def layer_step(layer: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor):
    def step():
        layer.zero_grad(set_to_none=True)
        return layer(x), grad

    return step


def model_step(model: MoDETransformer, idx: torch.Tensor):
    def step():
        model.zero_grad(set_to_none=True)
        _, loss = model(idx, idx)
        return loss + aux_loss(model), None

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--capacity", type=float, default=0.125)
    p.add_argument("--device", default="cpu")
    p.add_argument("--label", default=None)
    add_compare_option(p)
    args = p.parse_args()
    device, d = torch.device(args.device), args.d_model
    torch.manual_seed(0)
    rows = []
    for T in args.seqs:
        x = torch.randn(1, T, d, device=device, requires_grad=True)
        layers = {
            "dense layer": DenseBlock(d, args.n_heads).to(device),
            f"MoD layer {args.capacity}": MoDBlock(d, args.n_heads, capacity=args.capacity).to(device),
        }
        base = [f"model.d_model={d}", f"model.n_heads={args.n_heads}", f"model.n_layers={args.n_layers}"]
        base += [f"model.seq_len={T}", f"model.mod.capacity={args.capacity}"]
        models = {
            "dense model": MoDETransformer(load_config(None, [*base, "model.layout=dense"]).model).to(device),
            "MoD model": MoDETransformer(load_config(None, [*base, "model.layout=dense,mod"]).model).to(device),
        }
        idx = torch.randint(0, 256, (1, T), device=device)
        grad = torch.randn_like(x)
        results = {name: measure(m, layer_step(m, x, grad)) for name, m in layers.items()}
        results |= {name: measure(m, model_step(m, idx)) for name, m in models.items()}
        for name, (saved, peak) in results.items():
            ref = results["dense layer" if "layer" in name else "dense model"]
            rows.append(
                {
                    "what": name,
                    "seq": T,
                    "saved_mib": saved / MiB,
                    "peak_mib": peak / MiB,
                    "saved_vs_dense": saved / ref[0],
                    "peak_vs_dense": peak / ref[1],
                }
            )
    print_table(
        rows,
        [
            ("what", "what", ""),
            ("seq", "seq", "d"),
            ("saved_mib", "saved MiB", ".1f"),
            ("saved_vs_dense", "vs dense", ".3f"),
            ("peak_mib", "peak MiB", ".1f"),
            ("peak_vs_dense", "vs dense", ".3f"),
        ],
    )
    mod_rows = [r for r in rows if r["what"].startswith("MoD layer")]
    worst = max(r["saved_vs_dense"] for r in mod_rows)
    met = worst <= TARGET
    verdict = "met" if met else "MISSED"
    print(
        f"target: MoD layer {args.capacity} activation memory <= {TARGET}x dense layer: worst {worst:.3f} -> {verdict}"
    )
    targets = {"mod_layer_saved_vs_dense": {"ratio": worst, "met": met}}
    payload = {"args": vars(args), "rows": rows, "targets": targets}
    path = write_json("memory", payload, args.label)
    print(f"wrote {path}")
    plot(rows, result_path("memory", args.label, ".png"))
    before = load_run("memory", args.compare)
    if before is not None:
        print_comparison(rows, before, ["what", "seq"], [("saved_mib", ".1f"), ("peak_mib", ".1f")])


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in zip(
        axes, ("saved_mib", "peak_mib"), ("saved for backward", "peak during the step"), strict=True
    ):
        for what in dict.fromkeys(r["what"] for r in rows):
            pts = [(r["seq"], r[key]) for r in rows if r["what"] == what]
            ax.plot(*zip(*pts, strict=True), marker="o", label=what)
        ax.set(xlabel="sequence length", ylabel="MiB", title=title, xscale="log", yscale="log")
        ax.set_xticks([r["seq"] for r in rows if r["what"] == rows[0]["what"]], minor=False)
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.get_xaxis().set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
