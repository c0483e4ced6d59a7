"""One training step on real gloo ranks against one process, read where a constant scale or a
record made twice still shows: the gradients themselves (plain SGD, before AdamW can hide a
scale), the global-batch balance loss, and the raw routing records under activation
checkpointing."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from mode import checkpoint
from mode.config import load_config
from mode.experts.moe import MoELayer
from mode.model import MoDETransformer
from mode.parallel.apply import parallelize_model
from mode.parallel.mesh import ONE_PROCESS, init_mesh
from mode.step import train_step
from tests.dist_utils import run_workers
from tests.test_train_step import forward_backward_records
from tests.tiny import TINY_MODEL
from tests.tolerances import assert_close

pytestmark = pytest.mark.slow  # real gloo process groups

GEN = torch.Generator().manual_seed(11)
X = torch.randint(0, 256, (8, 32), generator=GEN)
Y = torch.randint(0, 256, (8, 32), generator=GEN)


def step_config(preset: str, dp: int = 1, ep: int = 1, *extra: str):
    return load_config(
        preset,
        [
            *TINY_MODEL,
            "model.moe.lb_scope=global_batch",
            "train.grad_clip=0",
            f"parallel.dp_size={dp}",
            f"parallel.ep_size={ep}",
            *extra,
        ],
    )


def rows_of(rank: int, world: int, n: int = len(X)) -> slice:
    return slice(rank * n // world, (rank + 1) * n // world)


def whole_weights(model: torch.nn.Module, ctx) -> dict[str, torch.Tensor]:
    """Every parameter as one whole tensor (experts gathered over ep, shards over dp); a
    collective under ``ctx``."""
    params = {n for n, _ in model.named_parameters()}
    state = checkpoint.sharded_state_dict(model, ctx)
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items() if k in params
    }


def sgd_gradients(model: torch.nn.Module, x, y, ctx=ONE_PROCESS) -> dict[str, torch.Tensor]:
    """The gradient ``train_step`` applies, as ``before - after`` of one plain SGD step with lr 1."""
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = whole_weights(model, ctx)
    torch.manual_seed(1)
    train_step(model, opt, x, y, ctx=ctx)
    after = whole_weights(model, ctx)
    return {k: before[k] - after[k] for k in before}


# Grouped-query attention, RMSNorm, a SwiGLU dense MLP, query/key biases and norms (the experts stay
# GELU: SwiGLU experts at init have gradients too small to show a mis-scaled one).
LLAMA_LIKE = [
    "model.norm=rmsnorm",
    "model.mlp=swiglu",
    "model.n_kv_heads=2",
    "model.qkv_bias=true",
    "model.qk_norm=true",
    "model.tie_embeddings=false",
]
GPT2_LIKE = ["model.mlp=gelu_tanh", "model.bias=true", "model.positions=learned"]


def gradient_worker(rank: int, world: int, dp: int, ep: int, root: str, arch: list[str]) -> None:
    cfg = step_config("mode_staged", dp, ep, *arch)
    ctx = init_mesh(dp, ep, cfg.model.moe.n_experts)
    torch.manual_seed(0)
    model = parallelize_model(MoDETransformer(cfg.model), cfg, ctx)
    grads = sgd_gradients(model, X[rows_of(rank, world)], Y[rows_of(rank, world)], ctx)
    if rank == 0:
        torch.save(grads, Path(root) / "grads.pt")


@pytest.mark.slow
@pytest.mark.parametrize("arch", [[], LLAMA_LIKE, GPT2_LIKE], ids=["default", "llama_like", "gpt2_like"])
def test_one_step_under_dp_and_ep_applies_the_one_process_gradient(tmp_path, arch):
    """Mutants: expert gradients left undivided by ep, or non-expert ones unaveraged over the
    world (AdamW's update hides a constant scale, so the loss curves barely show it)."""
    run_workers(gradient_worker, 4, 2, 2, str(tmp_path), arch)
    got = torch.load(tmp_path / "grads.pt")
    torch.manual_seed(0)
    want = sgd_gradients(MoDETransformer(step_config("mode_staged", 1, 1, *arch).model).train(), X, Y)
    assert got.keys() == want.keys()
    experts = [k for k in want if ".experts." in k]
    assert experts and all(want[k].abs().max() > 1e-4 for k in experts), "expert gradients too small to tell"
    for k in want:
        assert_close(got[k], want[k], "layer_grad", msg=k)


def balance_losses(model: torch.nn.Module) -> torch.Tensor:
    """The raw balance loss of every MoE layer's last forward, [n_layers]."""
    return torch.stack([m.metrics["lb_loss"] for m in model.modules() if isinstance(m, MoELayer)])


def skewed_batch() -> torch.Tensor:
    """Rank 0's rows are random text, rank 1's one byte repeated: their expert loads differ."""
    x = X.clone()
    x[len(x) // 2 :] = 101
    return x


def balance_worker(rank: int, world: int, root: str) -> None:
    cfg = step_config("moe", world, 1)
    ctx = init_mesh(world, 1, cfg.model.moe.n_experts)
    torch.manual_seed(0)
    model = parallelize_model(MoDETransformer(cfg.model), cfg, ctx).train()
    model(skewed_batch()[rows_of(rank, world)])
    lb = balance_losses(model).detach()
    dist.all_reduce(lb)
    if rank == 0:
        torch.save(lb / world, Path(root) / "lb.pt")


@pytest.mark.slow
def test_global_batch_balance_loss_is_the_loss_of_the_concatenated_tokens(tmp_path):
    """Mutant: ``lb_scope=global_batch`` silently falling back to each rank's own statistics."""
    run_workers(balance_worker, 2, str(tmp_path))
    got = torch.load(tmp_path / "lb.pt")
    torch.manual_seed(0)
    model = MoDETransformer(step_config("moe").model).train()
    x = skewed_batch()
    model(x)
    whole = balance_losses(model).detach()
    local = []
    for rank in range(2):
        model(x[rows_of(rank, 2)])
        local.append(balance_losses(model).detach())
    rank_local = torch.stack(local).mean(0)
    assert_close(got, whole, "reduction")
    assert (rank_local - whole).abs().min() > 1e-3, (rank_local, whole)  # the loads do differ


def records_worker(rank: int, world: int) -> None:
    records = {}
    ctx = init_mesh(1, world, 4)  # one mesh for both models
    for mode in ("none", "full"):
        cfg = step_config("mode_staged", 1, world, "model.moe.bias_rate=0.01", f"train.activation_checkpoint={mode}")
        torch.manual_seed(0)
        model = parallelize_model(MoDETransformer(cfg.model), cfg, ctx).train()
        records[mode] = forward_backward_records(model, X[rows_of(rank, world)], Y[rows_of(rank, world)])
    assert any(k.endswith("dispatch") for k in records["none"]) and any(k.endswith("pending") for k in records["none"])
    assert records["full"].keys() == records["none"].keys()
    for k, want in records["none"].items():
        assert want.abs().sum() > 0, k
        assert_close(records["full"][k], want, "exact", msg=f"rank {rank}: {k}")
    dist.barrier()  # no rank tears the group down while another still uses it


@pytest.mark.slow
def test_recomputed_forwards_record_nothing_under_expert_parallelism():
    """Mutant: the recompute guard lets activation checkpointing's re-run forward record the
    predictor's k-th scores, the expert load and the all-to-all counters a second time."""
    run_workers(records_worker, 2)
