import pytest
import torch

from sn_detection.data.datasets import register_shapes_datasets


@pytest.fixture(scope="module", autouse=True)
def shapes_datasets_on_one_thread():
    """The embedded datasets registered, and torch on one thread: small in-process models on a shared
    2-core machine (tools run in subprocesses keep their own threads)."""
    register_shapes_datasets()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def sample_image(tmp_path_factory) -> str:
    """A PNG image for the export tool's --sample-image (``exported_models``)."""
    from exported_models import write_sample_image

    return write_sample_image(tmp_path_factory.mktemp("sample"))
