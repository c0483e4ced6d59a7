"""One process is a parallel context of size 1 (as torchtitan's ``ParallelDims``): rank 0,
world size 1, a layout of "1 process", and every collective the identity; the training code
never asks whether it has a context at all."""

import ast
from pathlib import Path

import torch
import torch.distributed as dist

import mode
from mode.config import load_config
from mode.evaluation import rank_rows
from mode.parallel.apply import init_parallel
from mode.parallel.mesh import ONE_PROCESS, ParallelContext, mean_over_ranks, min_over_ranks_, sum_over_ranks


def test_one_process_is_a_context_of_size_one():
    ctx = ONE_PROCESS
    assert (ctx.distributed, ctx.rank, ctx.world_size, ctx.dp_size, ctx.ep_size) == (False, 0, 1, 1, 1)
    assert ctx.layout() == "1 process" and ctx.device == torch.device("cpu")
    assert rank_rows(6, ctx) == slice(0, 6)
    assert mean_over_ranks(2.5, ctx) == 2.5
    t, flags = torch.tensor([1.0, 2.0]), torch.tensor([1, 0])
    sum_over_ranks([t], ctx)
    min_over_ranks_(flags, ctx)
    assert t.tolist() == [1.0, 2.0] and flags.tolist() == [1, 0]


def test_init_parallel_without_torchrun_gives_one_process_on_the_configured_device(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = load_config("dense")
    cfg.train.device = "cpu"
    ctx = init_parallel(cfg)
    assert isinstance(ctx, ParallelContext) and not ctx.distributed
    assert ctx.device == torch.device("cpu") and not dist.is_initialized()


def test_no_module_asks_whether_it_has_a_context():
    """``ctx is None`` / ``if ctx else`` branches are gone: a module asks ``ctx.distributed``."""
    found = []
    for path in Path(mode.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(isinstance(o, ast.Is | ast.IsNot) for o in node.ops):
                names = [n for n in (node.left, *node.comparators) if isinstance(n, ast.Name | ast.Attribute)]
                if any(ast.unparse(n).split(".")[-1] == "ctx" for n in names):
                    found.append(f"{path.name}:{node.lineno}")
            if isinstance(node, ast.IfExp) and ast.unparse(node.test).split(".")[-1] == "ctx":
                found.append(f"{path.name}:{node.lineno}")
    assert not found, found
