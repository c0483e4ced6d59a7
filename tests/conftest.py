import os

import pytest
import torch

# Triton kernels run on CPU tensors under Triton's interpreter; the variable must be set before
# any kernel module is imported (``triton.jit`` reads it when it decorates).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (this machine has none): run benchmarks/gpu_check.sh on one")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
