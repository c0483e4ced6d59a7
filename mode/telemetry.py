"""What a training run measures and says about itself: peak FLOP/s of the device, throughput,
MFU, peak memory, ``torch.profiler`` traces of chosen steps, step times, and the run's log
(``RunLogger``: ``metrics.jsonl``, the progress bar, messages, ``config.json``, ``run_info.json``)
and its health warnings (router collapse in the routing metrics, ``health_warnings``).

MFU = achieved FLOP/s (model FLOPs per step from ``mode.flops`` / step time, over every rank)
divided by the peak of all ranks, where a rank's peak is measured once per process with a
square matmul of the training dtype (not a datasheet number: on CPU there is none).
"""

from __future__ import annotations

import json
import logging
import math
import resource
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from mode.loggers import open_sinks, scalars
from mode.precision import matmul_seconds
from mode.run_dir import open_log, write_text

LOG = logging.getLogger("mode")  # the run's messages (a handler prints them above the progress bar)

PEAK_MATMUL_SIZE = 2048


_PEAKS: dict[tuple[str, int | None, torch.dtype], tuple[float, str]] = {}


def measure_peak_flops(
    device: torch.device, dtype: torch.dtype, seconds: float = 0.3, again: bool = False
) -> tuple[float, str]:
    """FLOP/s of ``[n, n] @ [n, n]`` matmuls in ``dtype`` on ``device`` (best of repeated
    timings after a warm-up, ``mode.precision.matmul_seconds``), and a sentence saying how it
    was measured. Measured once per process and device, later calls reuse it; ``again``
    measures once more and keeps the best of all measurements (a peak measured while other
    work held the device is too low, and only ever too low)."""
    key = (device.type, device.index, dtype)
    if again or key not in _PEAKS:
        n = PEAK_MATMUL_SIZE if device.type == "cuda" else 1024
        best, reps = matmul_seconds(n, dtype, device, reps=3, warmup=3, min_seconds=seconds)
        how = f"best of {reps} {n}x{n}x{n} {str(dtype).removeprefix('torch.')} matmuls on {device.type}"
        if key in _PEAKS:
            how = f"{how}, measured again"
        if 2 * n**3 / best > _PEAKS.get(key, (0.0, ""))[0]:
            _PEAKS[key] = (2 * n**3 / best, how)
    return _PEAKS[key]


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process so far: ``max_memory_allocated`` on CUDA, else the peak
    resident set size (RSS) of the process."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def throughput(tokens: int, flops: float, seconds: float, peak_flops: float) -> dict[str, float]:
    """``tokens_per_s``, ``flops_per_s`` and ``mfu`` of a step of ``tokens`` tokens and
    ``flops`` model FLOPs (all ranks) that took ``seconds``, against ``peak_flops`` (all ranks)."""
    achieved = flops / seconds
    return {"tokens_per_s": tokens / seconds, "flops_per_s": achieved, "mfu": achieved / peak_flops}


class StepProfiler:
    """Records training steps ``steps[0]`` to ``steps[1]`` (1-based optimizer steps,
    inclusive, counted across resumes) with ``torch.profiler`` and writes a Chrome trace
    ``<out_dir>/profile_rank<r>.json`` after the last; each step is a ``step <n>`` range.
    Inactive when ``steps`` is empty. Call ``begin(n)`` / ``end(n)`` around step n."""

    def __init__(self, out_dir: str | Path, steps: list[int], rank: int = 0) -> None:
        self.first, self.last = steps if steps else (0, -1)
        self.path = Path(out_dir) / f"profile_rank{rank}.json"
        self.prof: torch.profiler.profile | None = None
        self.range: torch.profiler.record_function | None = None

    def begin(self, step: int) -> None:
        if step == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities, record_shapes=True)
            self.prof.__enter__()
        if self.prof is not None:
            self.range = torch.profiler.record_function(f"step {step}")
            self.range.__enter__()

    def end(self, step: int) -> None:
        if self.prof is None:
            return
        self.range.__exit__(None, None, None)
        if step >= self.last:
            self.close()

    def close(self) -> None:
        """Stop and write the trace (also when training stops before ``steps[1]``)."""
        if self.prof is not None:
            self.prof.__exit__(None, None, None)
            self.prof.export_chrome_trace(str(self.path))
            self.prof = None


class StepTimer:
    """Times of training steps without waiting for the device after each: ``start()`` and
    ``stop()`` around a step, ``read()`` on logging steps returns the seconds of every step
    stopped since the last read. On CUDA each step is a pair of events and ``read()`` waits
    for the last one (the only sync); elsewhere the host clock (the CPU computes as it goes)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.pending: list[tuple] = []
        self._start = None

    def start(self) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.pending.append((self._start, end))
        else:
            self.pending.append((self._start, time.perf_counter()))

    def read(self) -> list[float]:
        if self.cuda and self.pending:
            self.pending[-1][1].synchronize()
            out = [a.elapsed_time(b) / 1e3 for a, b in self.pending]
        else:
            out = [b - a for a, b in self.pending]
        self.pending = []
        return out


class _TqdmHandler(logging.Handler):
    """Prints a log record above tqdm's progress bars."""

    def emit(self, record: logging.LogRecord) -> None:
        tqdm.write(self.format(record))


def _default_handler() -> None:
    """Give the ``mode`` logger a handler that prints, unless the application set its own."""
    if not LOG.handlers:
        LOG.addHandler(_TqdmHandler())
        LOG.setLevel(logging.INFO)
        LOG.propagate = False


class RunLogger:
    """The run's log, written by rank 0 only (other ranks get a silent one): ``config.json``
    and ``run_info.json`` in ``out_dir``, one JSON record per logged step in
    ``metrics.jsonl`` (started afresh, or continued when ``append`` is set before the first
    record: a resumed run) and the other ``loggers`` (``mode.loggers``: TensorBoard, wandb),
    a tqdm progress bar, and messages through the ``mode`` Python logger, printed above the
    bar unless the application configured that logger (``progress=False`` silences the bar
    and the info messages, not the files or warnings)."""

    def __init__(
        self,
        out_dir: str | Path,
        rank: int,
        name: str,
        progress: bool = True,
        loggers: list[str] | None = None,
        config: dict | None = None,
    ) -> None:
        self.out_dir, self.active, self.name = Path(out_dir), rank == 0, name
        self.progress = progress and self.active
        self.append = False
        self.bar: tqdm | None = None
        self.budget = (0, 0.0)  # (steps, seconds) of the run behind the bar (``steps``)
        self.file = None
        self.last_val = float("nan")
        self.logger_names = list(loggers or [])
        self.sinks: list | None = None  # opened with the first record (rank 0)
        self.config = config or {}  # the run's config, given to the other loggers
        _default_handler()

    def write_json(self, filename: str, values: dict) -> None:
        """``out_dir/filename`` as indented JSON (rank 0)."""
        if self.active:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            write_text(self.out_dir / filename, json.dumps(values, indent=2))

    def say(self, message: str) -> None:
        """Log a message at INFO (rank 0, when showing progress)."""
        if self.progress:
            LOG.info(message)

    def warn(self, message: str) -> None:
        """Log a warning (rank 0; shown even without progress output)."""
        if self.active:
            LOG.warning(message)

    def steps(self, start: int, end: int, max_seconds: float = 0.0, elapsed: float = 0.0) -> range:
        """Step indices ``start .. end - 1``, with a progress bar that ``advance`` moves: in
        steps, or, under a time budget (``max_seconds`` > 0), in percent of whichever of the
        steps and the seconds runs out first (the schedule's progress), so its estimate of
        the time left follows the budget. ``elapsed``: seconds a resumed run already spent."""
        self.budget = (end, max_seconds)
        if max_seconds:
            self.bar = tqdm(
                total=100,
                initial=self._percent(start, elapsed),
                disable=not self.progress,
                desc=self.name,
                dynamic_ncols=True,
                bar_format="{desc}: {n:3.0f}% of the budget |{bar}| {elapsed}<{remaining}{postfix}",
            )
        else:
            self.bar = tqdm(
                total=end, initial=start, disable=not self.progress, desc=self.name, dynamic_ncols=True, unit="step"
            )
        return range(start, end)

    def _percent(self, done: int, elapsed: float) -> float:
        end, max_seconds = self.budget
        return min(100.0, 100 * max(done / max(end, 1), elapsed / max_seconds))

    def advance(self, done: int, elapsed: float, last: bool = False) -> None:
        """Move the progress bar to step ``done`` after ``elapsed`` seconds of training (to its
        end when the run ``last`` ends there)."""
        if self.bar is not None:
            at = self._percent(done, elapsed) if self.budget[1] else done
            if last and self.budget[1]:
                at = self.bar.total
            self.bar.update(at - self.bar.n)

    def record(self, values: dict) -> None:
        """Append one step's record to ``metrics.jsonl`` and show its losses on the bar."""
        if self.active and self.file is None:
            self.file = open_log(self.out_dir / "metrics.jsonl", self.append)
            self.sinks, skipped = open_sinks(self.logger_names, self.out_dir, self.config, self.name)
            for message in skipped:
                self.warn(message)
        if self.file is not None:
            self.file.write(json.dumps(values) + "\n")
            self.file.flush()
            for sink in self.sinks or []:
                sink.log(scalars(values), int(values["step"]))
        self.last_val = values.get("val_loss", self.last_val)
        if self.bar is not None and self.progress:
            shown = {"step": values["step"], "loss": f"{values['loss']:.3f}"}
            if not math.isnan(self.last_val):  # no evaluation yet: no validation loss to show
                shown["val"] = f"{self.last_val:.3f}"
            self.bar.set_postfix(shown)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.file is not None:
            self.file.close()
            self.file = None
        for sink in self.sinks or []:
            sink.close()
        self.sinks = None


# Router collapse, as ``health_warnings`` reports it.
FIRST_POSITIONS_LIMIT = 0.9  # of a MoD router's picks in the first tenth of the positions
EXPERT_SHARE_LIMIT = 0.5  # of all assignments on one real expert


def health_warnings(metrics: dict[str, float | list[float]]) -> list[str]:
    """Warnings for signs of router collapse in ``routing_metrics`` output: a MoD router that
    sends more than 90% of its picks to the first 10% of positions, or one expert that takes
    more than half of the assignments while others exist (a one-expert layer, whose one expert
    takes every assignment and whose max load is its mean load, is no collapse)."""
    out = []
    for key, value in metrics.items():
        layer = key.rsplit("/", 1)[0] if "/" in key else "layer"
        if key.endswith("/position_share") or key == "position_share":
            if isinstance(value, list) and value and value[0] > FIRST_POSITIONS_LIMIT:
                out.append(f"{layer}: {value[0]:.0%} of the MoD router's picks are in the first 10% of positions")
        over_mean = metrics.get(key + "_over_mean", float("inf"))
        if (key.endswith("/load_max") or key == "load_max") and value > EXPERT_SHARE_LIMIT and over_mean > 1:
            out.append(f"{layer}: one expert takes {value:.0%} of the assignments")
    return out
