"""Where the tests of this folder run, decided once for every file, at collection, before a file is imported:

- every file needs Triton: where it does not import, each file is reported skipped (so the files import
  ``triton`` like any other module);
- every file but those of ``WITHOUT_KERNELS`` runs the package's kernels, so it needs somewhere to run them:
  a CUDA GPU, or the CPU under Triton's interpreter (``TRITON_INTERPRET=1``) of Triton 3 or newer (the
  reference stack's Triton 2.3.1 interprets no plain row reduction). Elsewhere (the reference stack's
  ``pytest tests``) each is reported skipped, with the reason.

A file with a narrower need (CUDA only, the interpreter only) states it in a skip of its own."""

import importlib
import os

import pytest

# the files that test the launch machinery and the switches themselves, with or without a place to run kernels
WITHOUT_KERNELS = frozenset({"test_kernel_launch.py", "test_kernel_switches.py"})


def _missing_triton():
    try:
        importlib.import_module("triton")
    except ImportError as error:
        return f"could not import 'triton': {error}"
    return None


def _missing_kernel_runner():
    import torch
    import triton

    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        if int(triton.__version__.split(".")[0]) < 3:
            return f"the interpreter of Triton {triton.__version__} cannot run these kernels"
        return None
    if not torch.cuda.is_available():
        return "Triton kernels need a CUDA GPU, or TRITON_INTERPRET=1 on the CPU"
    return None


MISSING_TRITON = _missing_triton()
MISSING_KERNEL_RUNNER = None if MISSING_TRITON else _missing_kernel_runner()


class _Skipped(pytest.Module):
    """A test file of this folder that cannot run here: skipped at collection, never imported."""

    reason: str = ""

    def collect(self):
        pytest.skip(self.reason)


def pytest_pycollect_makemodule(module_path, parent):
    reason = MISSING_TRITON or (None if module_path.name in WITHOUT_KERNELS else MISSING_KERNEL_RUNNER)
    if reason is None:
        return None
    module = _Skipped.from_parent(parent, path=module_path)
    module.reason = reason
    return module
