"""The harness of the multi-process tests (tests/helpers/gloo_processes.py): the processes share a group
and leave cleanly, a failure on one rank fails the test with its reason, and a hung collective fails it
with every process's stack."""

import time

import pytest
import torch
import torch.distributed as dist
from gloo_processes import run_processes


def _sum_of_ranks(rank):
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    assert total.item() == 1.0


def _rank_1_fails(rank):
    assert rank == 0, "rank 1 refuses"


def _rank_1_skips_a_collective(rank):
    if rank == 0:
        dist.all_reduce(torch.ones(1))
    else:
        time.sleep(60)


def test_processes_share_one_group_and_leave_it():
    run_processes(_sum_of_ranks, (), nprocs=2)


def test_a_failing_rank_fails_the_test_with_its_reason():
    """Rank 0 fails too, in its barrier, when rank 1 leaves; what is raised is rank 1's own failure,
    whichever of the two torch's join sees first."""
    with pytest.raises(
        RuntimeError, match="(?s)failed in 1 of 2 processes:\nrank 1: Traceback .*AssertionError: rank 1 refuses"
    ):
        run_processes(_rank_1_fails, (), nprocs=2)


def test_a_hung_collective_fails_the_test_and_shows_where():
    with pytest.raises(pytest.fail.Exception, match="did not finish in 8 s") as failure:
        run_processes(_rank_1_skips_a_collective, (), nprocs=2, timeout=8)
    rank_0, rank_1 = str(failure.value).split("rank 0:\n")[1].split("rank 1:\n")
    assert "in all_reduce" in rank_0 and "in _rank_1_skips_a_collective" in rank_1
