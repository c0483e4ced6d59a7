"""A task where routing must matter: does the learned MoD router find the tokens that carry the
information, where random routing cannot?

    python -m benchmarks.routing_task                   # 3 seeds, 1500 steps each, ~10 minutes
    python -m benchmarks.routing_task --steps 300 --seeds 2 --label quick

The stream (ids, vocabulary 96): filler tokens drawn uniformly from 64 ids (unpredictable), and
every cycle a payload token p (one of 16 ids), 6-20 fillers, a marker M (one id), p again, 6-20
fillers. The token after M is the payload before it: predicting it needs the marker to attend
to the payload. The model is ONE block (``model.n_layers=1``): a dense block (the reference), a
MoD block (learned router, ``mod``) or a random-routing MoD block (``mod_random``) at capacity
``--capacity`` (0.25: 16 of 64 tokens, room for every payload and marker of a window: ~6.6 on
average). A token the block skips gets only its embedding (a bigram prediction), so the answer
after M is right only when the block computes M's position with the payload among its tokens:
a learned router can pick the payload and marker ids (it sees each token's embedding); a random
one has both at ``capacity ** 2``.

Per model: the accuracy of the answer after each marker (top-k routing, the training one, over
held-out sequences), the cross-entropy there, and the share of payload, marker and filler
tokens the block routed. Verdicts on the paired per-seed differences (``benchmarks/stats.py``).
Writes ``results/routing-task[-label].json``.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.common import print_table, write_json
from benchmarks.stats import paired_interval, verdict
from mode.config import load_config
from mode.train import train

FILLER, PAYLOAD = range(0, 64), range(64, 80)
MARKER = 80
VOCAB = 96  # ids 81-95 unused (a multiple of 32)
SEQ = 64
KINDS = {"dense": "dense", "mod": "mod", "mod_random": "mod_random"}


def make_stream(n_tokens: int, seed: int) -> np.ndarray:
    """The task's token stream (see the module docstring): ``n_tokens`` ids, uint16."""
    rng = np.random.default_rng(seed)
    out: list[int] = []
    while len(out) < n_tokens:
        p = int(rng.integers(PAYLOAD.start, PAYLOAD.stop))
        out.append(p)
        out.extend(rng.integers(FILLER.start, FILLER.stop, int(rng.integers(6, 21))).tolist())
        out.extend([MARKER, p])
        out.extend(rng.integers(FILLER.start, FILLER.stop, int(rng.integers(6, 21))).tolist())
    return np.asarray(out[:n_tokens], dtype=np.uint16)


def answers(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [B, T] ids -> (mask [B, T]: a marker whose payload lies before it in the window and
    whose answer is inside it, expected [B, T]: the payload there). The reference, by loops."""
    mask = torch.zeros_like(x, dtype=torch.bool)
    want = torch.zeros_like(x)
    for b in range(x.shape[0]):
        last = None
        for t in range(x.shape[1] - 1):
            tok = int(x[b, t])
            if tok in PAYLOAD:
                last = tok
            elif tok == MARKER and last is not None:
                mask[b, t], want[b, t] = True, last
    return mask, want


@torch.no_grad()
def score(model, stream: np.ndarray, n_seq: int = 256) -> dict[str, float]:
    """Answer accuracy and cross-entropy after markers, and routed shares by token class, on
    ``n_seq`` held-out windows of ``stream``. A token counts as routed where the block changed
    it (a skipped token leaves the block bit for bit as it came, read with a forward hook)."""
    model.eval()
    x = torch.from_numpy(stream[: n_seq * SEQ].astype(np.int64)).view(n_seq, SEQ)
    seen = {}
    hook = model.blocks[0].register_forward_hook(lambda m, args, out: seen.update(changed=(out != args[0]).any(-1)))
    try:
        logits, _ = model(x)
    finally:
        hook.remove()
    mask, want = answers(x)
    out = {
        "answer_accuracy": (logits.argmax(-1)[mask] == want[mask]).float().mean().item(),
        "answer_loss": F.cross_entropy(logits[mask], want[mask]).item(),
        "answers": int(mask.sum()),
    }
    classes = {"payload": (x >= PAYLOAD.start) & (x < PAYLOAD.stop), "marker": x == MARKER, "filler": x < FILLER.stop}
    for name, where in classes.items():
        out[f"routed_{name}"] = seen["changed"][where].float().mean().item()
    model.train()
    return out


def run(kind: str, seed: int, steps: int, capacity: float, data: Path, out_dir: Path) -> dict:
    cfg = load_config(
        kind,
        [
            "model.n_layers=1",
            f"model.layout={KINDS[kind]}",
            f"model.seq_len={SEQ}",
            "model.d_model=64",
            "model.n_heads=4",
            f"model.vocab_size={VOCAB}",
            f"model.mod.capacity={capacity}",
            "model.mod.causal=none",
            f"data.source={data}",
            f"train.steps={steps}",
            "train.max_seconds=0",
            "train.batch_size=16",
            "train.lr=3e-3",
            "train.min_lr=3e-4",
            "train.warmup_steps=50",
            f"train.eval_every={steps}",
            "train.eval_batches=4",
            "train.progress=false",
            f"train.seed={seed}",
            f"train.out_dir={out_dir / f'{kind}-{seed}'}",
        ],
    )
    torch.manual_seed(seed)
    model, result = train(cfg)
    return {"kind": kind, "seed": seed, "steps": result.steps, **score(model, make_stream(SEQ * 256, 10_000 + seed))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--capacity", type=float, default=0.25)
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    p.add_argument("--label", default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "task.bin"
        make_stream(400_000, 0).tofile(data)
        runs = [run(k, s, args.steps, args.capacity, data, Path(tmp)) for s in range(args.seeds) for k in args.kinds]
    rows = []
    for kind in args.kinds:
        mine = [r for r in runs if r["kind"] == kind]
        row = {"kind": kind, **{m: float(np.mean([r[m] for r in mine])) for m in mine[0] if m not in ("kind", "seed")}}
        rows.append(row)
    cols = [("kind", "model", "s"), ("answer_accuracy", "answer acc", ".3f"), ("answer_loss", "answer loss", ".3f")]
    cols += [(f"routed_{c}", f"routed {c}", ".3f") for c in ("payload", "marker", "filler")]
    print_table(
        [{k: (v if not (isinstance(v, float) and math.isnan(v)) else None) for k, v in r.items()} for r in rows], cols
    )
    claims = {}
    if {"mod", "mod_random"} <= set(args.kinds):
        acc = {k: [r["answer_accuracy"] for r in runs if r["kind"] == k] for k in ("mod", "mod_random")}
        iv = paired_interval(acc["mod_random"], acc["mod"])  # claim: random - learned < 0
        claims["learned MoD answers more than random MoD (random - learned accuracy)"] = {**iv, "verdict": verdict(iv)}
        for name, c in claims.items():
            lo, hi = c["lo"], c["hi"]
            interval = f"[{lo:+.3f}, {hi:+.3f}]" if lo is not None else "n/a"
            print(f"{name}: {c['mean']:+.3f} {interval} over {c['n']} seeds -> {c['verdict']}")
    payload = {"steps": args.steps, "capacity": args.capacity, "runs": runs, "rows": rows, "claims": claims}
    print(f"wrote {write_json('routing-task', payload, args.label)}")


if __name__ == "__main__":
    main()
