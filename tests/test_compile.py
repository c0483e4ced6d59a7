"""``train.compile``: every preset's blocks compiled one by one give the eager step's losses,
and after warm-up a step compiles nothing new (no recompiles, though the dropless MoE's
expert sizes and the routed token counts change every step)."""

import copy

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from mode.compile import compile_blocks
from mode.config import load_config
from mode.model import MoDETransformer
from mode.step import build_optimizer, train_step

PRESETS = ["dense", "mod", "moe", "moe_capacity", "mode_staged", "mode_integrated"]
SMALL = ["model.d_model=32", "model.n_heads=4", "model.n_layers=2", "model.seq_len=32", "model.moe.n_experts=4"]
WARMUP, AFTER = 3, 4


def compiled_graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_compiled_blocks_match_eager_and_stop_compiling_after_warmup(preset):
    torch._dynamo.reset()
    counters.clear()
    cfg = load_config(preset, SMALL)
    torch.manual_seed(0)
    eager = MoDETransformer(cfg.model)
    compiled = copy.deepcopy(eager)
    compile_blocks(compiled)
    opts = build_optimizer(eager, cfg.train), build_optimizer(compiled, cfg.train)
    gen = torch.Generator().manual_seed(1)
    after_warmup = None
    for step in range(WARMUP + AFTER):
        if step == WARMUP:
            after_warmup = compiled_graphs()
        x = torch.randint(0, 256, (4, 32), generator=gen)
        y = torch.randint(0, 256, (4, 32), generator=gen)
        torch.manual_seed(step)
        ref = train_step(eager, opts[0], x, y, grad_clip=1.0)
        torch.manual_seed(step)
        got = train_step(compiled, opts[1], x, y, grad_clip=1.0)
        torch.testing.assert_close(got.loss, ref.loss, atol=2e-4, rtol=2e-4, msg=f"step {step}")
        torch.testing.assert_close(got.aux, ref.aux, atol=2e-4, rtol=2e-3, msg=f"step {step}")
    assert after_warmup > 0, "nothing was compiled"
    assert compiled_graphs() == after_warmup, f"recompiled after warm-up: {dict(counters['recompiles'] or {})}"
