"""Causal sampling: decision accuracy, causal vs top-k loss, decode speed, KV-cache size, and
how routing errors compound with depth and position.

    python -m benchmarks.bench_sampling                   # trains mod (predictor) and mod (router_bce)
    python -m benchmarks.bench_sampling --seconds 300     # longer training per variant
    python -m benchmarks.bench_sampling --checkpoint runs/compare/mod/ckpt.pt   # reuse compare.py's model

(1) per-layer decision accuracy / recall against the top-k labels (predictor and router BCE);
(2) validation loss in top-k vs causal mode; (3) decode tokens/s with the KV cache, MoD vs a
dense model of the same d_model and depth, batch 1 and 8, 512 new tokens; (4) KV-cache bytes
after 1024 tokens; (5) causal-vs-top-k loss gap and decision disagreement by layer and by
position, up to 4x the training length (plot: results/sampling.png).
Targets: predictor accuracy >= 97%; causal loss within 2% of top-k; MoD decode >= 1.4x dense
at batch 1; MoD KV bytes (every other block at 12.5%) <= 0.6x dense.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import (
    RESULTS_DIR,
    add_compare_option,
    load_run,
    print_comparison,
    print_table,
    result_path,
    write_json,
)
from mode.checkpoint import checkpoint_config, load_checkpoint
from mode.config import load_config
from mode.data import load_splits
from mode.layers.mod import MoDBlock
from mode.model import MoDETransformer
from mode.routing.mod_topk import expert_choice_topk
from mode.train import evaluate, train


def trained_mod(method: str, seconds: float, checkpoint: str | None, overrides: list[str]) -> MoDETransformer:
    if checkpoint and method == "predictor":
        model = MoDETransformer(checkpoint_config(Path(checkpoint)).model)
        if not any(isinstance(b, MoDBlock) and b.predictor is not None for b in model.blocks):
            raise SystemExit(f"--checkpoint {checkpoint}: no MoD block with causal='predictor' in this model")
        load_checkpoint(Path(checkpoint), model)
        return model.eval()
    cfg = load_config(
        "mod",
        [
            f"model.mod.causal={method}",
            f"train.max_seconds={seconds}",
            f"train.out_dir=runs/sampling/{method}",
            "train.overwrite=true",
            "train.progress=false",
            *overrides,
        ],
    )
    model, _ = train(cfg)
    return model.eval()


def decision_table(model: MoDETransformer, val, batch: int, n_batches: int, method: str) -> tuple[list, dict]:
    topk_loss, metrics = evaluate(model, val, batch, n_batches, routing="topk")
    causal_loss, causal_metrics = evaluate(model, val, batch, n_batches, routing="causal")
    rows = []
    for i, block in enumerate(model.blocks):
        if isinstance(block, MoDBlock):
            rows.append(
                {
                    "method": method,
                    "layer": i,
                    "accuracy": metrics[f"blocks.{i}/decision_accuracy"],
                    "recall": metrics[f"blocks.{i}/decision_recall"],
                    "causal_share": causal_metrics[f"blocks.{i}/causal_share"],
                }
            )
    losses = {
        "method": method,
        "topk_loss": topk_loss,
        "causal_loss": causal_loss,
        "rel_gap": (causal_loss - topk_loss) / topk_loss,
    }
    return rows, losses


@torch.no_grad()
def decode_speed(model: MoDETransformer, batch: int, new_tokens: int, repeats: int) -> float:
    """Tokens per second of KV-cache generation (median of repeats, after a warm-up)."""
    prompt = torch.randint(0, 256, (batch, 16), generator=torch.Generator().manual_seed(0))
    model.generate(prompt, 8, temperature=0, use_cache=True)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model.generate(prompt, new_tokens, temperature=0, use_cache=True)
        times.append(time.perf_counter() - t0)
    return batch * new_tokens / sorted(times)[len(times) // 2]


@torch.no_grad()
def cache_bytes(model: MoDETransformer, tokens: torch.Tensor) -> tuple[int, int]:
    caches = model.new_caches(tokens.shape[0])
    model(tokens, routing="causal", caches=caches)
    return sum(c.nbytes_used() for c in caches), sum(c.entries() for c in caches)


@torch.no_grad()
def compounding(model: MoDETransformer, val, seq_len: int, n_seqs: int, buckets: int) -> dict:
    """Per position bucket: causal - top-k loss, and per MoD layer the share of tokens whose
    causal decision disagrees with top-k on the causal trunk's own hidden states."""
    gen = torch.Generator().manual_seed(0)
    x, y = val.batch(n_seqs, gen)
    inputs: dict[int, torch.Tensor] = {}
    hooks = [
        b.register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, a[0]))
        for i, b in enumerate(model.blocks)
        if isinstance(b, MoDBlock)
    ]
    logits_c, _ = model(x, routing="causal")
    for h in hooks:
        h.remove()
    logits_t, _ = model(x, routing="topk")
    ce = lambda lg: F.cross_entropy(lg.float().transpose(1, 2), y, reduction="none")  # noqa: E731  [B, T]
    gap = (ce(logits_c) - ce(logits_t)).mean(0)  # [T]
    edges = torch.linspace(0, seq_len, buckets + 1).long()
    out = {"positions": [int(e) for e in edges[1:]], "loss_gap": [], "disagreement": {}}
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        out["loss_gap"].append(float(gap[lo:hi].mean()))
    for i, h in inputs.items():
        block = model.blocks[i]
        chosen = expert_choice_topk(block.router_logits(h), block.capacity).mask
        routed = block.decision_logits(h) > 0
        dis = (routed != chosen).float().mean(0)  # [T]
        out["disagreement"][f"layer {i}"] = [
            float(dis[lo:hi].mean()) for lo, hi in zip(edges[:-1], edges[1:], strict=True)
        ]
    return out


def plot(comp: dict[str, dict], train_len: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_l, ax_d) = plt.subplots(1, 2, figsize=(12, 4.5))
    for method, c in comp.items():
        ax_l.plot(c["positions"], c["loss_gap"], marker="o", label=method)
        for layer, values in c["disagreement"].items():
            ax_d.plot(c["positions"], values, marker=".", label=f"{method} {layer}")
    for ax in (ax_l, ax_d):
        ax.axvline(train_len, color="gray", ls="--", lw=1)
        ax.set_xlabel("position (end of bucket); dashed: training length")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax_l.set_ylabel("causal - top-k loss (nats/byte)")
    ax_d.set_ylabel("decision disagreement with top-k")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=180.0, help="training budget per causal method")
    p.add_argument(
        "--checkpoint",
        default=None,
        help="a trained MoD model with model.mod.causal=predictor to reuse (ckpt.pt, or an expert-parallel ckpt/ dir)",
    )
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--label", default=None)
    p.add_argument("overrides", nargs="*", help="dotlist overrides for the trained models")
    add_compare_option(p)
    args = p.parse_args()
    before = load_run("sampling", args.compare)
    torch.manual_seed(0)
    models = {m: trained_mod(m, args.seconds, args.checkpoint, args.overrides) for m in ("predictor", "router_bce")}
    cfg = models["predictor"].cfg
    T = cfg.seq_len
    _, val, _ = load_splits("shakespeare", T, 0.05)
    _, val_long, _ = load_splits("shakespeare", 4 * T, 0.05)
    decisions, losses, comp = [], [], {}
    for method, model in models.items():
        rows, loss = decision_table(model, val, 8, args.eval_batches, method)
        decisions += rows
        losses.append(loss)
        comp[method] = compounding(model, val_long, 4 * T, 8, 8)
    # Decode speed and cache size: the trained MoD (predictor) vs a dense model of the same shape.
    dense = MoDETransformer(
        load_config(
            "dense", [f"model.{k}={getattr(cfg, k)}" for k in ("d_model", "n_layers", "n_heads", "seq_len")]
        ).model
    ).eval()
    mod = models["predictor"]
    speed = []
    for batch in (1, 8):
        d_tps = decode_speed(dense, batch, args.new_tokens, args.repeats)
        m_tps = decode_speed(mod, batch, args.new_tokens, args.repeats)
        speed.append({"batch": batch, "dense_tok_s": d_tps, "mod_tok_s": m_tps, "speedup": m_tps / d_tps})
    tokens = val_long.batch(1, torch.Generator().manual_seed(1))[0][:, :1024]
    dense_bytes, dense_entries = cache_bytes(dense, tokens)
    mod_bytes, mod_entries = cache_bytes(mod, tokens)
    kv = {
        "tokens": tokens.shape[1],
        "dense_bytes": dense_bytes,
        "mod_bytes": mod_bytes,
        "ratio": mod_bytes / dense_bytes,
        "dense_entries": dense_entries,
        "mod_entries": mod_entries,
    }

    print("(1) decision agreement with top-k on validation text (top-k mode trunk)")
    print_table(
        decisions,
        [
            ("method", "method", ""),
            ("layer", "layer", "d"),
            ("accuracy", "accuracy", ".4f"),
            ("recall", "recall", ".4f"),
            ("causal_share", "causal share", ".4f"),
        ],
    )
    print("\n(2) validation loss (nats/byte)")
    print_table(
        losses,
        [
            ("method", "method", ""),
            ("topk_loss", "top-k", ".4f"),
            ("causal_loss", "causal", ".4f"),
            ("rel_gap", "rel. gap", "+.4f"),
        ],
    )
    print(f"\n(3) decode throughput, {args.new_tokens} new tokens, KV cache")
    print_table(
        speed,
        [
            ("batch", "batch", "d"),
            ("dense_tok_s", "dense tok/s", ".1f"),
            ("mod_tok_s", "MoD tok/s", ".1f"),
            ("speedup", "MoD/dense", ".2f"),
        ],
    )
    print(
        f"\n(4) KV cache after {kv['tokens']} tokens: dense {kv['dense_bytes'] / 2**20:.2f} MiB "
        f"({kv['dense_entries']} entries), MoD {kv['mod_bytes'] / 2**20:.2f} MiB ({kv['mod_entries']} entries), "
        f"ratio {kv['ratio']:.3f}"
    )
    print("\n(5) causal - top-k loss by position (nats/byte), training length", T)
    for method, c in comp.items():
        print(f"  {method:10s}", " ".join(f"{p}:{g:+.3f}" for p, g in zip(c["positions"], c["loss_gap"], strict=True)))
    min_acc = {m: min(r["accuracy"] for r in decisions if r["method"] == m) for m in models}
    targets = {
        "predictor accuracy >= 0.97 (every layer)": (min_acc["predictor"], min_acc["predictor"] >= 0.97),
        "causal loss within 2% of top-k (predictor)": (losses[0]["rel_gap"], abs(losses[0]["rel_gap"]) <= 0.02),
        "MoD decode >= 1.4x dense at batch 1": (speed[0]["speedup"], speed[0]["speedup"] >= 1.4),
        "MoD KV bytes <= 0.6x dense": (kv["ratio"], kv["ratio"] <= 0.6),
    }
    for name, (value, ok) in targets.items():
        print(f"target {name}: {value:.4f} -> {'met' if ok else 'MISSED'}")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    png = result_path("sampling", args.label, ".png")
    plot(comp, T, png)
    path = write_json(
        "sampling",
        {
            "args": vars(args),
            "decisions": decisions,
            "losses": losses,
            "decode": speed,
            "kv_cache": kv,
            "compounding": comp,
            "targets": {k: {"value": v, "met": ok} for k, (v, ok) in targets.items()},
            "bits_per_nat": 1 / math.log(2),
        },
        args.label,
    )
    print(f"wrote {path} and {png}")
    if before is not None:  # compare the headline numbers (the targets' values)
        now = [{"target": k, "value": v} for k, (v, _) in targets.items()]
        was = [{"target": k, "value": t["value"]} for k, t in before.get("targets", {}).items()]
        print_comparison(now, before | {"rows": was}, ["target"], [("value", ".4f")])


if __name__ == "__main__":
    main()
