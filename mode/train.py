"""Training loop and the ``mode-train`` CLI.

AdamW, cosine schedule with linear warm-up, gradient clipping and accumulation
(``mode.step``), eval every N steps, a tqdm progress bar, metrics (losses, routing health,
tokens/s, MFU, peak memory) to ``<out_dir>/metrics.jsonl`` and checkpoint + resume
(``<out_dir>/ckpt.pt``, or ``ckpt/`` under torchrun; see ``mode.checkpoint``). Optional:
bf16 autocast, per-block ``torch.compile`` and activation checkpointing, a profiler trace.
Under torchrun: FSDP2 over the (dp, ep) mesh (``mode.parallel``).

    mode-train --config mod model.n_layers=8 train.steps=500
    mode-train --config path/to/my.yaml --print-flops

``train`` is the loop; ``Run`` is everything it needs (``Run.start``: data, model, optimizer,
resume, log) and what it does around a step (``evaluate_and_record``, ``save``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mode import checkpoint, run_dir, telemetry
from mode.cadence import Cadence
from mode.compile import compile_enabled
from mode.config import Config, ModelConfig, from_dict, load_config, preset_names, to_dict
from mode.convert import HF_PREFIX, hf_source_config, is_hf, published_dir, published_shape, upcycle
from mode.data import Corpus, TokenSplit, load_corpus, source_tokenizer
from mode.evaluation import evaluate_batches, rank_rows, sampled_windows
from mode.flops import print_flops, train_flops_per_step
from mode.layers.kinds import any_kind
from mode.model import MoDETransformer
from mode.parallel.apply import init_parallel, parallelize_model
from mode.parallel.mesh import ONE_PROCESS, ParallelContext, barrier, destroy, mean_over_ranks
from mode.precision import PRECISION_DTYPES, resolve
from mode.routed import routing_metrics
from mode.step import LMObjective, NonFiniteTrainingError, StepResult, build_optimizer, lr_at, train_step
from mode.telemetry import health_warnings
from mode.tokenizer import check_same_tokenizer, encode_prompt, load_tokenizer


def evaluate(
    model: MoDETransformer,
    split: TokenSplit,
    batch_size: int,
    n_batches: int,
    routing: str = "topk",
    *,
    ctx: ParallelContext = ONE_PROCESS,
    precision: str = "fp32",
) -> tuple[float, dict[str, float]]:
    """Mean cross-entropy (nats/token) over fixed windows of ``split`` (the same windows for
    every model) and the mean of each scalar routing metric over those batches. Under
    ``ctx`` each rank evaluates its rows of every batch and the losses are averaged
    (``mode.evaluation``, the loop ``mode-eval`` uses too)."""
    batches = sampled_windows(split, batch_size, n_batches)
    done = evaluate_batches(model, batches, routing, ctx=ctx, precision=precision)
    return done.loss, done.metrics


@dataclass
class TrainResult:
    steps: int
    train_loss: float
    val_loss: float
    val_loss_causal: float = float("nan")
    precision: str = "fp32"  # resolved: fp32 or bf16
    step_times: list[float] = field(default_factory=list)
    history: list[dict] = field(default_factory=list)  # eval points: step, seconds, flops, val_loss
    tokenizer: str | None = "bytes"  # what decodes the data's ids (mode.tokenizer); None: unknown
    bytes_per_token: float | None = 1.0  # of the validation text; None: unknown

    @property
    def median_step_time(self) -> float:
        return statistics.median(self.step_times) if self.step_times else float("nan")

    def val_loss_text(self) -> str:
        """The validation loss in nats per token, and in bits per byte when the data's bytes
        per token are known (else bits per token)."""
        bits = self.val_loss / math.log(2)
        if self.bytes_per_token is None:
            return f"val loss {self.val_loss:.4f} ({bits:.3f} bits/token)"
        return f"val loss {self.val_loss:.4f} ({bits / self.bytes_per_token:.3f} bits/byte)"


def _fit_vocab(model_cfg: ModelConfig, corpus: Corpus, source: str = "the data") -> ModelConfig:
    """``model_cfg`` with room for the data's ids: a declared vocabulary (a tokenizer's, a
    prepared directory's meta) larger than ``model.vocab_size`` becomes it; ids found by
    scanning token files must fit."""
    if corpus.vocab_size <= model_cfg.vocab_size:
        return model_cfg
    if corpus.tokenizer in (None, "bytes"):
        raise ValueError(
            f"model.vocab_size={model_cfg.vocab_size} is too small: the ids of data.source={source!r} need "
            f"{corpus.vocab_size} (token ids of another tokenizer?)"
        )
    return dataclasses.replace(model_cfg, vocab_size=corpus.vocab_size)


def _flat(values: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _weight_shapes(model_cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in MoDETransformer(model_cfg).state_dict().items()}


def resumed_model_config(cfg: Config) -> tuple[ModelConfig, str, str] | None:
    """On ``train.resume`` with a checkpoint in ``train.out_dir``: the model config it was
    trained with (so a run started from a published model resumes without ``--init-from``, and
    without the published directory), and what the run's first line says of it; None when
    there is nothing to resume. A ``model.*`` value that the command line chose (it differs
    from ``cfg.name``'s preset) and that differs from the checkpoint's is kept where the
    checkpoint's weights still fit it (e.g. a loss coefficient); where they do not, a
    ``ValueError`` names the fields in one line. The third item: the run's ``train.init_from``
    (the command line's, else the checkpoint's), so a resume keeps saying where it started."""
    if not cfg.train.resume:
        return None
    sharded = int(os.environ.get("WORLD_SIZE", "1")) > 1
    found, stored = None, None
    for candidate in checkpoint.resume_candidates(Path(cfg.train.out_dir) / ("ckpt" if sharded else "ckpt.pt")):
        try:  # a damaged one is skipped here as the resume itself skips it (and says so)
            found, stored = candidate, checkpoint.checkpoint_config(candidate)
            break
        except (checkpoint.CheckpointError, OSError, ValueError):
            continue
    if stored is None:
        return None
    try:
        preset = _flat(to_dict(load_config(cfg.name))["model"])
    except (ValueError, FileNotFoundError):  # not a preset's name: every field counts as chosen
        preset = {}
    given, kept = _flat(to_dict(cfg)["model"]), _flat(to_dict(stored)["model"])
    chosen = {k: v for k, v in given.items() if v != kept[k] and (k not in preset or preset[k] != v)}
    init_from = cfg.train.init_from or stored.train.init_from
    if not chosen:
        return stored.model, f"model from {found}", init_from
    values = to_dict(stored)
    for key, value in chosen.items():  # "moe.lb_coef" -> values["model"]["moe"]["lb_coef"]
        *path, last = key.split(".")
        node = values["model"]
        for part in path:
            node = node[part]
        node[last] = value
    merged = from_dict(values)  # validated
    if _weight_shapes(merged.model) != _weight_shapes(stored.model):
        said = ", ".join(f"model.{k}={v!r} (the checkpoint's: {kept[k]!r})" for k, v in sorted(chosen.items()))
        raise ValueError(
            f"train.resume: {said} would not load {found}: its weights are another shape; leave "
            f"{'them' if len(chosen) > 1 else 'it'} out to resume, or start a new run in another train.out_dir"
        )
    changed = ", ".join(f"model.{k}={v!r}" for k, v in sorted(chosen.items()))
    return merged.model, f"model from {found}, with {changed} from the command line", init_from


def data_tokenizer(cfg: Config) -> str:
    """Which tokenizer the run's data are in, said in the run's first line. A run started from
    a published model (``train.init_from=hf:<dir>``) that has a ``tokenizer.json`` must train
    on data in that tokenizer: other data (bytes, or a directory prepared with another) are
    refused by name (``ValueError``); token files (no tokenizer known) are taken as its ids."""
    spec = source_tokenizer(cfg.data.source, cfg.data.tokenizer)
    said = "token ids of no known tokenizer" if spec is None else spec
    if not is_hf(cfg.train.init_from):
        return said
    hf_dir = published_dir(cfg.train.init_from)
    if not (hf_dir / "tokenizer.json").is_file():
        return f"{said} (the published model {hf_dir} has no tokenizer.json to compare with)"
    if spec is None:
        return f"{said}, taken as the ids of {hf_dir / 'tokenizer.json'}"
    fix = (
        f"train on data in its tokenizer: mode-prepare <text files> --out DIR --tokenizer {hf_dir}, then "
        f"data.source=DIR (or data.tokenizer={hf_dir} for a text file)"
    )
    check_same_tokenizer(spec, hf_dir, f"the published model {hf_dir}", fix)
    return f"{spec}, the published model's"


@dataclass
class Run:
    """A training run's parts, made by ``Run.start(cfg)``; ``train`` drives them."""

    cfg: Config
    ctx: ParallelContext  # one process is a context of size 1
    device: torch.device
    precision: str
    model: MoDETransformer
    opt: torch.optim.Optimizer
    objective: LMObjective
    data: Corpus
    gen: torch.Generator  # the data order (checkpointed)
    ckpt: Path
    start_step: int  # 0, or the step a resumed run continues from
    elapsed: float
    log: telemetry.RunLogger
    flops_per_step: int
    peak_flops: float
    lock: run_dir.RunLock | None = None  # out_dir's, held by rank 0

    @classmethod
    def start(cls, cfg: Config, model: MoDETransformer | None = None) -> Run:
        """Data, model (upcycled when ``train.init_from``, parallelized), optimizer, resumed
        state (``train.resume``) and log of a run; the log's first line names the device,
        precision, compile, optimizer and parallel layout."""
        tc = cfg.train
        if tc.threads:
            torch.set_num_threads(tc.threads)
        resumed, model_said = resumed_model_config(cfg), ""
        if resumed is not None:  # the checkpoint's model: no published directory needed again
            cfg.model, model_said, tc.init_from = resumed
        elif is_hf(tc.init_from):  # a published model defines the shape (mode.convert.published_shape)
            cfg.model = published_shape(cfg.model, hf_source_config(tc.init_from))
        ctx = init_parallel(cfg)
        lock = None
        if ctx.rank == 0:  # before anything is read or written there
            lock = run_dir.claim(tc.out_dir, tc.resume, tc.overwrite, warn=telemetry.LOG.warning)
        barrier(ctx)
        try:
            return cls._start(cfg, model=model, ctx=ctx, lock=lock, model_said=model_said)
        except BaseException:
            if lock is not None:
                lock.release()
            raise

    @classmethod
    def _start(
        cls,
        cfg: Config,
        *,
        model: MoDETransformer | None,
        ctx: ParallelContext,
        lock: run_dir.RunLock | None,
        model_said: str = "",
    ) -> Run:
        tc = cfg.train
        device = ctx.device
        precision = resolve(tc.precision, device)
        torch.manual_seed(tc.seed)  # identical initial weights on every rank
        tokenizer = data_tokenizer(cfg)
        data = load_corpus(
            cfg.data.source, cfg.model.seq_len, cfg.data.val_fraction, cfg.data.cache_dir, cfg.data.tokenizer
        )
        cfg.model = _fit_vocab(cfg.model, data, cfg.data.source)
        ckpt = Path(tc.out_dir) / ("ckpt" if ctx.distributed else "ckpt.pt")
        resume_from = checkpoint.latest(ckpt) if tc.resume else None
        if model is None and tc.init_from and resume_from is None:
            # Every rank converts the same way (seeded), then the model is sharded like any other.
            model = upcycle(tc.init_from, cfg, seed=tc.seed)
        model = parallelize_model((model or MoDETransformer(cfg.model)).to(device), cfg, ctx=ctx, precision=precision)
        opt = build_optimizer(model, tc)
        gen = torch.Generator().manual_seed(tc.seed)
        config = to_dict(cfg)
        log = telemetry.RunLogger(tc.out_dir, ctx.rank, cfg.name, tc.progress, list(tc.loggers), config)
        start, elapsed = 0, 0.0
        if resume_from is not None:
            # The newest checkpoint that passes its checks (older ones kept by keep_checkpoints
            # are the fallback). The time budget continues too: the schedule and the max_seconds
            # stop use it.
            found, (start, elapsed) = checkpoint.load_newest_good(ckpt, model, opt, gen, ctx=ctx, warn=log.warn)
            log.append = start > 0  # metrics.jsonl continues
            resumed = f"; resumed from {found} at step {start}" + (f" ({model_said})" if model_said else "")
        elif tc.resume:
            resumed = f"; train.resume=true, but {tc.out_dir} holds no checkpoint: starting at step 0"
            log.warn(f"train.resume=true, but {tc.out_dir} holds no checkpoint: starting at step 0")
        else:
            resumed = ""
        peak_flops, peak_how = telemetry.measure_peak_flops(device, PRECISION_DTYPES[precision])
        compiled = "compiled blocks" if compile_enabled(tc.compile, device) else "eager"
        fused = "fused" if opt.param_groups[0].get("fused") else "foreach"
        log.say(
            f"{cfg.name}: device {device}, precision {precision}, {compiled}, {fused} AdamW, {ctx.layout()}; "
            f"MFU against {peak_flops / 1e12:.2f} TFLOP/s per rank ({peak_how}); data {cfg.data.source}, "
            f"tokenizer {tokenizer}{resumed}"
        )
        log.write_json("config.json", config)
        info = {
            "precision": precision,
            "world_size": ctx.world_size,
            "peak_flops_per_rank": peak_flops,
            "peak_how": peak_how,
        }
        if tc.init_from:  # the checkpoint this run's weights were converted from (resumes keep saying it)
            prefix = HF_PREFIX if is_hf(tc.init_from) else ""
            info["init_from"] = prefix + str(Path(tc.init_from.removeprefix(prefix)).resolve())
        log.write_json("run_info.json", info)
        flops = train_flops_per_step(cfg.model, tc.batch_size)
        objective = LMObjective(model)
        return cls(
            cfg=cfg,
            ctx=ctx,
            device=device,
            precision=precision,
            model=model,
            opt=opt,
            objective=objective,
            data=data,
            gen=gen,
            ckpt=ckpt,
            start_step=start,
            elapsed=elapsed,
            log=log,
            flops_per_step=flops,
            peak_flops=peak_flops,
            lock=lock,
        )

    def release(self) -> None:
        """Give the run directory's lock back (the run is over, or failed)."""
        if self.lock is not None:
            self.lock.release()

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the next global batch, on the device."""
        x, y = self.data.train.batch(self.cfg.train.batch_size, self.gen)
        rows = rank_rows(self.cfg.train.batch_size, self.ctx)
        return x[rows].to(self.device, non_blocking=True), y[rows].to(self.device, non_blocking=True)

    def throughput(self, done: int, step_time: float) -> dict[str, float]:
        """Tokens/s, FLOP/s and MFU of step ``done`` (``telemetry.throughput``). An MFU above 1
        shows that the peak measured at start was undercut by other work on the device: it is
        measured again (the best kept, in ``run_info.json`` too) and the run says so."""
        tokens, world = self.cfg.train.batch_size * self.cfg.model.seq_len, self.ctx.world_size
        rates = telemetry.throughput(tokens, self.flops_per_step, step_time, self.peak_flops * world)
        if rates["mfu"] <= 1:
            return rates
        before = self.peak_flops
        self.peak_flops, how = telemetry.measure_peak_flops(self.device, PRECISION_DTYPES[self.precision], again=True)
        self.log.warn(
            f"step {done}: MFU {rates['mfu']:.2f} against the peak measured at start ({before / 1e12:.3g} TFLOP/s "
            f"per rank), which other work on the device undercut: measured again, {self.peak_flops / 1e12:.3g} TFLOP/s"
        )
        info_file = self.log.out_dir / "run_info.json"
        if self.log.active and info_file.is_file():
            info = json.loads(info_file.read_text(encoding="utf-8"))
            self.log.write_json("run_info.json", info | {"peak_flops_per_rank": self.peak_flops, "peak_how": how})
        return telemetry.throughput(tokens, self.flops_per_step, step_time, self.peak_flops * world)

    def step_record(self, done: int, out: StepResult, lr: float, elapsed: float, step_time: float, bad: int) -> dict:
        """The logged record of step ``done`` (reads the step's results on the host); ``bad``:
        consecutive skipped steps up to it."""
        loss, aux, grad_norm, skipped = (float(t) for t in out)
        record = {
            "step": done,
            "loss": mean_over_ranks(loss, self.ctx),
            "aux": mean_over_ranks(aux, self.ctx),
            "lr": lr,
            "step_time": step_time,
            "elapsed": elapsed,
            **self.throughput(done, step_time),
            "peak_memory_mb": telemetry.peak_memory_bytes(self.device) / 2**20,
            "grad_norm": grad_norm,
        }
        if skipped:
            record["skipped"] = True
            self.log.warn(
                f"step {done}: non-finite loss or gradient (loss {loss:.4g}, grad norm {grad_norm:.4g}): "
                f"skipped, weights unchanged ({bad} in a row)"
            )
        return record

    def stop_if_bad(self, worst: int, record: dict) -> None:
        """``NonFiniteTrainingError`` after ``train.max_bad_steps`` consecutive skipped steps."""
        tc = self.cfg.train
        if worst >= tc.max_bad_steps:
            self.log.record(record)
            self.log.close()
            raise NonFiniteTrainingError(
                f"{worst} consecutive steps (up to step {record['step']}) had a non-finite loss or gradient "
                f"(train.max_bad_steps={tc.max_bad_steps}); stopped without writing a checkpoint (the last "
                f"good one: {checkpoint.latest(self.ckpt) or 'none'}). Check the data, lower train.lr, or "
                "raise train.max_bad_steps"
            )

    def evaluate_and_record(self, record: dict, result: TrainResult, evaluating: bool) -> None:
        """Add this step's routing metrics and health warnings to ``record``; on evaluation
        steps the validation loss (and with causal routing, where the model has MoD blocks that
        decide per token), also kept in ``result``; then write the record."""
        record.update(routing_metrics(self.model))  # of this training step, before eval overwrites them
        warnings = health_warnings(record)
        if warnings:
            record["warnings"] = warnings
            self.log.warn(f"step {record['step']}: router collapse? " + "; ".join(warnings))
        if evaluating:
            tc, val = self.cfg.train, self.data.val
            args = (self.model, val, tc.batch_size, tc.eval_batches)
            result.val_loss, _ = evaluate(*args, ctx=self.ctx, precision=self.precision)
            record["val_loss"] = result.val_loss
            step = record["step"]
            point = {"step": step, "seconds": record["elapsed"], "flops": step * self.flops_per_step}
            point["val_loss"] = result.val_loss
            if self.model.supports_causal() and any_kind(self.model.block_kinds, "routes_depth"):
                result.val_loss_causal, metrics = evaluate(*args, "causal", ctx=self.ctx, precision=self.precision)
                point["val_loss_causal"] = record["val_loss_causal"] = result.val_loss_causal
                record.update({f"{k}@causal_eval": v for k, v in metrics.items() if "causal_share" in k})
            result.history.append(point)
        self.log.record(record)

    def save(self, step: int, elapsed: float) -> None:
        tc = self.cfg.train
        progress = checkpoint.Progress(step, elapsed)
        checkpoint.save(
            self.ckpt,
            self.model,
            self.opt,
            progress,
            self.cfg,
            self.gen,
            ctx=self.ctx,
            keep=tc.keep_checkpoints,
            warn=self.log.warn,
        )


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

    The host reads what the device computed only on logging, eval and checkpoint steps:
    consecutive skipped steps are counted on the device. The wall-clock budget
    (``max_seconds``, the time-based schedule) counts training steps with their data loading,
    not evaluation or checkpoints, so variants whose eval costs more are not charged for it.
    """
    run = Run.start(cfg, model)
    try:
        return _train_steps(run, stop_at)
    finally:
        run.release()


def _train_steps(run: Run, stop_at: int | None) -> tuple[MoDETransformer, TrainResult]:
    """``train``'s loop over the steps of a started run."""
    cfg = run.cfg
    tc, elapsed, saved = cfg.train, run.elapsed, run.start_step or -1  # saved: the step of the last checkpoint on disk
    result = TrainResult(
        steps=run.start_step,
        train_loss=float("nan"),
        val_loss=float("nan"),
        precision=run.precision,
        tokenizer=run.data.tokenizer,
        bytes_per_token=run.data.bytes_per_token,
    )
    bad_run, worst_run = torch.zeros((), device=run.device), torch.zeros((), device=run.device)  # skips in a row
    timer = telemetry.StepTimer(run.device)
    profiler = telemetry.StepProfiler(tc.out_dir, list(tc.profile_steps), run.ctx.rank)
    run.model.train()
    cadence = Cadence(tc, stop_at)
    overdue = False  # the time budget is spent: the next step is the last
    for step in run.log.steps(run.start_step, tc.steps, tc.max_seconds, run.elapsed):
        if step == run.start_step and cadence.out_of_time(elapsed):
            break  # a resumed run whose time budget was already spent
        t_batch, done = time.perf_counter(), step + 1
        plan = cadence.plan(done, overdue)
        lr = lr_at(step, tc, elapsed)
        for group in run.opt.param_groups:
            group["lr"] = lr
        x, y = run.batch()
        profiler.begin(done)
        timer.start()
        out = train_step(
            run.model,
            run.opt,
            x,
            y,
            tc.grad_clip,
            ctx=run.ctx,
            objective=run.objective,
            precision=run.precision,
            accum_steps=tc.grad_accum_steps,
            metrics=plan.metrics,
        )
        timer.stop()
        profiler.end(done)
        bad_run = torch.where(out.skipped, bad_run + 1, 0)
        worst_run = torch.maximum(worst_run, bad_run)
        elapsed = mean_over_ranks(elapsed + time.perf_counter() - t_batch, run.ctx)  # every rank stops alike
        overdue = cadence.out_of_time(elapsed)
        plan = cadence.after(plan, overdue)
        run.log.advance(done, elapsed, last=plan.last)
        if not plan.record:
            continue
        result.step_times += timer.read()
        record = run.step_record(done, out, lr, elapsed, result.step_times[-1], int(bad_run))
        result.train_loss = record["loss"]
        run.stop_if_bad(int(worst_run), record)
        worst_run.zero_()
        run.evaluate_and_record(record, result, plan.evaluate)
        if plan.save:
            saved = done
            run.save(done, elapsed)
        result.steps = done
        if plan.last:
            break
    result.step_times += timer.read()
    profiler.close()
    run.log.close()
    if saved != result.steps:
        run.save(result.steps, elapsed)
    return run.model, result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="mode-train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=None, help="preset name (mode/configs) or a YAML path")
    parser.add_argument(
        "--print-flops", action="store_true", help="print parameters and FLOPs (of every preset without --config)"
    )
    parser.add_argument("--sample", type=int, default=0, help="print this many sampled tokens after training")
    parser.add_argument(
        "--init-from",
        metavar="PATH",
        default=None,
        help="start from a dense checkpoint converted to --config's model (mode.convert.upcycle), fresh optimizer; "
        "hf:<dir> for a Hugging Face checkpoint (its shape and architecture replace the preset's)",
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
    sharded = int(os.environ.get("WORLD_SIZE", "1")) > 1
    try:
        model, result = train(cfg)
        if sharded:
            model = None  # freed before its process group (mode.parallel.mesh.destroy says why)
    finally:
        destroy()
    if int(os.environ.get("RANK", "0")) != 0:
        return
    causal = "" if math.isnan(result.val_loss_causal) else f"causal-routing val loss {result.val_loss_causal:.4f}, "
    print(
        f"{cfg.name}: {result.steps} steps, train loss {result.train_loss:.4f}, {result.val_loss_text()}, "
        f"{causal}median step {1000 * result.median_step_time:.1f} ms"
    )
    if args.sample and not sharded:
        if result.tokenizer is None:
            print(
                "(no sample: the data's tokenizer is unknown; prepare the data with mode-prepare or set data.tokenizer)"
            )
            return
        tok = load_tokenizer(result.tokenizer)
        model.eval()
        prompt = encode_prompt(tok, "\n").to(next(model.parameters()).device)
        print(tok.decode(model.generate(prompt, args.sample, temperature=0.8, top_k=50)[0].tolist()))


if __name__ == "__main__":
    from mode.cli import run

    run("mode-train", main)
