"""MoE MLP layer: dropless (each backend) vs capacity MoE vs a dense MLP of equal active FLOPs.

    python -m benchmarks.bench_moe                       # d 512, ffn 1024/expert, E 8, top-2, 8192 tokens
    python -m benchmarks.bench_moe --dtypes bfloat16 --device cuda --label h200

Forward+backward time, median of repeats after warm-up, all candidates timed round-robin;
every ratio is to the dense MLP (hidden top_k * ffn) of the same dtype. Cases: "balanced"
(a random router) and "skewed" (half the tokens strongly prefer expert 0).
"dropless[torch, index moves]" moves token rows with ``index_select`` and a batched
combine instead of the fused ``embedding_bag`` gather-sums (``model.moe.token_moves``).
The "experts only" row is the grouped path's floor: its grouped GEMMs + GELU on tokens
already sorted by expert (no router, no permutation, no combination); the "padded GEMMs+GELU
only" row is the capacity layer's (cf 1.25): its batched GEMMs + GELU on the [E, C, D] buffer,
the one cost the capacity rule must pay, so the capacity row's distance to it is what its
routing, dispatch and combine add (the baseline is not handicapped if that is small). The ``chunked``
backend (auto on CPU) can beat that floor, because it never builds the [M, D] sorted buffers
at all; dropless(auto) / floor - 1 is printed either way.
Targets (balanced): dropless(auto) <= 0.85x capacity MoE at cf 1.25, and <= 1.10x dense.
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
from mode.experts.grouped_gemm import GEMM_BACKENDS, resolve_name, unavailable_reason
from mode.experts.moe import CapacityMoE, DroplessMoE
from mode.experts.permute import sort_by_expert
from mode.layers.mlp import MLP

DENSE = "dense MLP (same active FLOPs)"
FLOOR = "experts only (GEMMs+GELU)"
PADDED_FLOOR = "capacity cf=1.25: padded GEMMs+GELU only"


class ExpertsOnly(torch.nn.Module):
    """The floor of a dropless layer: its grouped GEMMs + GELU on tokens already sorted by
    expert (no router, no permutation, no combination)."""

    def __init__(self, layer: DroplessMoE, x: torch.Tensor) -> None:
        super().__init__()
        with torch.no_grad():
            choice, _ = layer.route(x.reshape(-1, x.shape[-1]), tuple(x.shape))
        self.dispatch = sort_by_expert(choice.experts, layer.n_experts)
        self.experts = layer.experts

    def forward(self, x_sorted: torch.Tensor) -> torch.Tensor:
        return self.experts(x_sorted, self.dispatch.counts)


class PaddedExpertsOnly(torch.nn.Module):
    """The floor of a capacity layer: its batched GEMMs + GELU on the zero-padded [E, C, D]
    buffer (no router, no slot assignment, no dispatch into the buffer, no combine)."""

    def __init__(self, layer: CapacityMoE) -> None:
        super().__init__()
        self.experts = layer.experts

    def forward(self, buffer: torch.Tensor) -> torch.Tensor:
        return self.experts.forward_padded(buffer)


def make_input(n: int, d: int, router_w: torch.Tensor, case: str, dtype, device) -> torch.Tensor:
    x = torch.randn(n, d, device=device)
    if case == "skewed":  # push half the tokens toward expert 0
        direction = router_w[0].float().to(device) / router_w[0].float().norm()
        x[: n // 2] += 4.0 * direction
    return x.to(dtype).requires_grad_(True)


def build_layers(args, dtype, base: DroplessMoE) -> dict[str, torch.nn.Module]:
    d, f, E, K = args.d_model, args.d_ff, args.experts, args.top_k
    layers: dict[str, torch.nn.Module] = {DENSE: MLP(d, K * f)}
    for name in ["auto", *(b.name for b in GEMM_BACKENDS if b.gemm is not None)]:
        if name != "auto" and unavailable_reason(name, torch.device(args.device), dtype, d, f):
            continue
        shown = resolve_name(name, args.device, dtype, d, f, rows=args.tokens * K) if name == "auto" else None
        layers[f"dropless[auto={shown}]" if shown else f"dropless[{name}]"] = DroplessMoE(d, f, E, K, backend=name)
    if not unavailable_reason("torch", torch.device(args.device), dtype, d, f):
        # The other token moves (index_select + batched combine) on the grouped GEMM path.
        layers["dropless[torch, index moves]"] = DroplessMoE(d, f, E, K, backend="torch", token_moves="index")
    for cf in (1.0, 1.25, 2.0):
        layers[f"capacity cf={cf}"] = CapacityMoE(d, f, E, K, capacity_factor=cf)
    for layer in layers.values():
        if isinstance(layer, DroplessMoE | CapacityMoE):
            layer.load_state_dict(base.state_dict())
        layer.to(args.device, dtype)
    return layers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--d-ff", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--label", default=None)
    add_compare_option(p)
    args = p.parse_args()
    before = load_run("moe", args.compare)
    torch.manual_seed(0)
    rows, targets, overheads = [], {}, {}
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        base = DroplessMoE(args.d_model, args.d_ff, args.experts, args.top_k)
        layers = build_layers(args, dtype, base)
        grad = torch.randn(args.tokens, args.d_model, device=args.device, dtype=dtype)
        for case in ("balanced", "skewed"):
            x = make_input(args.tokens, args.d_model, base.router.weight.detach(), case, dtype, args.device)
            fns = {name: partial(fwd_bwd_step, layer, x, grad) for name, layer in layers.items()}
            auto_layer = next(v for k, v in layers.items() if k.startswith("dropless[auto"))
            floor = ExpertsOnly(auto_layer, x.detach())
            x_sorted = x.detach()[floor.dispatch.token_idx].requires_grad_(True)
            fns[FLOOR] = partial(fwd_bwd_step, floor, x_sorted, torch.randn_like(x_sorted))
            capacity_layer = layers["capacity cf=1.25"]
            C = capacity_layer.capacity(args.tokens)
            buffer = torch.randn(args.experts, C, args.d_model, device=args.device, dtype=dtype, requires_grad=True)
            padded = PaddedExpertsOnly(capacity_layer)
            fns[PADDED_FLOOR] = partial(fwd_bwd_step, padded, buffer, torch.randn_like(buffer))
            sync = torch.cuda.synchronize if args.device.startswith("cuda") else None
            times = interleaved_median_times(fns, args.warmup, args.repeats, sync=sync)
            for name, s in times.items():
                m = getattr(layers[name], "metrics", {}) if name in layers else {}
                rows.append(
                    {
                        "dtype": dtype_name,
                        "case": case,
                        "layer": name,
                        "ms": 1000 * s,
                        "vs_dense": s / times[DENSE],
                        "drop": float(m.get("drop_fraction", 0.0)) if m else None,
                        "max_load": float(m["load"].max()) if m else None,
                    }
                )
            if case == "balanced":
                auto = next(v for k, v in times.items() if k.startswith("dropless[auto"))
                for key, ratio, limit in (
                    ("capacity cf=1.25", auto / times["capacity cf=1.25"], 0.85),
                    ("dense", auto / times[DENSE], 1.10),
                ):
                    targets[f"{dtype_name}: dropless(auto) <= {limit}x {key}"] = {"ratio": ratio, "met": ratio <= limit}
                floor_s = times[FLOOR]
                overheads[dtype_name] = {
                    "floor_vs_dense": floor_s / times[DENSE],
                    "over_floor": auto / floor_s - 1,
                    "capacity_over_padded_floor": times["capacity cf=1.25"] / times[PADDED_FLOOR] - 1,
                    "padded_floor_vs_dense": times[PADDED_FLOOR] / times[DENSE],
                }
    print(
        f"fwd+bwd, d={args.d_model}, ffn={args.d_ff}/expert, E={args.experts}, top-{args.top_k}, "
        f"tokens={args.tokens}, device={args.device}, threads={torch.get_num_threads()}"
    )
    print_table(
        rows,
        [
            ("dtype", "dtype", ""),
            ("case", "case", ""),
            ("layer", "layer", ""),
            ("ms", "ms", ".1f"),
            ("vs_dense", "vs dense", ".3f"),
            ("drop", "dropped", ".3f"),
            ("max_load", "max load", ".3f"),
        ],
    )
    for k, t in targets.items():
        print(f"target {k}: {t['ratio']:.3f} -> {'met' if t['met'] else 'MISSED'}")
    for k, o in overheads.items():
        print(
            f"{k}: grouped GEMMs+GELU alone on pre-sorted tokens {o['floor_vs_dense']:.3f}x dense; "
            f"dropless(auto), routing included, {100 * o['over_floor']:+.1f}% relative to them; "
            f"capacity cf=1.25 {100 * o['capacity_over_padded_floor']:+.1f}% relative to its padded GEMMs+GELU "
            f"({o['padded_floor_vs_dense']:.3f}x dense)"
        )
    payload = {"args": vars(args), "rows": rows, "targets": targets, "overheads": overheads}
    path = write_json("moe", payload, args.label)
    print(f"wrote {path}")
    if before is not None:
        print_comparison(rows, before, ["dtype", "case", "layer"], [("ms", ".1f"), ("vs_dense", ".3f")])


if __name__ == "__main__":
    main()
