"""Real processes for the tests of collectives: each joins one gloo group on the CPU, and the suite never
waits on a collective that hangs; when one does, the test's output shows where."""

import faulthandler
import os
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT = timedelta(seconds=60)


def run_processes(function, args, nprocs, timeout=120):
    """``function(rank, *args)`` in ``nprocs`` processes that share one gloo group (the default process
    group). An exception in one is raised here. Processes still running after ``timeout`` seconds print
    every thread's stack to stderr (pytest shows it with the failure) and are killed, failing the test, so
    that a mismatched or hung collective fails one test, saying where, instead of stalling the suite."""
    with tempfile.TemporaryDirectory() as directory:
        workers = mp.spawn(_rank_main, args=(function, args, nprocs, directory), nprocs=nprocs, join=False)
        deadline = time.monotonic() + timeout
        while not workers.join(timeout=1):
            if time.monotonic() > deadline:
                _dump_stacks_and_kill(workers.processes)
                pytest.fail(f"{nprocs} processes running {function.__name__} did not finish in {timeout} s")


def _rank_main(rank, function, args, world_size, directory):
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    dist.init_process_group(
        "gloo", init_method=f"file://{directory}/init", rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT
    )
    try:
        function(rank, *args)
    except BaseException:
        # printed now, as the process may not get to report it (it is killed if another rank hangs)
        traceback.print_exc()
        raise
    dist.barrier()  # no process leaves while another still talks to it
    # The process ends without tearing the group down. In torch 2.3 that can deadlock: a gloo worker
    # thread may still hold the last reference to a tensor of a finished collective (an all_gather's
    # outputs, say) and needs the GIL to free it, while ~ProcessGroupGloo joins that thread holding the
    # GIL (seen in destroy_process_group; a normal exit destroys the group too).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _dump_stacks_and_kill(processes):
    alive = [process for process in processes if process.is_alive()]
    for process in alive:
        os.kill(process.pid, signal.SIGUSR1)
    time.sleep(2)  # faulthandler writes from a signal handler; give it time before the kill
    for process in alive:
        process.kill()
