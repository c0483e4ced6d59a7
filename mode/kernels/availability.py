"""Where the Triton kernels can run, without importing Triton until asked."""

from __future__ import annotations

import importlib.util
import os

import torch

INSTALL_HINT = "pip install triton (Linux; CUDA builds of torch ship it)"


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1``: Triton's interpreter runs kernels on CPU tensors
    (slowly, with numpy); that is how the tests run them on machines without a GPU."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_missing_reason() -> str | None:
    """Why Triton cannot be imported (with what to install), or None when it can."""
    try:
        found = importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a broken install, or an import blocked in sys.modules
        found = False
    return None if found else f"Triton is not installed: {INSTALL_HINT}"


def triton_unavailable_reason(device: torch.device | str) -> str | None:
    """Why the Triton kernels cannot run on ``device``, or None when they can: Triton must be
    importable, and the device must be CUDA, or the CPU under ``TRITON_INTERPRET=1``."""
    device = torch.device(device)
    missing = triton_missing_reason()
    if missing is not None:
        return missing
    if device.type == "cuda" or (device.type == "cpu" and interpreting()):
        return None
    return (
        f"Triton kernels run on CUDA devices, not {device.type} "
        "(on CPU only under TRITON_INTERPRET=1, Triton's interpreter for tests)"
    )
