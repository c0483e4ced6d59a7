"""Our Triton kernels (``mode.kernels``) against the torch paths they replace: time, GB/s, TFLOP/s.

    python -m benchmarks.bench_kernels --device cuda --dtype bfloat16 --label h200   # the issue's sizes
    python -m benchmarks.bench_kernels --device cpu --small                          # torch paths only

- MoD (batch 8, T 4096, d 2048, capacity 0.125 by default): the chosen-row gather, and the
  gated scatter ``x + g * y`` forward + backward (gradients of g and y). GB/s counts the bytes
  each op must move (gather: read + write n rows; gated scatter: the out-of-place copy of x,
  read x/y rows and write them, then the backward's read of grad and y rows and write of
  grad_y), and is reported as a share of the device's copy bandwidth measured in the same run
  (a ``clone`` of 1 GiB on CUDA).
- Scattered expert GEMMs (32768 tokens, 8 experts, top-2, d 2048, f 1408 by default): the
  whole expert MLP, forward and forward + backward; torch path = ``permute`` (gather) ->
  ``torch._grouped_mm`` -> GELU -> ``torch._grouped_mm`` -> ``combine`` (weighted gather-sum);
  triton path = ``scattered_gemm`` (gather fused) -> GELU -> ``gemm_combine`` (combine fused).
  Targets on an H200 in bf16: gather/scatter >= 60% of the bandwidth; triton >= torch.

On a CPU the Triton kernels cannot be timed (Triton compiles for GPUs only): the script times
the torch paths and, with ``--interpret-smoke``, runs each Triton kernel once at a tiny size
under Triton's interpreter against the torch path (a correctness smoke test, not a timing).
"""

from __future__ import annotations

import argparse
import os
import sys

# NOTE: the interpreter must be chosen before any kernel module is imported.
if "--interpret-smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import torch.nn.functional as F

from benchmarks.common import interleaved_median_times, print_table, write_json
from mode.experts.grouped_gemm import get_backend
from mode.experts.permute import combine, permute, sort_by_expert
from mode.kernels import triton_unavailable_reason
from mode.layers.mod_moves import add_gated_tokens, take_tokens, token_rows
from mode.routing.mod_topk import capacity_to_k

NOMINAL_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}  # bytes/s, vendor figures


def copy_bandwidth(device: str, sync) -> float | None:
    """Bytes/s of a 1 GiB device-to-device ``clone`` (read + write), the best of 5; None on CPU."""
    if not device.startswith("cuda"):
        return None
    x = torch.empty(2**28, dtype=torch.float32, device=device)
    times = interleaved_median_times({"copy": lambda: x.clone()}, warmup=2, repeats=5, sync=sync)
    return 2 * x.numel() * x.element_size() / times["copy"]


def mod_inputs(B: int, T: int, D: int, capacity: float, dtype: torch.dtype, device: str) -> dict:
    """The chosen rows of a MoD block: x [B, T, D] (fp32 residual), k = capacity * T per row,
    update [B * k, D] and gate [B * k] in ``dtype`` (the block's compute dtype)."""
    k = capacity_to_k(capacity, T)
    indices = torch.rand(B, T, device=device).topk(k, dim=1).indices.sort(dim=1).values
    return {
        "x": torch.randn(B, T, D, device=device),
        "indices": indices,
        "rows": token_rows(indices, T),
        "update": torch.randn(B * k, D, device=device, dtype=dtype, requires_grad=True),
        "gate": torch.rand(B * k, device=device, requires_grad=True),
        "k": k,
    }


def mod_candidates(inp: dict, use_triton: bool) -> dict[str, callable]:
    x, indices, rows, update, gate = (inp[n] for n in ("x", "indices", "rows", "update", "gate"))
    B, k, D = x.shape[0], inp["k"], x.shape[-1]
    grad = torch.randn_like(x)

    def torch_scatter():
        gate.grad = update.grad = None
        add_gated_tokens(x, indices, gate.view(B, k), update.view(B, k, D), rows).backward(grad)

    fns = {
        "mod gather | torch": lambda: take_tokens(x, indices, rows)[0],
        "mod gated scatter fwd+bwd | torch": torch_scatter,
    }
    if use_triton:
        from mode.kernels import mod_tokens  # noqa: PLC0415

        def triton_scatter():
            gate.grad = update.grad = None
            add_gated_tokens(x, indices, gate.view(B, k), update.view(B, k, D), rows, mod_tokens).backward(grad)

        fns["mod gather | triton"] = lambda: take_tokens(x, indices, rows, mod_tokens)[0]
        fns["mod gated scatter fwd+bwd | triton"] = triton_scatter
    return fns


def mod_bytes(inp: dict) -> dict[str, int]:
    x, update = inp["x"], inp["update"]
    n, D = update.shape
    xs, us = x.element_size(), update.element_size()
    gather = 2 * n * D * xs
    # forward: copy x (read + write), read n rows of x and y, write n rows; backward: read n
    # rows of grad and of y, write grad_y (the residual's gradient is passed through, no copy).
    scatter = 2 * x.numel() * xs + n * D * (2 * xs + us) + n * D * (xs + 2 * us)
    return {"mod gather": gather, "mod gated scatter fwd+bwd": scatter}


def moe_inputs(N: int, E: int, K: int, D: int, F_: int, dtype: torch.dtype, device: str) -> dict:
    logits = torch.randn(N, E, device=device)
    weights, experts = torch.softmax(logits, -1).topk(K, dim=-1)
    dispatch = sort_by_expert(experts, E)
    return {
        "x": torch.randn(N, D, device=device, dtype=dtype, requires_grad=True),
        "w1": (torch.randn(E, D, F_, device=device, dtype=dtype) / D**0.5).requires_grad_(),
        "w2": (torch.randn(E, F_, D, device=device, dtype=dtype) / F_**0.5).requires_grad_(),
        "weights": weights.to(dtype).requires_grad_(),
        "dispatch": dispatch,
    }


def moe_candidates(inp: dict, use_triton: bool) -> dict[str, callable]:
    x, w1, w2, weights, d = (inp[n] for n in ("x", "w1", "w2", "weights", "dispatch"))
    N, D = x.shape
    K = weights.shape[1]
    gmm = get_backend("torch", x.device, x.dtype, D, w1.shape[-1])
    leaves = (x, w1, w2, weights)

    def torch_path():
        return combine(gmm(F.gelu(gmm(permute(x, d), w1, d.counts)), w2, d.counts), d, weights)

    def backward(fn):
        def step():
            for t in leaves:
                t.grad = None
            out = fn()
            out.backward(torch.ones_like(out))

        return step

    fns = {"experts fwd | torch": torch_path, "experts fwd+bwd | torch": backward(torch_path)}
    if use_triton:
        from mode.experts.scattered import gemm_combine, scattered_gemm  # noqa: PLC0415

        w_sorted = weights.reshape(-1)

        def triton_path():
            ws = w_sorted.index_select(0, d.order)
            h = scattered_gemm(x, w1, d.token_idx, d.order, d.counts, K)
            return gemm_combine(F.gelu(h), w2, ws, d.token_idx, d.order, d.counts, K, N)

        fns["experts fwd | triton"] = triton_path
        fns["experts fwd+bwd | triton"] = backward(triton_path)
    return fns


def smoke_test() -> list[str]:
    """Each Triton kernel once at a tiny size under the interpreter, against the torch path."""
    from mode.experts.scattered import gemm_combine, scattered_gemm  # noqa: PLC0415
    from mode.kernels import mod_tokens  # noqa: PLC0415

    lines = []
    inp = mod_inputs(2, 16, 40, 0.25, torch.float32, "cpu")
    ref_sel = take_tokens(inp["x"], inp["indices"], inp["rows"])[0]
    ok = torch.equal(ref_sel, take_tokens(inp["x"], inp["indices"], inp["rows"], mod_tokens)[0])
    lines.append(f"mod gather: {'equal' if ok else 'DIFFERENT'}")
    B, k, D = 2, inp["k"], 40
    a = add_gated_tokens(inp["x"], inp["indices"], inp["gate"].view(B, k), inp["update"].view(B, k, D), inp["rows"])
    gate, update = inp["gate"].view(B, k), inp["update"].view(B, k, D)
    b = add_gated_tokens(inp["x"], inp["indices"], gate, update, inp["rows"], mod_tokens)
    lines.append(f"mod gated scatter: max |diff| {(a - b).abs().max().item():.2e}")
    m = moe_inputs(24, 4, 2, 32, 48, torch.float32, "cpu")
    d = m["dispatch"]
    ref = moe_candidates(m, False)["experts fwd | torch"]()
    h = scattered_gemm(m["x"], m["w1"], d.token_idx, d.order, d.counts, 2)
    ws = m["weights"].reshape(-1).index_select(0, d.order)
    out = gemm_combine(F.gelu(h), m["w2"], ws, d.token_idx, d.order, d.counts, 2, 24)
    lines.append(f"scattered expert GEMMs: max |diff| {(out - ref).abs().max().item():.2e}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--small", action="store_true", help="CPU-sized problems (a try-out, not the issue's sizes)")
    p.add_argument("--interpret-smoke", action="store_true", help="CPU: run each kernel once in the interpreter")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--label", default=None)
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.small:
        mod_shape, moe_shape = (2, 1024, 512, 0.125), (2048, 8, 2, 256, 352)
    else:
        mod_shape, moe_shape = (8, 4096, 2048, 0.125), (32768, 8, 2, 2048, 1408)
    reason = triton_unavailable_reason(args.device) if args.device.startswith("cuda") else "not timed on a CPU"
    use_triton = reason is None
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else None
    bandwidth = copy_bandwidth(args.device, sync)
    gpu_name = torch.cuda.get_device_name() if sync else ""
    nominal = next((v for k, v in NOMINAL_BANDWIDTH.items() if k in gpu_name), None)

    mod_inp = mod_inputs(*mod_shape, dtype, args.device)
    moe_inp = moe_inputs(*moe_shape, dtype, args.device)
    fns = {**mod_candidates(mod_inp, use_triton), **moe_candidates(moe_inp, use_triton)}
    times = interleaved_median_times(fns, warmup=args.warmup, repeats=args.repeats, sync=sync)

    bytes_moved = mod_bytes(mod_inp)
    N, E, K, D, F_ = moe_shape
    M = N * K
    flops = {"experts fwd": 2 * 2 * M * D * F_, "experts fwd+bwd": 3 * 2 * 2 * M * D * F_}
    rows = []
    for name, seconds in times.items():
        op, path = name.split(" | ")
        row = {"op": op, "path": path, "ms": seconds * 1e3}
        if op in bytes_moved:
            row["GB/s"] = bytes_moved[op] / seconds / 1e9
            if bandwidth:
                row["of copy bw"] = bytes_moved[op] / seconds / bandwidth
        if op in flops:
            row["TFLOP/s"] = flops[op] / seconds / 1e12
        torch_s = times.get(f"{op} | torch")
        row["torch / this"] = torch_s / seconds if torch_s else None
        rows.append(row)
    print(
        f"device={args.device} dtype={args.dtype} MoD B,T,D,capacity={mod_shape} "
        f"experts N,E,K,D,F={moe_shape}; triton: {'timed' if use_triton else reason}"
    )
    if bandwidth:
        print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s" + (f" (nominal {nominal / 1e9:.0f})" if nominal else ""))
    print_table(
        rows,
        [
            ("op", "op", "s"),
            ("path", "path", "s"),
            ("ms", "ms", ".3f"),
            ("GB/s", "GB/s", ".1f"),
            ("of copy bw", "of copy bw", ".2f"),
            ("TFLOP/s", "TFLOP/s", ".2f"),
            ("torch / this", "torch/this", ".2f"),
        ],
    )
    smoke = smoke_test() if args.interpret_smoke else None
    for line in smoke or []:
        print("interpreter smoke test:", line)
    targets = {}
    if use_triton:
        for op in bytes_moved:
            share = bytes_moved[op] / times[f"{op} | triton"] / bandwidth
            targets[f"{op} (triton) >= 60% of copy bandwidth"] = {"share": share, "met": share >= 0.6}
        for op in flops:
            ratio = times[f"{op} | torch"] / times[f"{op} | triton"]
            targets[f"{op}: triton >= torch grouped_mm path"] = {"speedup": ratio, "met": ratio >= 1.0}
    for name, t in targets.items():
        print(f"target {name}: {'met' if t['met'] else 'MISSED'} ({next(iter(t.values())):.2f})")
    path = write_json(
        "kernels",
        {
            "args": vars(args),
            "mod_shape": mod_shape,
            "moe_shape": moe_shape,
            "triton": "timed" if use_triton else reason,
            "copy_bandwidth": bandwidth,
            "nominal_bandwidth": nominal,
            "rows": rows,
            "targets": targets,
            "interpreter_smoke": smoke,
        },
        args.label,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
