"""Process groups from the ``torchrun`` environment as a 2-D ``DeviceMesh`` ("dp", "ep").

Ranks are laid out dp-major: rank = dp_index * ep_size + ep_index, so an expert-parallel
group is ``ep_size`` consecutive ranks. ``nccl`` on CUDA, ``gloo`` on CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass
class ParallelContext:
    """The mesh and the groups a training run needs (runtime objects: never in a config)."""

    mesh: DeviceMesh  # 2-D ("dp", "ep")
    dp_size: int
    ep_size: int
    world_mesh: DeviceMesh  # 1-D ("world",): every rank, for the non-expert FSDP shards

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return self.dp_size * self.ep_size

    @property
    def ep_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("ep")

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("dp")

    @property
    def device(self) -> torch.device:
        if self.mesh.device_type == "cuda":
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cpu")


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


def init_mesh(dp: int = 1, ep: int = 1, n_experts: int | None = None, backend: str | None = None) -> ParallelContext:
    """Initialise the default process group from the torchrun environment (if needed) and
    return the ("dp", "ep") mesh. Raises ``ValueError`` for a world size that is not dp * ep."""
    if not dist.is_initialized():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        check_sizes(world, dp, ep, n_experts)
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    check_sizes(dist.get_world_size(), dp, ep, n_experts)
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device_type, (dp, ep), mesh_dim_names=("dp", "ep"))
    world_mesh = init_device_mesh(device_type, (dp * ep,), mesh_dim_names=("world",))
    return ParallelContext(mesh, dp, ep, world_mesh)


def destroy() -> None:
    """Tear down the default process group (no-op when none is initialised)."""
    if dist.is_initialized():
        dist.destroy_process_group()
