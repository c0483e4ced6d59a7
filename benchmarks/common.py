"""Shared benchmark helpers: timing (warm-up + median), environment, JSON output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

# MODE_BENCH_RESULTS redirects every script's output (the tests write to a temporary folder).
RESULTS_DIR = Path(os.environ.get("MODE_BENCH_RESULTS") or Path(__file__).resolve().parent / "results")


def fwd_bwd_step(module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> None:
    """One training step's forward + backward with a materialized upstream gradient.

    Parameter gradients are set to None first, as ``optimizer.zero_grad()`` does, so every
    candidate pays for fresh gradients and none for accumulating into last repeat's (a cost
    that grows with the parameter count, e.g. 4x for an 8-expert top-2 MoE, not with routing).
    """
    module.zero_grad(set_to_none=True)
    x.grad = None
    module(x).backward(grad)


def interleaved_median_times(
    fns: dict[str, Callable[[], object]],
    warmup: int = 2,
    repeats: int = 7,
    sync: Callable[[], object] | None = None,
    settle: int = 1,
    settle_s: float = 0.25,
) -> dict[str, float]:
    """Median seconds of each function, timed round-robin (one timed call of each per round)
    so that drift in machine speed hits every candidate alike; ratios between them are fair.

    Before each timed call the candidate runs untimed for at least ``settle`` calls and
    ``settle_s`` seconds, so that each candidate is timed in its own steady state (allocator,
    caches and CPU as after a stretch of its own calls, as in a training loop that repeats one
    step) rather than in the state the previous candidate left. The time floor matters for
    short candidates: on the 2-core development VM any switch of work (another candidate, even
    a 50 ms sleep) leaves the next 70-250 ms of work up to 20% slower (RESULTS.md, "Timing"),
    a transient that one settle call of a 20 ms block does not outlast.
    ``sync`` (e.g. ``torch.cuda.synchronize``) runs before each clock read on async devices.
    """
    sync = sync or (lambda: None)
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync()
            t_settle, calls = time.perf_counter(), 0
            while calls < settle or time.perf_counter() - t_settle < settle_s:
                fn()
                sync()
                calls += 1
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


# Settings that change how the C allocator returns freed memory to the OS. With glibc's
# defaults large tensors (e.g. the dense block's [4096, 2048] fp32 MLP hidden, 32 MiB) go back
# to the OS when freed and the next step pays a page fault per fresh 4 KiB page, which moves
# CPU timings by several percent (RESULTS.md, "What the block ratios measure"); every result
# records these settings.
ALLOCATOR_ENV = ("GLIBC_TUNABLES", "MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "LD_PRELOAD")


def minor_faults_per_call(fn: Callable[[], object], calls: int = 3) -> float | None:
    """Mean minor page faults of the process per call of ``fn`` after one untimed call (None
    where getrusage is absent): each 4 KiB page the allocator takes fresh from the OS."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return None
    fn()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        fn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls


def environment() -> dict:
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "libc": " ".join(platform.libc_ver()).strip() or None,
        "allocator_env": {k: os.environ[k] for k in ALLOCATOR_ENV if k in os.environ},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def result_path(name: str, label: str | None = None, suffix: str = ".json") -> Path:
    """``results/<name>[-<label>]<suffix>`` (the JSON of a run, its plot with ``.png``)."""
    return RESULTS_DIR / (f"{name}-{label}{suffix}" if label else f"{name}{suffix}")


def write_json(name: str, payload: dict, label: str | None = None) -> Path:
    """Write ``results/<name>[-<label>].json`` with the environment attached."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = result_path(name, label)
    path.write_text(json.dumps({"environment": environment(), **payload}, indent=2))
    return path


def add_compare_option(parser) -> None:
    parser.add_argument(
        "--compare",
        metavar="RUN",
        default=None,
        help="diff this run against an earlier one: a JSON path, or the --label it was saved under",
    )


def load_run(name: str, ref: str | None) -> dict | None:
    """An earlier result of benchmark ``name``: ``ref`` is a JSON path or a ``--label`` (the
    ``--compare`` value; None when it was not given)."""
    if ref is None:
        return None
    path = Path(ref) if ref.endswith(".json") else RESULTS_DIR / f"{name}-{ref}.json"
    if not path.is_file():
        raise SystemExit(f"--compare {ref}: no earlier run at {path}")
    return json.loads(path.read_text())


def print_comparison(
    rows: list[dict] | dict[str, dict], before: dict, keys: list[str], fields: list[tuple[str, str]]
) -> None:
    """Each numeric ``fields`` entry (key, format) now, in the earlier run ``before`` (a loaded
    result JSON), and now / before, for the rows that match on ``keys``."""

    def as_list(r: list[dict] | dict[str, dict]) -> list[dict]:
        return list(r.values()) if isinstance(r, dict) else r

    old = {tuple(r.get(k) for k in keys): r for r in as_list(before.get("rows", []))}
    table, columns = [], [(k, k, "") for k in keys]
    for field, fmt in fields:
        columns += [(field, field, fmt), (f"{field}:before", "before", fmt), (f"{field}:ratio", "ratio", ".3f")]
    for r in as_list(rows):
        o = old.get(tuple(r.get(k) for k in keys))
        if o is None:
            continue
        entry = {k: r.get(k) for k in keys}
        for field, _ in fields:
            now, was = r.get(field), o.get(field)
            entry[field], entry[f"{field}:before"] = now, was
            numeric = isinstance(now, int | float) and isinstance(was, int | float)
            entry[f"{field}:ratio"] = now / was if numeric and was else None
        table.append(entry)
    when = before.get("environment", {}).get("time", "?")
    if not table:
        print(f"compared with the run of {when}: no rows in common")
        return
    print(f"compared with the run of {when} (ratio = now / before):")
    print_table(table, columns)


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """columns: (key, header, format spec)."""
    widths = [max([len(h), 10] + [len(format(r[k], f)) for r in rows if r.get(k) is not None]) for k, h, f in columns]
    print("  ".join(h.rjust(w) for (_, h, _), w in zip(columns, widths, strict=True)))
    for r in rows:
        cells = [format(r[k], f) if r.get(k) is not None else "-" for k, _, f in columns]
        print("  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)))
