"""Every test of this folder needs Triton: where it does not import, each file is reported skipped without
being imported (so the files import ``triton`` like any other module)."""

import importlib

import pytest

try:
    importlib.import_module("triton")
    MISSING_TRITON = None
except ImportError as error:
    MISSING_TRITON = f"could not import 'triton': {error}"


class _WithoutTriton(pytest.Module):
    """A test file of this folder where Triton is missing: skipped at collection, never imported."""

    def collect(self):
        pytest.skip(MISSING_TRITON)


def pytest_pycollect_makemodule(module_path, parent):
    if MISSING_TRITON is not None:
        return _WithoutTriton.from_parent(parent, path=module_path)
    return None
