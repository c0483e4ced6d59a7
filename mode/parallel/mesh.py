"""Process groups from the ``torchrun`` environment as a 2-D ``DeviceMesh`` ("dp", "ep").

Ranks are laid out dp-major: rank = dp_index * ep_size + ep_index, so an expert-parallel
group is ``ep_size`` consecutive ranks. ``nccl`` on CUDA, ``gloo`` on CPU.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class ParallelContext:
    """The mesh and the groups a training run needs (runtime objects: never in a config).

    One process is a context of size 1, as torchtitan's ``ParallelDims`` is: no mesh, rank 0,
    world size 1, its device ``local_device``, and every collective here is the identity on
    it (``ONE_PROCESS`` where the device does not matter). ``distributed`` says whether there
    is a process group behind it.
    """

    mesh: DeviceMesh | None = None  # 2-D ("dp", "ep")
    dp_size: int = 1
    ep_size: int = 1
    world_mesh: DeviceMesh | None = None  # 1-D ("world",): every rank, for the non-expert FSDP shards
    local_device: torch.device | None = None  # one process's device (None: the CPU)

    @property
    def distributed(self) -> bool:
        return self.mesh is not None

    @property
    def rank(self) -> int:
        return dist.get_rank() if self.distributed else 0

    @property
    def world_size(self) -> int:
        return self.dp_size * self.ep_size

    @property
    def ep_group(self) -> dist.ProcessGroup:
        if not self.distributed:
            raise RuntimeError("one process has no expert-parallel group")
        return self.mesh.get_group("ep")

    @property
    def device(self) -> torch.device:
        if not self.distributed:
            return self.local_device or torch.device("cpu")
        if self.mesh.device_type == "cuda":
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cpu")

    def layout(self) -> str:
        """What a run's first line says of it: "dp 2 x ep 2", or "1 process"."""
        return f"dp {self.dp_size} x ep {self.ep_size}" if self.distributed else "1 process"


ONE_PROCESS = ParallelContext()


def check_sizes(world_size: int, dp: int, ep: int, n_experts: int | None = None) -> None:
    """ValueError naming the fix when the layout cannot work."""
    if dp < 1 or ep < 1:
        raise ValueError(f"parallel.dp_size={dp} and parallel.ep_size={ep} must be >= 1")
    if world_size != dp * ep:
        raise ValueError(
            f"world_size={world_size} must equal parallel.dp_size * parallel.ep_size = {dp} * {ep} = {dp * ep}: "
            f"launch with --nproc-per-node (x --nnodes) = {dp * ep}, or change the sizes"
        )
    if n_experts is not None and n_experts % ep:
        raise ValueError(f"model.moe.n_experts={n_experts} is not divisible by parallel.ep_size={ep}")


def init_mesh(
    dp: int = 1,
    ep: int = 1,
    n_experts: int | None = None,
    backend: str | None = None,
    timeout_s: float | None = None,
) -> ParallelContext:
    """Initialise the default process group from the torchrun environment (if needed) and
    return the ("dp", "ep") mesh. Raises ``ValueError`` for a world size that is not dp * ep.
    ``timeout_s``: how long a collective waits for the other ranks (torch's default when None)."""
    if not dist.is_initialized():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        check_sizes(world, dp, ep, n_experts)
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
        store = _restart_store(timeout)
        if store is None:
            dist.init_process_group(backend, timeout=timeout)
        else:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    check_sizes(dist.get_world_size(), dp, ep, n_experts)
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device_type, (dp, ep), mesh_dim_names=("dp", "ep"))
    world_mesh = init_device_mesh(device_type, (dp * ep,), mesh_dim_names=("world",))
    return ParallelContext(mesh, dp, ep, world_mesh)


def _restart_store(timeout: timedelta | None) -> dist.Store | None:
    """Under ``torchrun``: its store, with the keys of this restart attempt under a prefix of
    their own; None elsewhere (``env://`` as usual).

    NOTE: torch's ``env://`` rendezvous assumes the agent makes a new store for every restart
    and adds no prefix, but after ``torchrun --standalone --max-restarts`` restarts a killed
    worker's group, gloo reads the previous attempt's peer addresses and fails with
    "Connection refused" (torch 2.13; pytorch/pytorch#167288 for NCCL). One prefix per attempt
    (``TORCHELASTIC_RESTART_COUNT``) keeps the attempts apart.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or "MASTER_ADDR" not in os.environ:
        return None
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=not agent_hosts and rank == 0,
        timeout=timeout or timedelta(minutes=30),
        multi_tenant=not agent_hosts,
    )
    return dist.PrefixStore(f"mode/attempt_{attempt}", store)


def destroy() -> None:
    """Tear down the default process group (no-op when none is initialised).

    Unreachable FSDP2 modules are collected first: one freed after its process group (at
    interpreter exit) can abort the process ("terminate called without an active
    exception"), 3 times in 12 two-rank runs on gloo; drop your references to a sharded model
    before calling this."""
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def barrier(ctx: ParallelContext) -> None:
    """Wait for every rank (nothing to wait for in one process)."""
    if ctx.distributed:
        dist.barrier()


def mean_over_ranks(value: float, ctx: ParallelContext = ONE_PROCESS) -> float:
    """The mean of a host number over all ranks (itself in one process)."""
    if not ctx.distributed:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / ctx.world_size


def min_over_ranks_(t: torch.Tensor, ctx: ParallelContext) -> None:
    """In place: the elementwise minimum of ``t`` over all ranks (``t`` itself in one process)."""
    if ctx.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.MIN)


def sum_over_ranks(tensors: list[torch.Tensor], ctx: ParallelContext) -> None:
    """Sum each tensor over all ranks, in place, with one all-reduce per dtype (the tensors
    flattened into one buffer); nothing to do in one process."""
    if not ctx.distributed:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.all_reduce(flat)
        for t, part in zip(same, flat.split([t.numel() for t in same]), strict=True):
            t.copy_(part.view_as(t))
