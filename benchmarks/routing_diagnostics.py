"""What a trained MoD router learned, beside random routing: which tokens it sends through its
blocks, how stable and how alike across layers its choices are, and the loss on routed and
skipped tokens.

    python -m benchmarks.routing_diagnostics \\
        --learned runs/ev/long/mod/seed1337/ckpt.pt --random runs/ev/long/mod_random/seed1337/ckpt.pt \\
        --dense runs/ev/dense/dense/ckpt.pt --history runs/ev/stability/mod/ckpt.pt --label c0125

Measured on the validation split of the models' corpus (``--batches`` windows of their
``seq_len``, consecutive, the same for every model), per routed layer, in top-k routing (as
trained):

- routed share by the token's frequency in the training split (rank groups of the
  vocabulary), by position in the sequence, and by the dense model's loss on that token
  (quintiles: does the router send the hard tokens?);
- layer agreement: the share of one routed layer's tokens that the next routed layer also takes;
- stability: the share of the final checkpoint's routed tokens that earlier checkpoints of
  the same run (``--history``: ``ckpt.pt`` and the ``ckpt.pt.step<N>`` files kept beside it)
  also route;
- score entropy over training (``score_entropy`` in each run's ``metrics.jsonl``);
- each model's own loss on the tokens a routed layer takes and on those it skips.

Random routing is the baseline of each number: its routed share is ``k / T`` in every group,
and two independent draws share ``k / T`` of their tokens (the expected overlap). In training
each ``RandomMoDBlock`` draws independently; in evaluation every one draws from a generator
seeded 0 at each forward (a fixed function of the input), so its routed layers take the same
tokens there and its measured layer agreement is 1 by construction: the independent baseline
is ``k / T``. (Evaluated with independent per-layer draws instead, the mod_random models of
the 2026-12-07 stdlib runs change validation loss by at most 0.0006 bits/byte.)
Writes results/routing-diagnostics[-label].json and .png.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.common import result_path, write_json
from mode.checkpoint import checkpoint_config, kept_checkpoints
from mode.data import load_splits
from mode.layers.mod import MoDBlock
from mode.model import MoDETransformer
from mode.routing.mod_topk import expert_choice_topk

RANK_GROUPS = ((0, 4), (4, 16), (16, 64), (64, 1 << 30))  # vocabulary ranks by training frequency
POSITION_BINS = 8
LOSS_BINS = 5


def routed_masks(model: MoDETransformer, x: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Per routed block (by name): the [B, T] bool mask of the tokens its top-k takes in this
    forward, and the model's logits [B, T, V] (top-k routing, evaluation mode)."""
    masks: dict[str, torch.Tensor] = {}
    hooks = []
    for name, block in model.named_modules():
        if isinstance(block, MoDBlock):

            def record(module, args, name=name):
                with torch.no_grad():
                    masks[name] = expert_choice_topk(module.router_logits(args[0]), module.capacity).mask

            hooks.append(block.register_forward_pre_hook(record))
    try:
        with torch.no_grad():
            logits, _ = model(x)
    finally:
        for h in hooks:
            h.remove()
    return masks, logits


def token_losses(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[B, T] cross-entropy (nats) of each position's next-token prediction."""
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none").view(y.shape)


def share_by_group(mask: np.ndarray, groups: np.ndarray, n_groups: int) -> list[float | None]:
    """Routed share of the tokens in each group (None for an empty group)."""
    out = []
    for g in range(n_groups):
        sel = groups == g
        out.append(float(mask[sel].mean()) if sel.any() else None)
    return out


def overlap(a: np.ndarray, b: np.ndarray) -> float:
    """The share of ``a``'s routed tokens that ``b`` routes too (equal counts: symmetric)."""
    return float((a & b).sum() / max(1, a.sum()))


def entropy_curve(run_dir: Path) -> dict[str, list]:
    """Per routed block: (step, score_entropy) from a run's metrics.jsonl."""
    curves: dict[str, list] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for key, value in record.items():
            if key.endswith("/score_entropy") and isinstance(value, int | float):
                curves.setdefault(key.split("/")[0], []).append((record["step"], value))
    return curves


def diagnose(model: MoDETransformer, batches, dense_losses, groups, positions) -> dict:
    """Every per-model number on the same validation windows."""
    per_layer: dict[str, dict] = {}
    all_masks: dict[str, list[np.ndarray]] = {}
    losses = []
    for x, y in batches:
        masks, logits = routed_masks(model, x)
        losses.append(token_losses(logits, y).numpy())
        for name, m in masks.items():
            all_masks.setdefault(name, []).append(m.numpy())
    loss = np.concatenate(losses)
    quintile = np.digitize(dense_losses, np.quantile(dense_losses, np.linspace(0, 1, LOSS_BINS + 1)[1:-1]))
    masks = {name: np.concatenate(ms) for name, ms in all_masks.items()}
    for name, mask in masks.items():
        per_layer[name] = {
            "routed_share": float(mask.mean()),
            "by_frequency": share_by_group(mask, groups, len(RANK_GROUPS)),
            "by_position": share_by_group(mask, positions, POSITION_BINS),
            "by_dense_loss": share_by_group(mask, quintile, LOSS_BINS),
            "dense_loss_routed": float(dense_losses[mask].mean()),
            "dense_loss_skipped": float(dense_losses[~mask].mean()),
            "loss_routed": float(loss[mask].mean()),
            "loss_skipped": float(loss[~mask].mean()),
        }
    names = list(masks)
    agreement = [overlap(masks[a], masks[b]) for a, b in itertools.pairwise(names)]
    return {"layers": per_layer, "layer_agreement": agreement, "loss": float(loss.mean()), "masks": masks}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--learned", type=Path, required=True, help="a mod checkpoint")
    p.add_argument("--random", type=Path, required=True, help="a mod_random checkpoint of the same shape")
    p.add_argument("--dense", type=Path, required=True, help="a dense checkpoint on the same corpus (token difficulty)")
    p.add_argument("--history", type=Path, default=None, help="a mod run's ckpt.pt kept with keep_checkpoints > 1")
    p.add_argument("--batches", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--label", default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    models = {k: MoDETransformer.from_checkpoint(getattr(args, k)) for k in ("learned", "random", "dense")}
    cfg = models["learned"].cfg
    data = checkpoint_config(args.learned).data
    train, val, _ = load_splits(data.source, cfg.seq_len, data.val_fraction, data.cache_dir)
    T, B = cfg.seq_len, args.batch_size
    n = min(args.batches * B, (len(val.tokens) - 1) // (T + 1))
    starts = torch.arange(n) * (T + 1)
    batches = [val.windows(starts[i : i + B]) for i in range(0, n, B)]
    x_all = torch.cat([x for x, _ in batches]).numpy()
    counts = np.bincount(np.asarray(train.tokens, dtype=np.int64), minlength=cfg.vocab_size)
    rank = np.empty(cfg.vocab_size, dtype=np.int64)
    rank[np.argsort(-counts, kind="stable")] = np.arange(cfg.vocab_size)
    groups = np.digitize(rank[x_all], [hi for _, hi in RANK_GROUPS[:-1]])
    positions = np.broadcast_to(np.arange(T) * POSITION_BINS // T, x_all.shape)
    dense = np.concatenate([token_losses(models["dense"](x)[0].detach(), y).numpy() for x, y in batches])
    results = {k: diagnose(models[k], batches, dense, groups, positions) for k in ("learned", "random")}
    capacity = cfg.mod.capacity
    payload = {
        "learned": str(args.learned),
        "random": str(args.random),
        "dense": str(args.dense),
        "corpus": data.source,
        "tokens": int(x_all.size),
        "capacity": capacity,
        "independent_random_overlap": capacity,  # two independent k-of-T draws share k/T of their tokens
        "dense_loss": float(dense.mean()),
        "rank_groups": RANK_GROUPS,
        "group_token_share": [float((groups == g).mean()) for g in range(len(RANK_GROUPS))],
        **{k: {kk: v for kk, v in r.items() if kk != "masks"} for k, r in results.items()},
        "entropy": {k: entropy_curve(getattr(args, k).parent) for k in ("learned", "random")},
    }
    if args.history is not None:
        stability = []
        steps = kept_checkpoints(args.history)
        _, last = steps[-1]
        final = diagnose(MoDETransformer.from_checkpoint(last), batches, dense, groups, positions)["masks"]
        for step, path in steps:
            masks = diagnose(MoDETransformer.from_checkpoint(path), batches, dense, groups, positions)["masks"]
            stability.append({"step": step, **{name: overlap(masks[name], final[name]) for name in final}})
        payload["stability"] = {"run": str(args.history), "overlap_with_final": stability}
    path = write_json("routing-diagnostics", payload, args.label)
    print(f"corpus {data.source}, {x_all.size} validation tokens, capacity {capacity}")
    for kind in ("learned", "random"):
        r = payload[kind]
        for name, layer in r["layers"].items():
            print(
                f"{kind:7s} {name}: routed by dense-loss quintile {[round(v, 3) for v in layer['by_dense_loss']]}; "
                f"dense loss routed {layer['dense_loss_routed']:.3f} / skipped {layer['dense_loss_skipped']:.3f}; "
                f"own loss routed {layer['loss_routed']:.3f} / skipped {layer['loss_skipped']:.3f}"
            )
        print(f"{kind:7s} layer agreement {[round(a, 3) for a in r['layer_agreement']]} (independent: {capacity})")
    if "stability" in payload:
        for row in payload["stability"]["overlap_with_final"]:
            print("stability", {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
    plot(payload, result_path("routing-diagnostics", args.label, ".png"))
    print(f"wrote {path}")


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    c = payload["capacity"]
    panels = [
        ("by_frequency", "token's frequency rank group", [f"{lo}-{min(hi, 255)}" for lo, hi in payload["rank_groups"]]),
        ("by_position", f"position (eighths of {POSITION_BINS} bins)", [str(i) for i in range(POSITION_BINS)]),
        ("by_dense_loss", "dense model's loss on the token (quintile)", [str(i + 1) for i in range(LOSS_BINS)]),
    ]
    for ax, (key, xlabel, ticks) in zip(axes[0], panels, strict=True):
        for kind, style in (("learned", "-o"), ("random", "--x")):
            for name, layer in payload[kind]["layers"].items():
                values = [np.nan if v is None else v for v in layer[key]]
                ax.plot(range(len(values)), values, style, label=f"{kind} {name}")
        ax.axhline(c, color="gray", lw=0.8)
        ax.set_xticks(range(len(ticks)), ticks)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("routed share")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    ax = axes[1][0]
    for kind in ("learned", "random"):
        for name, curve in payload["entropy"][kind].items():
            steps, values = zip(*curve, strict=True) if curve else ((), ())
            ax.plot(steps, values, label=f"{kind} {name}")
    ax.set_xlabel("training step")
    ax.set_ylabel("score entropy / log T")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax = axes[1][1]
    if "stability" in payload:
        rows = payload["stability"]["overlap_with_final"]
        for name in [k for k in rows[0] if k != "step"]:
            ax.plot([r["step"] for r in rows], [r[name] for r in rows], "-o", label=f"learned {name}")
        ax.axhline(c, color="gray", lw=0.8, label="independent random draws")
        ax.legend(fontsize=7)
    ax.set_xlabel("checkpoint step")
    ax.set_ylabel("share of the final routed tokens also routed")
    ax.grid(alpha=0.3)
    ax = axes[1][2]
    labels, routed, skipped = [], [], []
    for kind in ("learned", "random"):
        for name, layer in payload[kind]["layers"].items():
            labels.append(f"{kind}\n{name}")
            routed.append(layer["loss_routed"])
            skipped.append(layer["loss_skipped"])
    xs = np.arange(len(labels))
    ax.bar(xs - 0.2, routed, 0.4, label="routed tokens")
    ax.bar(xs + 0.2, skipped, 0.4, label="skipped tokens")
    ax.set_xticks(xs, labels, fontsize=7)
    ax.set_ylabel("the model's own loss (nats)")
    ax.legend(fontsize=7)
    fig.suptitle(f"What the MoD router learned vs random routing (capacity {c}, {payload['corpus']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
