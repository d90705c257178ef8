"""Real processes for the tests of collectives: each joins one gloo group on the CPU, and the suite never
waits on a collective that hangs."""

import time
from datetime import timedelta

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp


def join_group(rank, world_size, init_file):
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )


def leave_group():
    dist.barrier()  # without it, gloo's destroy_process_group sometimes hangs (torch 2.3)
    dist.destroy_process_group()


def run_processes(function, args, nprocs, timeout=120):
    """``function(rank, *args)`` in ``nprocs`` processes. An exception in one is raised here; processes still
    running after ``timeout`` seconds are killed and fail the test, so that a mismatched or hung collective
    fails one test instead of stalling the whole suite."""
    workers = mp.spawn(function, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + timeout
    while not workers.join(timeout=1):
        if time.monotonic() > deadline:
            for process in workers.processes:
                process.kill()
            pytest.fail(f"{nprocs} processes running {function.__name__} did not finish in {timeout} s")
