"""Count what one piece of PyTorch code dispatches: every aten op, and the sync-class ops
(those that read a device value on the host, or whose output shape depends on data), with the
Python line of this package that issued each.

On a GPU a sync-class op stops the host until the device has caught up, so the host cannot
queue the next kernels ahead of it; the number of ops dispatched is the number of kernel
launches to first order. Both are counted on the CPU, where they are exact and repeatable,
as proxies of the GPU step (``benchmarks/step_ops.py``, ``tests/test_step_ops.py``).

    with OpCounter() as ops:
        train_step(model, opt, x, y)
    ops.total, ops.syncs, ops.sync_sites()
"""

from __future__ import annotations

import traceback
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# Ops that make the host wait for a device value: they read it (`.item()`, `.tolist()`,
# `bool(t)`) or size their output by it. Boolean-mask indexing dispatches ``nonzero``;
# ``repeat_interleave`` with a tensor of repeats and no ``output_size`` sums the repeats on
# the host; ``bincount``'s length is ``max(input) + 1``.
SYNC_OPS = frozenset(
    {
        "aten._local_scalar_dense.default",
        "aten.nonzero.default",
        "aten.masked_select.default",
        "aten.unique.default",
        "aten._unique2.default",
        "aten.unique_dim.default",
        "aten.unique_consecutive.default",
        "aten.bincount.default",
        "aten.equal.default",
        "aten.is_nonzero.default",
        "aten.allclose.default",
        "aten.repeat_interleave.Tensor",
    }
)
# Ops that only describe tensors (views of metadata, no kernel on any device).
FREE_OPS = frozenset({"aten.detach.default", "aten.alias.default", "prim.device.default", "aten.sym_size.int"})

# Ops that return a view (or a dtype) and launch no kernel on a GPU: counted in ``total``,
# left out of ``kernels``.
VIEW_OPS = frozenset(
    f"aten.{name}"
    for name in (
        "view.default",
        "_unsafe_view.default",
        "t.default",
        "transpose.int",
        "permute.default",
        "unsqueeze.default",
        "squeeze.dim",
        "squeeze.default",
        "squeeze.dims",
        "select.int",
        "slice.Tensor",
        "expand.default",
        "unbind.int",
        "split.Tensor",
        "split_with_sizes.default",
        "as_strided.default",
        "_reshape_alias.default",
        "view_as.default",
        "reshape.default",
        "chunk.default",
        "narrow.default",
        "diagonal.default",
        "promote_types.default",
        "result_type.Tensor",
        "result_type.Scalar",
        "flatten.using_ints",
    )
)

_PACKAGE = str(Path(__file__).resolve().parent)


def _is_sync(func, args, kwargs) -> bool:
    name = str(func)
    if name in SYNC_OPS:
        if name == "aten.repeat_interleave.Tensor":
            return kwargs.get("output_size") is None and (len(args) < 2 or args[1] is None)
        return True
    if name.startswith("aten.index.Tensor") or name.startswith("aten.index_put"):
        # Boolean masks as indices: the op finds the True positions on the host.
        indices = args[1] if len(args) > 1 else []
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)
    return False


def _our_frames(limit: int = 3) -> str:
    """The innermost ``limit`` frames of this repository's Python code (package, benchmarks,
    tests), innermost first, as ``file.py:line``."""
    root = str(Path(_PACKAGE).parent)
    frames = [
        f
        for f in traceback.extract_stack()
        if f.filename.startswith(root) and "site-packages" not in f.filename and f.filename != __file__
    ]
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames[-limit:])) or "?"


# Tensor methods that copy values to the host without an aten op that says so on the CPU
# (``tolist`` and ``numpy`` read the memory directly there; on a GPU they copy and wait).
HOST_READ_METHODS = frozenset({"tolist", "numpy"})


class _Dispatches(TorchDispatchMode):
    def __init__(self, counter: OpCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if name not in FREE_OPS:
            self.counter.by_op[name] += 1
            if _is_sync(func, args, kwargs):
                self.counter._sync_sites[f"{name.removeprefix('aten.')} at {_our_frames()}"] += 1
        return func(*args, **kwargs)


class _HostReads(TorchFunctionMode):
    def __init__(self, counter: OpCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READ_METHODS:
            self.counter._sync_sites[f"Tensor.{name} at {_our_frames()}"] += 1
        return func(*args, **(kwargs or {}))


class OpCounter:
    """Counts the aten ops run inside it (``total``, ``by_op``) and the sync-class ops
    (``syncs``, with the Python site of each in ``sync_sites()``): the ops of ``SYNC_OPS``,
    boolean-mask indexing, and ``Tensor.tolist`` / ``Tensor.numpy``.

    Ops run by autograd in ``backward`` are seen too; the ops inside a custom op
    (``torch.library``) count as that one op. Metadata-only ops (``FREE_OPS``) are left out
    of ``total``."""

    def __init__(self) -> None:
        self.by_op: Counter[str] = Counter()
        self._sync_sites: Counter[str] = Counter()
        self._modes = (_HostReads(self), _Dispatches(self))

    def __enter__(self) -> OpCounter:
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)

    @property
    def total(self) -> int:
        """Ops dispatched (metadata-only ops aside)."""
        return sum(self.by_op.values())

    @property
    def kernels(self) -> int:
        """Ops that compute (``total`` less the view ops of ``VIEW_OPS``): to first order the
        kernels a GPU would launch in eager mode."""
        return sum(n for op, n in self.by_op.items() if op not in VIEW_OPS)

    @property
    def syncs(self) -> int:
        """Sync-class ops dispatched."""
        return sum(self._sync_sites.values())

    def sync_sites(self) -> dict[str, int]:
        """``"op at file.py:line <- caller.py:line" -> count``, most frequent first."""
        return dict(self._sync_sites.most_common())
