import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Small models on a shared 2-core machine: one thread, and bit-exact reductions for the resume test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
