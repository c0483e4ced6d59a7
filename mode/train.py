"""Training loop and the ``mode-train`` CLI.

AdamW, cosine schedule with linear warm-up, gradient clipping and accumulation
(``mode.step``), eval every N steps, a tqdm progress bar, metrics (losses, routing health,
tokens/s, MFU, peak memory) to ``<out_dir>/metrics.jsonl`` and checkpoint + resume
(``<out_dir>/ckpt.pt``, or ``ckpt/`` under torchrun; see ``mode.checkpoint``). Optional:
bf16 autocast, per-block ``torch.compile`` and activation checkpointing, a profiler trace.
Under torchrun: FSDP2 over the (dp, ep) mesh (``mode.parallel.fsdp``).

    mode-train --config mod model.n_layers=8 train.steps=500
    mode-train --config path/to/my.yaml --print-flops
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from mode import checkpoint, telemetry
from mode.compile import compile_blocks, compile_enabled
from mode.config import Config, ModelConfig, load_config, preset_names, to_dict
from mode.convert import upcycle
from mode.data import TokenSplit, load_splits
from mode.flops import print_flops, train_flops_per_step
from mode.layers.kinds import any_kind
from mode.layers.recompute import checkpoint_blocks
from mode.model import MoDETransformer
from mode.parallel.expert_parallel import parallelize, set_balance_group
from mode.parallel.fsdp import shard_model
from mode.parallel.mesh import ParallelContext, destroy, init_mesh
from mode.precision import PRECISION_DTYPES, autocast, resolve
from mode.routed import health_warnings, routing_metrics
from mode.step import (  # noqa: F401  (re-exported: the step's pieces were defined here before)
    LMObjective,
    NonFiniteTrainingError,
    StepResult,
    build_optimizer,
    lr_at,
    train_step,
)


@torch.no_grad()
def evaluate(
    model: MoDETransformer,
    split: TokenSplit,
    batch_size: int,
    n_batches: int,
    routing: str = "topk",
    ctx: ParallelContext | None = None,
    precision: str = "fp32",
) -> tuple[float, dict[str, float]]:
    """Mean cross-entropy (nats/token) over fixed windows of ``split`` (the same windows for
    every model) and the mean of each scalar routing metric over those batches. Under
    ``ctx`` each rank evaluates its rows of every batch and the losses are averaged."""
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(0)
    device = next(model.parameters()).device
    losses, metrics = [], {}
    world, rank = (ctx.world_size, ctx.rank) if ctx else (1, 0)
    rows = slice(rank * batch_size // world, (rank + 1) * batch_size // world)
    for _ in range(n_batches):
        x, y = split.batch(batch_size, gen)
        with autocast(precision, device):
            _, loss = model(x[rows].to(device), y[rows].to(device), routing=routing)
        losses.append(_mean_over_ranks(loss.item(), ctx))
        for key, value in routing_metrics(model).items():
            if isinstance(value, float | int):
                metrics[key] = metrics.get(key, 0.0) + value / n_batches
    model.train(was_training)
    return sum(losses) / len(losses), metrics


@dataclass
class TrainResult:
    steps: int
    train_loss: float
    val_loss: float
    val_loss_causal: float = float("nan")
    precision: str = "fp32"  # resolved: fp32 or bf16
    step_times: list[float] = field(default_factory=list)
    history: list[dict] = field(default_factory=list)  # eval points: step, seconds, flops, val_loss

    @property
    def median_step_time(self) -> float:
        return statistics.median(self.step_times) if self.step_times else float("nan")


def _check_vocab(model_cfg: ModelConfig, vocab: int) -> None:
    if vocab > model_cfg.vocab_size:
        raise ValueError(f"model.vocab_size={model_cfg.vocab_size} is too small: the data needs {vocab}")


def _init_parallel(cfg: Config) -> ParallelContext | None:
    """A ParallelContext when launched by torchrun (or asked for dp/ep > 1), else None."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    p = cfg.parallel
    if world == 1 and p.dp_size * p.ep_size == 1:
        return None
    has_moe = any_kind(cfg.model.block_kinds(), "holds_experts")
    ctx = init_mesh(p.dp_size, p.ep_size, cfg.model.moe.n_experts if has_moe else None, timeout_s=p.timeout_s)
    if cfg.train.batch_size % ctx.world_size:
        raise ValueError(
            f"train.batch_size={cfg.train.batch_size} (the global batch) must be divisible by the world size "
            f"{ctx.world_size}"
        )
    return ctx


def _mean_over_ranks(value: float, ctx: ParallelContext | None) -> float:
    if ctx is None:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / ctx.world_size


def prepare_model(
    model: MoDETransformer, cfg: Config, ctx: ParallelContext | None = None, precision: str = "fp32"
) -> MoDETransformer:
    """Make ``model`` (whole, identical on every rank) what ``cfg.train`` and ``ctx`` ask for,
    in torchtitan's order: experts split over "ep" and the balance group set, activation
    checkpointing, per-block compile, FSDP2 (``mode.parallel.fsdp``). Build the optimizer
    after this; ``mode.checkpoint.load`` loads a checkpoint of any layout into the result."""
    tc = cfg.train
    if ctx is not None:
        parallelize(model, ctx)
        set_balance_group(model, dist.group.WORLD)  # every rank reads different rows
    checkpoint_blocks(model.blocks, tc.activation_checkpoint, tc.activation_checkpoint_every)
    if compile_enabled(tc.compile, next(model.parameters()).device):
        compile_blocks(model)
    if ctx is not None:
        shard_model(model, ctx, precision)
    return model


def train(
    cfg: Config, model: MoDETransformer | None = None, stop_at: int | None = None
) -> tuple[MoDETransformer, TrainResult]:
    """Train ``model`` (built from ``cfg.model`` when None) and return it with its results.

    ``stop_at`` ends this run early after that step (with a checkpoint), as a preemption
    would; a later run with ``train.resume=true`` continues it exactly.

    Under ``torchrun`` the global batch ``train.batch_size`` is split over the ranks (each
    reads its own rows of the same sampled windows), experts are split over the "ep" group
    and every weight is sharded by FSDP2 (``mode.parallel.fsdp``), the balance loss with
    ``lb_scope="global_batch"`` sees every rank's tokens, and rank 0 alone logs and shows
    progress; checkpoints are sharded (``torch.distributed.checkpoint``).
    """
    tc = cfg.train
    if tc.threads:
        torch.set_num_threads(tc.threads)
    ctx = _init_parallel(cfg)
    rank, world = (ctx.rank, ctx.world_size) if ctx else (0, 1)
    device = ctx.device if ctx else telemetry.resolve_device(tc.device)
    precision = resolve(tc.precision, device)
    torch.manual_seed(tc.seed)  # identical initial weights on every rank
    train_split, val_split, vocab = load_splits(
        cfg.data.source, cfg.model.seq_len, cfg.data.val_fraction, cfg.data.cache_dir
    )
    _check_vocab(cfg.model, vocab)
    out_dir = Path(tc.out_dir)
    ckpt = out_dir / ("ckpt" if ctx else "ckpt.pt")
    resume_from = checkpoint.latest(ckpt) if tc.resume else None
    if model is None and tc.init_from and resume_from is None:
        # Every rank converts the same way (seeded), then the model is sharded like any other.
        model = upcycle(tc.init_from, cfg, seed=tc.seed)
    model = prepare_model((model or MoDETransformer(cfg.model)).to(device), cfg, ctx, precision)
    objective = LMObjective(model)
    opt = build_optimizer(model, tc)
    gen = torch.Generator().manual_seed(tc.seed)
    start, elapsed = 0, 0.0
    if resume_from is not None:
        # The newest checkpoint that passes its checks (older ones kept by keep_checkpoints
        # are the fallback). The time budget continues too: the schedule and the max_seconds
        # stop use it.
        warn = tqdm.write if rank == 0 else (lambda message: None)
        _, (start, elapsed) = checkpoint.load_newest_good(ckpt, model, opt, gen, ctx, warn=warn)
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    log = open(out_dir / "metrics.jsonl", "a" if start else "w") if rank == 0 else None  # noqa: SIM115
    rows = slice(rank * tc.batch_size // world, (rank + 1) * tc.batch_size // world)
    flops_per_step = train_flops_per_step(cfg.model, tc.batch_size)
    peak_flops, peak_how = telemetry.measure_peak_flops(device, PRECISION_DTYPES[precision])
    if rank == 0 and tc.progress:
        layout = f"dp {ctx.dp_size} x ep {ctx.ep_size}" if ctx else "1 process"
        compiled = "compiled blocks" if compile_enabled(tc.compile, device) else "eager"
        fused = "fused" if opt.param_groups[0].get("fused") else "foreach"
        tqdm.write(
            f"{cfg.name}: device {device}, precision {precision}, {compiled}, {fused} AdamW, {layout}; "
            f"MFU against {peak_flops / 1e12:.2f} TFLOP/s per rank ({peak_how})"
        )
    profiler = telemetry.StepProfiler(out_dir, list(tc.profile_steps), rank)
    if rank == 0:
        info = {"precision": precision, "world_size": world, "peak_flops_per_rank": peak_flops, "peak_how": peak_how}
        if tc.init_from:  # the checkpoint this run's weights were converted from (resumes keep saying it)
            info["init_from"] = str(Path(tc.init_from).resolve())
        (out_dir / "run_info.json").write_text(json.dumps(info, indent=2))
    result = TrainResult(steps=start, train_loss=float("nan"), val_loss=float("nan"), precision=precision)
    # Models with MoD blocks that can decide per token are also evaluated in causal mode.
    causal_eval = model.supports_causal() and any_kind(model.block_kinds, "routes_depth")
    # NOTE: the wall-clock budget (max_seconds, the time-based schedule) counts training steps
    # with their data loading, not evaluation or checkpoints, so that variants whose eval
    # costs more (causal-mode eval) are not charged for it.
    # Read on the host only on logging, eval and checkpoint steps: consecutive skipped steps
    # are counted on the device (``bad_run``, and the longest run since the last read).
    bad_run = torch.zeros((), device=device)
    worst_run = torch.zeros((), device=device)
    timer = telemetry.StepTimer(device)
    saved = start if start else -1  # step of the last checkpoint on disk from this run (or its resume)
    bar = tqdm(range(start, tc.steps), disable=not tc.progress or rank != 0, desc=cfg.name, dynamic_ncols=True)
    model.train()
    for step in bar:
        if tc.max_seconds and elapsed >= tc.max_seconds:
            break  # a resumed run whose time budget was already spent
        t_batch = time.perf_counter()
        lr = lr_at(step, tc, elapsed)
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = train_split.batch(tc.batch_size, gen)  # the global batch; this rank takes its rows
        done = step + 1
        saving = bool(tc.ckpt_every and done % tc.ckpt_every == 0)
        # Routing metrics only where they are read (a step that ends on the time budget reads
        # the last logged ones' absence: it logs without them).
        logged = done % tc.log_every == 0 or done % tc.eval_every == 0 or done in (tc.steps, stop_at) or saving
        profiler.begin(done)
        timer.start()
        out = train_step(
            model,
            opt,
            x[rows].to(device, non_blocking=True),
            y[rows].to(device, non_blocking=True),
            tc.grad_clip,
            ctx,
            objective,
            precision,
            tc.grad_accum_steps,
            metrics=logged,
        )
        timer.stop()
        profiler.end(done)
        bad_run = torch.where(out.skipped, bad_run + 1, 0)
        worst_run = torch.maximum(worst_run, bad_run)
        elapsed += time.perf_counter() - t_batch
        if ctx is not None:  # every rank stops at the same step
            elapsed = _mean_over_ranks(elapsed, ctx)
        out_of_time = bool(tc.max_seconds and elapsed >= tc.max_seconds) or done == stop_at
        last = done == tc.steps or out_of_time
        evaluating = done % tc.eval_every == 0 or last
        if not (done % tc.log_every == 0 or evaluating or saving):
            continue
        # -- a logging step: the host reads what the device computed -------------------------
        result.step_times += timer.read()
        loss, aux, grad_norm, skipped = (float(t) for t in out)
        result.train_loss = _mean_over_ranks(loss, ctx)
        record = {
            "step": done,
            "loss": result.train_loss,
            "aux": _mean_over_ranks(aux, ctx),
            "lr": lr,
            "step_time": result.step_times[-1],
            "elapsed": elapsed,
            **telemetry.throughput(
                tc.batch_size * cfg.model.seq_len, flops_per_step, result.step_times[-1], peak_flops * world
            ),
            "peak_memory_mb": telemetry.peak_memory_bytes(device) / 2**20,
            "grad_norm": grad_norm,
        }
        if skipped:
            record["skipped"] = True
            if rank == 0:
                tqdm.write(
                    f"step {done}: non-finite loss or gradient (loss {loss:.4g}, grad norm {grad_norm:.4g}): "
                    f"skipped, weights unchanged ({int(bad_run)} in a row)"
                )
        worst = int(worst_run)
        worst_run.zero_()
        if worst >= tc.max_bad_steps:
            if log is not None:
                log.write(json.dumps(record) + "\n")
                log.close()
            raise NonFiniteTrainingError(
                f"{worst} consecutive steps (up to step {done}) had a non-finite loss or gradient "
                f"(train.max_bad_steps={tc.max_bad_steps}); stopped without writing a checkpoint (the last "
                f"good one: {checkpoint.latest(ckpt) or 'none'}). Check the data, lower train.lr, or "
                "raise train.max_bad_steps"
            )
        record.update(routing_metrics(model))  # of this training step, before eval overwrites them
        warnings = health_warnings(record)
        if warnings:
            record["warnings"] = warnings
            if rank == 0:
                tqdm.write(f"step {done}: router collapse? " + "; ".join(warnings))
        if evaluating:
            result.val_loss, _ = evaluate(
                model, val_split, tc.batch_size, tc.eval_batches, ctx=ctx, precision=precision
            )
            record["val_loss"] = result.val_loss
            point = {"step": done, "seconds": elapsed, "flops": done * flops_per_step, "val_loss": result.val_loss}
            if causal_eval:
                result.val_loss_causal, causal_metrics = evaluate(
                    model, val_split, tc.batch_size, tc.eval_batches, routing="causal", ctx=ctx, precision=precision
                )
                point["val_loss_causal"] = record["val_loss_causal"] = result.val_loss_causal
                record.update({f"{k}@causal_eval": v for k, v in causal_metrics.items() if "causal_share" in k})
            result.history.append(point)
        if log is not None:
            log.write(json.dumps(record) + "\n")
            log.flush()
            bar.set_postfix(loss=f"{result.train_loss:.3f}", val=f"{result.val_loss:.3f}")
        if saving:
            saved = done
            checkpoint.save(ckpt, model, opt, checkpoint.Progress(done, elapsed), cfg, gen, ctx, tc.keep_checkpoints)
        result.steps = done
        if out_of_time:
            break
    result.step_times += timer.read()
    bar.close()
    profiler.close()
    if log is not None:
        log.close()
    if saved != result.steps:
        progress = checkpoint.Progress(result.steps, elapsed)
        checkpoint.save(ckpt, model, opt, progress, cfg, gen, ctx, tc.keep_checkpoints)
    return model, result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="mode-train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=None, help="preset name (mode/configs) or a YAML path")
    parser.add_argument(
        "--print-flops", action="store_true", help="print parameters and FLOPs (of every preset without --config)"
    )
    parser.add_argument("--sample", type=int, default=0, help="print this many sampled bytes after training")
    parser.add_argument(
        "--init-from",
        metavar="PATH",
        default=None,
        help="start from a dense checkpoint converted to --config's model (mode.convert.upcycle), fresh optimizer",
    )
    parser.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. model.n_layers=8")
    args = parser.parse_args(argv)
    if args.print_flops:
        names = [args.config] if args.config else [n for n in preset_names() if n != "base"]
        print_flops([load_config(name, args.overrides) for name in names])
        return
    cfg = load_config(args.config, args.overrides)
    if args.init_from:
        cfg.train.init_from = args.init_from
    try:
        model, result = train(cfg)
    finally:
        destroy()
    if int(os.environ.get("RANK", "0")) != 0:
        return
    print(
        f"{cfg.name}: {result.steps} steps, train loss {result.train_loss:.4f}, val loss {result.val_loss:.4f} "
        f"({result.val_loss / math.log(2):.3f} bits/byte), causal-routing val loss {result.val_loss_causal:.4f}, "
        f"median step {1000 * result.median_step_time:.1f} ms"
    )
    if args.sample and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        from mode.data import decode, encode  # noqa: PLC0415

        model.eval()
        out = model.generate(encode("\n").to(next(model.parameters()).device), args.sample, temperature=0.8, top_k=50)
        print(decode(out[0]))


if __name__ == "__main__":
    main()
