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


def run_workers(fn, world_size: int, *args) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; raises if any fails."""
    mp.spawn(_entry, args=(fn, world_size, free_port(), args), nprocs=world_size, join=True)
