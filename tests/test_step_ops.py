"""The GPU step's CPU proxies (``benchmarks/step_ops.py``): one training step of every preset
reads nothing on the host, and dispatches few ops next to nanoGPT's step. The counter itself
is checked on code whose syncs are known, so a zero means something."""

import pytest
import torch

from benchmarks.step_ops import BOUNDS, PRESETS, count_step
from mode.opcount import OpCounter


@pytest.mark.parametrize(
    "fn, n_syncs",
    [
        (lambda t: t.sum().item(), 1),
        (lambda t: t.tolist(), 1),
        (lambda t: t[t > 0], 1),  # boolean-mask indexing
        (lambda t: t.nonzero(), 1),
        (lambda t: torch.repeat_interleave(torch.arange(4), t.long().abs()), 1),
        (lambda t: torch.repeat_interleave(torch.arange(4), t.long().abs(), output_size=8), 0),
        (lambda t: torch.nonzero_static(t > 0, size=4), 0),
        (lambda t: bool(t.sum() > 0), 1),
        (lambda t: torch.where(t > 0, t, 0).sum(), 0),
    ],
    ids=[
        "item",
        "tolist",
        "bool-mask",
        "nonzero",
        "repeat_interleave",
        "repeat_interleave-sized",
        "nonzero_static",
        "bool()",
        "where",
    ],
)
def test_the_counter_sees_host_reads(fn, n_syncs):
    t = torch.tensor([1.0, -2.0, 3.0, 2.0])
    with OpCounter() as ops:
        fn(t)
    assert ops.syncs == n_syncs, ops.sync_sites()


def test_sync_sites_name_the_line():
    t = torch.ones(3)
    with OpCounter() as ops:
        t.sum().item()
    (site,) = ops.sync_sites()
    assert "_local_scalar_dense" in site and "test_step_ops.py" in site


@pytest.fixture(scope="module")
def counts():
    return {p: count_step(p) for p in ["nanogpt", *PRESETS]}


@pytest.mark.parametrize("preset", PRESETS)
def test_a_training_step_reads_nothing_on_the_host(counts, preset):
    assert counts[preset].syncs == 0, counts[preset].sync_sites()


@pytest.mark.parametrize("ratio", [r for r, (_, _, bound) in BOUNDS.items() if bound is not None])
def test_ops_per_step_within_bounds(counts, ratio):
    num, den, bound = BOUNDS[ratio]
    value = counts[num].total / counts[den].total
    assert value <= bound, f"{ratio} = {counts[num].total} / {counts[den].total} = {value:.3f} > {bound}"
