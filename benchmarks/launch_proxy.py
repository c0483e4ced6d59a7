"""Kernel launches of compiled PyTorch code, counted on a CPU: a proxy of what a GPU step
launches.

``torch.compile`` is told to generate Triton kernels for the CPU (inductor's
``cpu_backend = "triton"``, the scheduling and fusion it uses on a GPU), and Triton runs them
under its CPU interpreter (``TRITON_INTERPRET=1``). ``LaunchCounter`` then counts, inside its
``with`` block, from the profiler's tree of recorded calls:

- ``triton``: Triton kernels launched (each compiled kernel call);
- ``extern``: aten ops that compute, called from compiled code (matrix products, attention,
  the fallbacks inductor does not generate code for);
- ``eager``: aten ops that compute outside every compiled region (embedding, loss, clipping,
  optimizer, routing state updates when they are not compiled).

"Ops that compute" are the leaves of the profiler's aten call tree, less views and
allocations (``NO_KERNEL``): to first order one GPU kernel each; an op that loops over ops on
the CPU but is one kernel on a GPU (``ONE_LAUNCH_PREFIXES``: foreach, fused optimizers, the
grouped GEMM) is one. ``launches`` is the sum. First-order means: an aten op that calls
others and also runs its own kernel (``nll_loss_backward``: ``zero_`` then its kernel) is
counted by its children only; ``gpu_check.sh`` sets the CUDA profiler's count beside it.

Four stand-ins, because Triton 3.x has no CPU driver: ``interpret()`` sets the environment
before Triton is imported, gives inductor a constant backend hash (it would ask a GPU driver
for one), passes 0-dim tensors to kernels as tensors (as on a GPU; inductor makes CPU ones
scalars, which the interpreter mishandles), and replaces the ``libdevice`` math functions
(``rsqrt``, ``erf``, ``pow``, ..., which the interpreter does not implement) by their numpy
equivalents. Values are right; only
the launch count is the point. Call ``interpret()`` first, before ``torch.compile`` runs.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from types import SimpleNamespace

_NUMPY_LIBDEVICE = {
    # name: (numpy function name or callable, result is boolean)
    "rsqrt": (lambda np, a: 1.0 / np.sqrt(a), False),
    "sqrt": ("sqrt", False),
    "exp": ("exp", False),
    "exp2": ("exp2", False),
    "expm1": ("expm1", False),
    "log": ("log", False),
    "log2": ("log2", False),
    "log10": ("log10", False),
    "log1p": ("log1p", False),
    "sin": ("sin", False),
    "cos": ("cos", False),
    "tan": ("tan", False),
    "asin": ("arcsin", False),
    "acos": ("arccos", False),
    "atan": ("arctan", False),
    "sinh": ("sinh", False),
    "cosh": ("cosh", False),
    "tanh": ("tanh", False),
    "fast_tanhf": ("tanh", False),
    "asinh": ("arcsinh", False),
    "acosh": ("arccosh", False),
    "atanh": ("arctanh", False),
    "atan2": ("arctan2", False),
    "pow": ("power", False),
    "fmod": ("fmod", False),
    "hypot": ("hypot", False),
    "copysign": ("copysign", False),
    "nextafter": ("nextafter", False),
    "ldexp": (lambda np, a, b: np.ldexp(a, b.astype(np.int32)), False),
    "floor": ("floor", False),
    "ceil": ("ceil", False),
    "trunc": ("trunc", False),
    "nearbyint": ("rint", False),
    "llrint": (lambda np, a: np.rint(a).astype(np.int64), False),
    "erf": (lambda np, a: np.vectorize(math.erf, otypes=[a.dtype])(a), False),
    "erfc": (lambda np, a: np.vectorize(math.erfc, otypes=[a.dtype])(a), False),
    "lgamma": (lambda np, a: np.vectorize(math.lgamma, otypes=[a.dtype])(a), False),
    "isnan": ("isnan", True),
    "isinf": ("isinf", True),
    "signbit": ("signbit", True),
}


def _numpy_libdevice():
    """A stand-in for Triton's ``libdevice`` under the interpreter: each function applies the
    numpy equivalent to the interpreter's numpy-backed tensors."""
    import numpy as np  # noqa: PLC0415
    import triton.language as tl  # noqa: PLC0415
    from triton.runtime.interpreter import TensorHandle  # noqa: PLC0415

    def make(name: str, fn, boolean: bool):
        op = getattr(np, fn) if isinstance(fn, str) else (lambda *a: fn(np, *a))

        def call(*args, **_):
            tensors = [a for a in args if isinstance(a, tl.tensor)]
            dtype = tensors[0].dtype.scalar if tensors else tl.float32
            data = [a.handle.data if isinstance(a, tl.tensor) else np.asarray(a) for a in args]
            out = np.asarray(op(*data))
            if boolean:
                out_dtype = tl.int1
            elif out.dtype == np.int64:
                out_dtype = tl.int64
            else:
                out_dtype = dtype
                out = out.astype(data[0].dtype, copy=False)
            return tl.tensor(
                TensorHandle(out, out_dtype), out_dtype if not out.shape else tl.block_type(out_dtype, list(out.shape))
            )

        call.__name__ = name
        return call

    return SimpleNamespace(**{name: make(name, fn, b) for name, (fn, b) in _NUMPY_LIBDEVICE.items()})


_INTERPRETING = False
# Names the compile cache of the stand-ins: bump it when they change the generated code.
PROXY_VERSION = 1


def interpret() -> None:
    """Make ``torch.compile`` generate Triton kernels for the CPU and run them under Triton's
    interpreter (see the module docstring). Idempotent; raises when Triton was imported
    before without the interpreter (the choice is read at import)."""
    global _INTERPRETING
    if _INTERPRETING:
        return
    import sys  # noqa: PLC0415

    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("interpret(): Triton was imported without TRITON_INTERPRET=1; call interpret() first")
    os.environ["TRITON_INTERPRET"] = "1"
    # Its own compile cache: the stand-ins below change the generated code, which the cache
    # keys do not see.
    import tempfile  # noqa: PLC0415

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"mode-launch-proxy-v{PROXY_VERSION}-{os.getuid()}"
    )
    import warnings  # noqa: PLC0415

    import torch._inductor.config as inductor_config  # noqa: PLC0415
    import torch.utils._triton as torch_triton  # noqa: PLC0415
    from torch._inductor.graph import GraphLowering  # noqa: PLC0415
    from torch._inductor.runtime import triton_helpers  # noqa: PLC0415
    from torch._inductor.scheduler import Scheduler  # noqa: PLC0415

    warnings.filterwarnings("ignore", message="Could not find an active CPU backend")  # the interpreter is one
    inductor_config.cpu_backend = "triton"
    # 0-dim tensors stay tensors (a pointer argument), as a GPU's 0-dim tensors do: inductor
    # passes CPU ones to a kernel as scalars, which the interpreter mishandles.
    # (dynamo's own 0-dim inputs, unspecialized Python numbers, do not occur: it specializes
    # floats, and makes varying ints symbols.)
    Scheduler.update_zero_dim_cpu_tensor = lambda self: None
    GraphLowering.is_unspec_arg = lambda self, name: False
    torch_triton.triton_hash_with_backend = lambda: "TRITON-INTERPRETER"
    triton_helpers.libdevice = _numpy_libdevice()
    _mark_kernel_launches()
    _INTERPRETING = True


KERNEL_MARK = "triton_launch::"


def _mark_kernel_launches() -> None:
    """Wrap each launch of an inductor Triton kernel in a profiler mark naming it (under the
    interpreter inductor records none)."""
    import torch  # noqa: PLC0415
    from torch._inductor.runtime import triton_heuristics  # noqa: PLC0415

    run = triton_heuristics.CachingAutotuner.run
    if getattr(run, "_marks_launches", False):
        return

    def marked_run(self, *args, **kwargs):
        name = self.inductor_meta.get("kernel_name", "triton")
        with torch.profiler.record_function(KERNEL_MARK + name):
            return run(self, *args, **kwargs)

    marked_run._marks_launches = True
    triton_heuristics.CachingAutotuner.run = marked_run


# aten ops that launch no kernel on a GPU: views, metadata, allocations.
NO_KERNEL = frozenset(
    f"aten::{name}"
    for name in (
        "empty",
        "empty_strided",
        "empty_like",
        "new_empty",
        "new_empty_strided",
        "resize_",
        "view",
        "_unsafe_view",
        "reshape",
        "_reshape_alias",
        "as_strided",
        "t",
        "transpose",
        "permute",
        "unsqueeze",
        "squeeze",
        "select",
        "slice",
        "expand",
        "expand_as",
        "unbind",
        "split",
        "split_with_sizes",
        "chunk",
        "narrow",
        "diagonal",
        "alias",
        "detach",
        "detach_",
        "lift_fresh",
        "view_as",
        "flatten",
        "unflatten",
        "set_",
        "result_type",
        "is_nonzero",
        "_has_compatible_shallow_copy_type",
        "set_requires_grad",
        "requires_grad_",
        "_to_copy_noop",
        "contiguous",
        "to",
        "_local_scalar_dense",
        "item",
        "lift",
        "is_same_size",
        "resolve_conj",
        "resolve_neg",
        "conj",
    )
)
# Profiler marks of a compiled region: dynamo's frame, aot_autograd's forward and backward,
# inductor's graph call.
COMPILED_MARKS = ("Torch-Compiled Region", "CompiledFunction", "Call CompiledFxGraph")
# Ops that are one launch on a GPU and a loop of ops on the CPU: multi-tensor ops (one launch
# per ~hundred tensors, ``multi_tensor_apply``) and the grouped GEMM (one kernel for every
# expert; the CPU runs one ``mm`` per group).
ONE_LAUNCH_PREFIXES = ("aten::_foreach_", "aten::_fused_", "aten::_grouped_mm")


class LaunchCounter:
    """Counts kernel launches inside its ``with`` block (see the module docstring):
    ``triton``, ``extern``, ``eager``, ``launches``, and ``by_name`` (kernel or op name ->
    launches), ``eager_ops`` (the eager ones by op). Call ``interpret()`` before compiling."""

    def __init__(self) -> None:
        self.triton = self.extern = self.eager = 0
        self.by_name: Counter[str] = Counter()
        self.eager_ops: Counter[str] = Counter()

    @property
    def launches(self) -> int:
        return self.triton + self.extern + self.eager

    def __enter__(self) -> LaunchCounter:
        import torch  # noqa: PLC0415

        self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._prof.__exit__(*exc)
        if exc[0] is None:
            self._count(self._prof.events())

    def _count(self, events) -> None:
        for event in events:
            if event.cpu_parent is None:
                self._visit(event, False)

    def _visit(self, event, compiled: bool) -> int:
        """Count the launches under ``event`` and return how many: a Triton mark is one, an
        aten op that computes and has no launch below it is one (matrix products call
        ``resize_`` or ``empty`` inside: they still launch)."""
        name = event.name
        if name.startswith(KERNEL_MARK):
            self.triton += 1
            self.by_name[name.removeprefix(KERNEL_MARK)] += 1
            return 1  # what the interpreter runs inside is no launch
        compiled = compiled or any(mark in name for mark in COMPILED_MARKS)
        if name.startswith(ONE_LAUNCH_PREFIXES):
            below = 0
        else:
            below = sum(self._visit(child, compiled) for child in event.cpu_children)
        if below or not name.startswith("aten::") or name in NO_KERNEL:
            return below
        if compiled:
            self.extern += 1
        else:
            self.eager += 1
            self.eager_ops[name] += 1
        self.by_name[name] += 1
        return 1
