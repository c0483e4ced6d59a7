import os

import pytest
import torch

# Triton kernels run on CPU tensors under Triton's interpreter; the variable must be set before
# any kernel module is imported (``triton.jit`` reads it when it decorates).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Under pytest-xdist each worker gets its share of the cores: two workers with two intra-op
# threads each on two cores spin against each other (a float64 gradcheck took 7x as long).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


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
