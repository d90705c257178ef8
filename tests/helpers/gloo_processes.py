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
# how long the processes may take to start and join the group: spawning and importing torch, which a
# loaded machine slows by tens of seconds, count against this and not against the function's timeout
START_TIMEOUT = 300


def run_processes(function, args, nprocs, timeout=120):
    """``function(rank, *args)`` in ``nprocs`` processes that share one gloo group (the default process
    group). An exception in one is raised here with its traceback, whichever process the other ranks'
    consequent errors (a peer gone from a collective) reach torch's join first. Processes still running
    ``timeout`` seconds after every one of them joined the group (or ``START_TIMEOUT`` seconds after the
    spawn, if they have not all joined by then) are killed and fail the test with every thread's stack in
    each, so that a mismatched or hung collective fails one test, saying where, instead of stalling the
    suite."""
    with tempfile.TemporaryDirectory() as directory:
        workers = mp.spawn(_rank_main, args=(function, args, nprocs, directory), nprocs=nprocs, join=False)
        deadline, joined = time.monotonic() + START_TIMEOUT, False
        try:
            while not workers.join(timeout=1):
                if not joined and all(os.path.exists(_joined_file(directory, rank)) for rank in range(nprocs)):
                    deadline, joined = time.monotonic() + timeout, True
                if time.monotonic() > deadline:
                    stacks = _stacks_and_kill(workers.processes, directory)
                    waited = f"in {timeout} s" if joined else f"joining the group in {START_TIMEOUT} s"
                    pytest.fail(f"{nprocs} processes running {function.__name__} did not finish {waited}\n{stacks}")
        except mp.ProcessRaisedException as error:
            failures = [
                f"rank {rank}: {text}" for rank in range(nprocs) if (text := _read(_error_file(directory, rank)))
            ]
            if failures:
                raise RuntimeError(
                    f"{function.__name__} failed in {len(failures)} of {nprocs} processes:\n" + "\n".join(failures)
                ) from error
            raise


def _rank_main(rank, function, args, world_size, directory):
    stacks = open(_stacks_file(directory, rank), "w")  # open for the process's life: faulthandler writes to it
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    dist.init_process_group(
        "gloo", init_method=f"file://{directory}/init", rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT
    )
    open(_joined_file(directory, rank), "w").close()
    try:
        function(rank, *args)
    except BaseException:
        # printed now: the process may not get to report it (it is killed if another rank hangs); and
        # written for run_processes before this process leaves, which is when its peers fail too
        with open(_error_file(directory, rank), "w") as error:
            error.write(traceback.format_exc())
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


def _stacks_file(directory, rank):
    return os.path.join(directory, f"stacks{rank}.txt")


def _stacks_and_kill(processes, directory, wait=10):
    """Every thread's stack in each process still alive, which are then killed."""
    alive = {rank: process for rank, process in enumerate(processes) if process.is_alive()}
    for process in alive.values():
        os.kill(process.pid, signal.SIGUSR1)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and not all(_read_stacks(directory, rank) for rank in alive):
        time.sleep(0.1)
    time.sleep(0.5)  # a started dump finishes within the signal handler
    for process in alive.values():
        process.kill()
    return "\n".join(f"rank {rank}:\n{_read_stacks(directory, rank) or 'no stack: still starting'}" for rank in alive)


def _joined_file(directory, rank):
    return os.path.join(directory, f"joined{rank}.txt")


def _error_file(directory, rank):
    return os.path.join(directory, f"error{rank}.txt")


def _read(path):
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _read_stacks(directory, rank):
    return _read(_stacks_file(directory, rank))
