"""Checkpoints: one ``save`` / ``load`` for single-process and expert-parallel runs.

Two on-disk kinds, chosen by the run, read by the same ``load``:

- single process: one file (``ckpt.pt``, ``torch.save`` of model, optimizer, progress and
  config), readable with plain ``torch.load`` and memory-mapped by ``checkpoint_config``;
- under a process group: a ``torch.distributed.checkpoint`` (DCP) directory (``ckpt/``) of
  the FSDP2-sharded model and optimizer state (``{"model": ..., "optim": {param name:
  AdamW state}}``), each rank writing its shards. Expert weights (and their optimizer
  state) are saved as DTensors of the global shape ``[E, ...]`` placed ``[Shard(1) over dp,
  Shard(0) over ep]``, every other tensor as FSDP shards it, so a checkpoint loads into any
  other ``dp`` x ``ep`` layout, and into a plain single process (model and optimizer);
  progress + config sit in ``extra.pt``.

NOTE: two kinds rather than DCP for both: a single-process user gets one portable file
that ``torch.load`` reads without a process group, DCP's planner or a directory layout.

Loading never runs code from the file: every file is read with ``torch.load(...,
weights_only=True)`` (tensors and plain Python values only; our checkpoints hold nothing
else). A file that needs arbitrary unpickling is refused with ``CheckpointError`` saying
so; ``trust_file=True`` (never the default) loads it. A file cut short or not a checkpoint
is named in a ``CheckpointError``. Checkpoints carry ``format_version``
(``FORMAT_VERSION``); one written by a newer mode-moe is refused naming both versions.
Flipped bytes are caught too: a ``ckpt.pt`` keeps a CRC-32 of its tensors and values
(``digest``), a DCP directory the size and CRC-32 of every file (``checksums.json``), both
checked before anything is loaded; ``load_newest_good`` falls back to the newest older
checkpoint that passes (``train.keep_checkpoints``).

Both are atomic: written under a temporary name, flushed to disk (fsync), then renamed over
the last good checkpoint, so a crash mid-save leaves that one in place. Progress is the
step, the elapsed training time (the ``max_seconds`` budget's clock), and the torch and data
RNG states; routing state (aux-loss-free biases, predictor thresholds) is in the model's
buffers.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor, Shard

from mode.checks import is_file_name
from mode.config import Config, from_dict, to_dict
from mode.dcp_reader import SafeFileSystemReader, SafeLoadPlanner, read_metadata
from mode.parallel.expert_parallel import expert_parameters
from mode.parallel.mesh import ONE_PROCESS, ParallelContext

# Version of the checkpoint layout this code writes; it reads this one and older ones (0: the
# files written before the version was recorded, the same layout).
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint file that cannot be loaded safely: not a checkpoint, cut short, written
    by a newer mode-moe, or holding objects whose unpickling could run code."""


class CheckpointDamagedError(CheckpointError):
    """A checkpoint whose bytes are not what was written: cut short, a flipped byte, a file of
    it missing. Resuming moves such a checkpoint aside (``<name>.corrupt``) and says so."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, a lost mount); the last good one is
    left as it was."""


def read_file(path: str | Path, trust_file: bool = False, mmap: bool = False) -> dict:
    """The object saved in one checkpoint file (``ckpt.pt`` or a DCP directory's
    ``extra.pt``), read without running code from it unless ``trust_file``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint file at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=not trust_file, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path} holds objects other than tensors and plain Python values ({_first_line(e)}); loading it "
            "could run code stored in the file, so it was not loaded. If you trust where the file "
            "came from, pass trust_file=True"
        ) from e
    except Exception as e:  # noqa: BLE001  (zip reader, unpickler: each fails its own way on a bad file)
        size = path.stat().st_size
        raise CheckpointDamagedError(
            f"{path} ({size} bytes) is not a readable checkpoint: cut short or corrupted? ({e})"
        ) from e
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a mode-moe checkpoint")
    version = state.get("format_version", 0)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format version {version!r}; this mode-moe reads versions up to "
            f"{FORMAT_VERSION}: upgrade mode-moe to load it"
        )
    _refuse_unbacked_tensors(state, path)
    if "digest" in state and not mmap:
        expected = state.pop("digest")
        if _digest(state) != expected:
            raise CheckpointDamagedError(f"{path} fails its checksum: its bytes changed after it was written")
    return state


def _refuse_unbacked_tensors(obj: object, path: Path, key: str = "") -> None:
    """``CheckpointError`` naming the first tensor in ``obj`` (nested dicts, lists) that
    declares more elements than its file stores (a stride-0 or overlapping view: reading it
    whole would allocate what its shape says, not what the file holds)."""
    if isinstance(obj, torch.Tensor):
        need = obj.numel() * obj.element_size()
        have = obj.untyped_storage().nbytes()
        if need > have:
            raise CheckpointError(
                f"{path}: tensor {key or '(top level)'} declares shape {list(obj.shape)} ({need} bytes) but the file "
                f"stores {have} bytes for it (a stride-0 or overlapping view, not written by mode-moe): not loaded"
            )
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _refuse_unbacked_tensors(v, path, f"{key}.{k}" if key else str(k))
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            _refuse_unbacked_tensors(v, path, f"{key}[{i}]")


class TensorHeader(NamedTuple):
    """What a file declares of one tensor, read without its data."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def stored_weights(path: str | Path, trust_file: bool = False) -> dict[str, TensorHeader]:
    """``{parameter or buffer name: TensorHeader}`` of the model a checkpoint of either kind
    holds, from the file's headers (a ``ckpt.pt`` memory-mapped, a directory's ``.metadata``):
    no tensor's data is read."""
    path = Path(path)
    if path.is_dir():
        verify_directory(path, trust_file)
        try:
            entries = read_metadata(path).state_dict_metadata
        except pickle.UnpicklingError as e:
            raise CheckpointError(f"{path / '.metadata'} is refused ({e}): pass trust_file=True if you trust it") from e
        return {
            k.removeprefix("model."): TensorHeader(tuple(v.size), v.properties.dtype)
            for k, v in entries.items()
            if k.startswith("model.") and hasattr(v, "size")
        }
    model = read_file(path, trust_file, mmap=True).get("model")
    if not isinstance(model, dict):
        raise CheckpointError(f"{path} holds no model state dict ('model'): it was not written by mode-moe's save")
    return {k: TensorHeader(tuple(v.shape), v.dtype) for k, v in model.items() if isinstance(v, torch.Tensor)}


def check_weights(path: str | Path, expected: dict[str, torch.Tensor], stored: dict[str, TensorHeader]) -> None:
    """``CheckpointError`` unless ``stored`` (``stored_weights``) has exactly the names and
    shapes of ``expected`` (a model's state dict, real or on the meta device), and a floating
    dtype wherever the model's tensor is floating: the message says the config differs from
    the checkpoint and names the first differences."""
    problems = [f"{k} is missing from the file" for k in expected if k not in stored]
    problems += [f"{k} is in the file, not in the model" for k in stored if k not in expected]
    for k, t in expected.items():
        header = stored.get(k)
        if header is None:
            continue
        if tuple(t.shape) != header.shape:
            problems.append(f"{k} is {list(t.shape)} in the model, {list(header.shape)} in the file")
        elif t.is_floating_point() and not header.dtype.is_floating_point:
            problems.append(f"{k} is stored as {header.dtype}, not a floating dtype (it would be cast in silence)")
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointError(
            f"{path} does not hold this model's weights: {'; '.join(problems[:3])}{more}. The model's config "
            "differs from the checkpoint's: build the model from the checkpoint's own config "
            "(MoDETransformer.from_checkpoint, mode.checkpoint.checkpoint_config)"
        )


def _first_line(e: BaseException) -> str:
    """The first line of an exception's message (torch's carry C++ context below), or its type."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _digest(obj: object, crc: int = 0) -> int:
    """CRC-32 of every tensor's bytes and every other value's repr in ``obj`` (nested dicts,
    lists, tuples), in order."""
    if isinstance(obj, torch.Tensor):
        crc = zlib.crc32(repr((obj.dtype, tuple(obj.shape))).encode(), crc)
        flat = obj.detach().cpu().contiguous().reshape(-1)
        return zlib.crc32(flat.view(torch.uint8).numpy().data, crc)
    if isinstance(obj, dict):
        for k, v in obj.items():
            crc = _digest(v, zlib.crc32(repr(k).encode(), crc))
        return crc
    if isinstance(obj, list | tuple):
        for v in obj:
            crc = _digest(v, crc)
        return crc
    return zlib.crc32(repr(obj).encode(), crc)


def _file_crc(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _write_checksums(directory: Path) -> None:
    """``checksums.json``: size and CRC-32 of every file of a DCP checkpoint directory."""
    sums = {f.name: {"bytes": f.stat().st_size, "crc32": _file_crc(f)} for f in sorted(directory.iterdir())}
    (directory / "checksums.json").write_text(json.dumps(sums, indent=1))


def verify_directory(directory: str | Path, trust_file: bool = False) -> None:
    """``CheckpointDamagedError`` naming the first file of a DCP checkpoint directory whose
    size or CRC-32 differs from ``checksums.json`` (or that is missing). A directory without
    ``checksums.json`` (every one ``save`` writes has it) is refused unless ``trust_file``."""
    directory = Path(directory)
    listing = directory / "checksums.json"
    if not listing.is_file():
        if trust_file:
            return
        raise CheckpointError(
            f"{directory} has no checksums.json, so it was not written by mode-moe's save (or lost a file): "
            "not loaded. If you trust where the directory came from, pass trust_file=True"
        )
    try:
        sums = json.loads(listing.read_text(encoding="utf-8"))
        wanted = [(str(name), int(want["bytes"]), int(want["crc32"])) for name, want in sums.items()]
    except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError) as e:
        raise CheckpointDamagedError(f"{listing} is not a checksum listing ({_first_line(e)})") from e
    for name, size_written, crc_written in wanted:
        f = directory / name
        if not is_file_name(name):
            raise CheckpointError(f"{listing} names {name!r}, which is not a file name in {directory}")
        if not f.is_file():
            raise CheckpointDamagedError(f"{directory}: {name} is missing")
        size = f.stat().st_size
        if size != size_written:
            raise CheckpointDamagedError(f"{f} has {size} bytes, {size_written} when written: cut short or corrupted")
        if _file_crc(f) != crc_written:
            raise CheckpointDamagedError(f"{f} fails its checksum: its bytes changed after it was written (corrupted)")


class Progress(NamedTuple):
    """Where a run stands: optimizer steps taken and training seconds spent."""

    step: int
    elapsed: float = 0.0


def save(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    progress: Progress | None = None,
    cfg: Config | None = None,
    data_rng: torch.Generator | None = None,
    ctx: ParallelContext = ONE_PROCESS,
    keep: int = 1,
    warn: Callable[[str], None] = print,
) -> None:
    """Save model, optimizer, progress, RNG states and config atomically: one file in one
    process, else a DCP directory written by every rank of ``ctx``. With ``keep`` > 1
    the checkpoint it replaces stays as ``<path>.step<N>`` and the ``keep - 1`` newest of those
    are kept.

    Saving never depends on an old checkpoint being readable: one whose step cannot be read
    is moved aside as ``<name>.corrupt`` (said through ``warn``), and a history name already
    taken (a save killed half way) is replaced."""
    progress = progress or Progress(0)
    extra = {
        "format_version": FORMAT_VERSION,
        "step": progress.step,
        "elapsed": progress.elapsed,
        "rng": torch.get_rng_state(),
        "data_rng": data_rng.get_state() if data_rng is not None else None,
    }
    if cfg is not None:
        extra["config"] = to_dict(cfg)
    if ctx.distributed:
        save_sharded(path, model, ctx, extra, optimizer, keep, warn)
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict() if optimizer else None, **extra}
    state["digest"] = _digest(state)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.unlink(missing_ok=True)  # a killed save's leftover (or a link planted there: never followed)
        with open(tmp, "xb") as f:  # created exclusively: never written through a link
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as e:  # torch's writer reports a failed write as RuntimeError
        tmp.unlink(missing_ok=True)
        good = f"the last good checkpoint, {path}, is intact" if path.exists() else "no earlier checkpoint exists"
        free = shutil.disk_usage(path.parent).free
        raise CheckpointWriteError(
            f"could not write the checkpoint {path}: {_first_line(e)} ({free} bytes free on its filesystem); {good}"
        ) from e
    if keep > 1 and path.exists():
        _keep_in_history(path, warn)  # the old file stays reachable under its step
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    _prune_history(path, keep)


def load(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    data_rng: torch.Generator | None = None,
    ctx: ParallelContext = ONE_PROCESS,
    trust_file: bool = False,
) -> Progress:
    """Restore model (and optimizer, RNG states) from either kind; returns the progress.

    A DCP directory loads on any ``dp`` x ``ep`` layout, and into a single process
    (``ONE_PROCESS``), model and optimizer; the optimizer must be an AdamW over ``model``'s parameters.
    Files are read without running code from them (``read_file``; ``trust_file``).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    if path.is_dir():
        verify_directory(path, trust_file)
        return _restore(path, load_sharded(path, model, ctx, optimizer, trust_file), data_rng)
    state = read_file(path, trust_file)
    if not isinstance(state.get("model"), dict):
        raise CheckpointError(f"{path} holds no model state dict ('model'): it was not written by mode-moe's save")
    check_weights(
        path, model.state_dict(), {k: TensorHeader(tuple(v.shape), v.dtype) for k, v in state["model"].items()}
    )
    model.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    return _restore(path, state, data_rng)


def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    data_rng: torch.Generator | None = None,
    trust_file: bool = False,
) -> int:
    """``load`` in this process; returns the step to continue from. Public API on purpose
    (``docs/parallelism.md``): a user's own loop restores a ``mode-train`` checkpoint with it;
    ``mode.train`` uses ``load`` / ``load_newest_good``."""
    return load(path, model, optimizer, data_rng, trust_file=trust_file).step


def checkpoint_config(path: str | Path, trust_file: bool = False) -> Config:
    """The config a checkpoint was trained with (a ``ckpt.pt`` file or a ``ckpt/`` directory)."""
    path = Path(path)
    state = _progress_state(path, trust_file)
    if "config" not in state:
        raise ValueError(f"{path} holds no training config (it was not written by mode.train)")
    return from_dict(state["config"])


def _restore(path: Path, state: dict, data_rng: torch.Generator | None) -> Progress:
    """Restore the RNG states a checkpoint kept (a DCP one written outside mode.train may keep
    none) and return its progress (elapsed 0 for checkpoints written before it was saved);
    ``CheckpointError`` naming ``path`` for a step or elapsed time that is not one."""
    step, elapsed = state.get("step"), state.get("elapsed", 0.0)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{path}: step={step!r} is not a count of steps: it was not written by mode's save")
    if isinstance(elapsed, bool) or not isinstance(elapsed, int | float):
        raise CheckpointError(f"{path}: elapsed={elapsed!r} is not a number of seconds: the checkpoint is damaged")
    if state.get("rng") is not None:
        torch.set_rng_state(state["rng"])
    if data_rng is not None and state.get("data_rng") is not None:
        data_rng.set_state(state["data_rng"])
    return Progress(step, float(elapsed))


def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (POSIX; a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- the DCP directory kind ------------------------------------------------------------------
def _global_view(t: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """An expert tensor of this rank (its ep slice ``[E_l, ...]``, FSDP-sharded over dp along
    dim 1) as a DTensor of the global ``[E, ...]`` over the (dp, ep) mesh, sharing storage."""
    local = t.to_local() if isinstance(t, DTensor) else t
    shape = (t.shape[0] * ctx.ep_size, *t.shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, ctx.mesh, [Shard(1), Shard(0)], run_check=False, shape=shape, stride=stride)


def _expert_names(model: nn.Module, ctx: ParallelContext) -> set[str]:
    if ctx.ep_size == 1:
        return set()  # experts are whole on every rank (or FSDP-sharded like any weight)
    ids = {id(p) for p in expert_parameters(model)}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def sharded_state_dict(model: nn.Module, ctx: ParallelContext) -> dict[str, torch.Tensor]:
    """The model's state dict (FSDP2: DTensor shards) with expert shards as global DTensors;
    its tensors share storage with the model, so ``dcp.load`` into it loads the model."""
    experts = _expert_names(model, ctx)
    return {k: _global_view(v, ctx) if k in experts else v for k, v in model.state_dict().items()}


def optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, ctx: ParallelContext
) -> dict[str, dict[str, torch.Tensor]]:
    """``{parameter name: AdamW state}`` (tensors shared with the optimizer; expert state as
    global DTensors). A parameter without state yet gets AdamW's initial one (step 0, zero
    moments), so that a fresh optimizer has tensors for ``dcp.load`` to fill."""
    names = {id(p): n for n, p in model.named_parameters()}
    experts = _expert_names(model, ctx)
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not optimizer.state.get(p):
                zeros = torch.zeros_like(p, memory_format=torch.preserve_format)
                optimizer.state[p] = {"step": torch.zeros(()), "exp_avg": zeros, "exp_avg_sq": zeros.clone()}
            name = names[id(p)]
            out[name] = {
                k: _global_view(v, ctx) if name in experts and v.dim() else v for k, v in optimizer.state[p].items()
            }
    return out


def _dcp_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, ctx: ParallelContext) -> dict:
    """What a DCP checkpoint holds, as tensors sharing storage with the model and optimizer:
    ``dcp.save`` writes them, ``dcp.load`` fills them in place."""
    state = {"model": sharded_state_dict(model, ctx)}
    if optimizer is not None:
        state["optim"] = optimizer_state_dict(model, optimizer, ctx)
    return state


def save_sharded(
    path: str | Path,
    model: nn.Module,
    ctx: ParallelContext,
    extra: dict | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    keep: int = 1,
    warn: Callable[[str], None] = print,
) -> None:
    """Save the model and optimizer state (sharded) and ``extra`` (rank 0) atomically
    (``keep``, ``warn``: see ``save``)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0 and tmp.exists():
        shutil.rmtree(tmp)
    _barrier()
    dcp.save(_dcp_state(model, optimizer, ctx), checkpoint_id=str(tmp))
    if rank == 0 and extra is not None:
        torch.save(extra, tmp / "extra.pt")
    _barrier()
    if rank == 0:
        _write_checksums(tmp)
        for f in tmp.iterdir():
            with open(f, "rb") as handle:
                os.fsync(handle.fileno())
        # The last good checkpoint is moved aside (kept under its step when keep > 1), never
        # deleted before the new one is in place: a kill between the two renames leaves it.
        old = path.with_name(path.name + ".old")
        if path.exists() and old.exists():
            shutil.rmtree(old)  # a killed save's leftover: path is the newer, complete one
        if path.exists() and keep > 1:
            old = _history_name(path, warn)
        if path.exists():  # (still: _history_name moves an unreadable one aside)
            _make_room(old)
            path.replace(old)
        else:
            old = None
        tmp.replace(path)
        _fsync_dir(path.parent)
        if old is not None and keep == 1:
            shutil.rmtree(old)
        _prune_history(path, keep)
    _barrier()


def load_sharded(
    path: str | Path,
    model: nn.Module,
    ctx: ParallelContext,
    optimizer: torch.optim.Optimizer | None = None,
    trust_file: bool = False,
) -> dict:
    """Load a checkpoint saved by ``save_sharded`` into ``model`` (and ``optimizer``) on any
    dp x ep layout, in place; returns ``extra`` (read with ``read_file``)."""
    path = Path(path)
    extra = path / "extra.pt"
    state = read_file(extra, trust_file) if extra.exists() else {}
    if trust_file:
        dcp.load(_dcp_state(model, optimizer, ctx), checkpoint_id=str(path))
        return state
    try:
        metadata = read_metadata(path)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path / '.metadata'} could run code when read ({_first_line(e)}), so it was not loaded. "
            "If you trust where the directory came from, pass trust_file=True"
        ) from e
    except Exception as e:  # noqa: BLE001  (the unpickler fails its own way on a damaged file)
        raise CheckpointDamagedError(f"{path / '.metadata'} is not readable DCP metadata: {_first_line(e)}") from e
    del metadata  # checked; the reader reads it again the same way
    try:
        dcp.load(
            _dcp_state(model, optimizer, ctx), storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner()
        )
    except CheckpointException as e:
        rank, (cause, _) = next(iter(e.failures.items()))
        if isinstance(cause, pickle.UnpicklingError):
            raise CheckpointError(
                f"{path} holds an entry whose unpickling could run code (rank {rank}: {_first_line(cause)}), so it "
                "was not loaded. If you trust where the directory came from, pass trust_file=True"
            ) from None
        why = f"rank {rank}: {type(cause).__name__}: {_first_line(cause)}"
        raise CheckpointError(f"{path} could not be loaded ({why})") from None
    return state


def load_newest_good(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    data_rng: torch.Generator | None = None,
    ctx: ParallelContext = ONE_PROCESS,
    warn=print,
) -> tuple[Path, Progress] | None:
    """Load the newest checkpoint at ``path`` that passes its checks (``latest``, then the
    older ones ``keep`` > 1 left beside it, newest first), saying through ``warn`` which
    were skipped and why; None when there is none. ``CheckpointError`` when every one fails."""
    candidates = resume_candidates(path)
    errors = []
    rank = dist.get_rank() if dist.is_initialized() else 0
    for candidate in candidates:
        try:
            return candidate, load(candidate, model, optimizer, data_rng, ctx)
        except CheckpointDamagedError as e:
            errors.append(str(e))
            _barrier()  # every rank has tried it before rank 0 moves it
            if rank == 0 and candidate.exists():
                warn(f"checkpoint {candidate} skipped: {e}; moved aside to {move_aside(candidate).name}")
            _barrier()
        except CheckpointError as e:
            errors.append(str(e))
            warn(f"checkpoint {candidate} skipped: {e}")
    if errors:
        raise CheckpointError("no checkpoint at " + str(path) + " passes its checks: " + "; ".join(errors))
    return None


def resume_candidates(path: str | Path) -> list[Path]:
    """The checkpoints a resume at ``path`` tries, newest first: ``latest(path)``, then the
    older ones ``keep_checkpoints`` > 1 left beside it."""
    candidates = []
    first = latest(path)
    if first is not None:
        candidates.append(first)
    return candidates + [p for p in reversed(_history(Path(path))) if p not in candidates]


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def latest(path: str | Path) -> Path | None:
    """The checkpoint to resume from at ``path``: ``path`` itself, or, when a save was killed
    between moving the last good directory aside and renaming the new one in, that
    ``<path>.old`` directory or the newest ``<path>.step<N>``; None when there is none."""
    path = Path(path)
    if path.exists():
        return path
    old = path.with_name(path.name + ".old")
    if old.is_dir():
        return old
    history = _history(path)
    return history[-1] if history else None


def _progress_state(path: Path, trust_file: bool = False) -> dict:
    """The step, progress and config a checkpoint of either kind keeps (a ``ckpt.pt``'s whole
    state, memory-mapped so that its tensors are not read; a directory's ``extra.pt``)."""
    file = path / "extra.pt" if path.is_dir() else path
    return read_file(file, trust_file, mmap=True)


def _history_name(path: Path, warn: Callable[[str], None] = print) -> Path:
    """``<path>.step<N>``, N the step of the checkpoint at ``path``; when that cannot be read,
    the checkpoint is moved aside (``move_aside``) and its name is free again: ``path``."""
    try:
        return path.with_name(f"{path.name}.step{int(_progress_state(path)['step'])}")
    except (CheckpointError, OSError, KeyError, TypeError, ValueError) as e:
        aside = move_aside(path)
        warn(f"checkpoint {path} is unreadable ({_first_line(e)}): moved aside to {aside.name}")
        return path


def _keep_in_history(path: Path, warn: Callable[[str], None]) -> None:
    """Hard-link the file checkpoint at ``path`` as ``<path>.step<N>``, atomically replacing
    a file of that name (left by a save killed between its link and its rename)."""
    target = _history_name(path, warn)
    if target == path or (target.exists() and os.path.samefile(path, target)):
        return  # moved aside, or already kept
    for leftover in path.parent.glob(path.name + ".link*"):  # of saves killed at this point
        leftover.unlink()
    link = path.with_name(f"{path.name}.link{os.getpid()}")
    os.link(path, link)
    _make_room(target)
    os.replace(link, target)


def _make_room(target: Path) -> None:
    """Remove a directory at ``target`` (a rename cannot replace a non-empty one)."""
    if target.is_dir() and not target.is_symlink():
        shutil.rmtree(target)


def move_aside(path: Path) -> Path:
    """Rename a damaged checkpoint to ``<name>.corrupt`` (``.corrupt1``, ... when taken);
    returns the new name. Nothing is deleted."""
    for i in range(1000):
        aside = path.with_name(f"{path.name}.corrupt{i or ''}")
        if not aside.exists() and not aside.is_symlink():
            path.rename(aside)
            return aside
    raise CheckpointWriteError(f"{path}: 1000 .corrupt copies beside it already; remove them")


def _history(path: Path) -> list[Path]:
    """Older checkpoints kept beside ``path`` (``<name>.step<N>``), oldest first."""
    found = []
    for p in path.parent.glob(path.name + ".step*"):
        suffix = p.name[len(path.name) + len(".step") :]
        if suffix.isdigit():
            found.append((int(suffix), p))
    return [p for _, p in sorted(found)]


def kept_checkpoints(path: str | Path) -> list[tuple[int, Path]]:
    """(step, file) of a file checkpoint's history, oldest first: the ``<name>.step<N>`` files
    kept beside it (``train.keep_checkpoints`` > 1), then ``path`` itself."""
    path = Path(path)
    kept = [(int(p.name.rsplit(".step", 1)[1]), p) for p in _history(path)]
    return [*kept, (int(_progress_state(path)["step"]), path)]


def _prune_history(path: Path, keep: int) -> None:
    history = _history(path)
    for old in history[: max(0, len(history) - (keep - 1))]:
        shutil.rmtree(old) if old.is_dir() else old.unlink()
