"""Spawn real torch.distributed worker processes (gloo, CPU) for the tests."""

from __future__ import annotations

import os
import socket

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, world_size: int, port: int, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    from mode.parallel.mesh import destroy

    try:
        fn(rank, world_size, *args)
    finally:
        destroy()


# Workers fork from a server process that imported these once (per test process), instead of
# each starting a fresh interpreter that imports torch and mode again: ~2.5 s of CPU saved per
# worker. The server has only imported modules (no threads, no process group), so forking it
# is safe; every worker still runs in a process of its own with its own gloo group.
PRELOAD = ["torch", "torch.distributed.checkpoint", "torch.distributed.fsdp", "mode.train", "pytest"]
PRELOAD += ["tests.dist_utils"]


def run_workers(fn, world_size: int, *args) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; raises if any fails."""
    mp.set_forkserver_preload(PRELOAD)
    mp.start_processes(
        _entry, args=(fn, world_size, free_port(), args), nprocs=world_size, join=True, start_method="forkserver"
    )
