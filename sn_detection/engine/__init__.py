"""The training entry point used by tools/train_net.py (thin over detectron2's DefaultTrainer), and the
logic of the other tools, a module each.

The package's names below are imported from their modules when first asked for: the tools that need no
detectron2 (``count_launches``) run where it is not installed, as in the kernel-test environment.
"""

import importlib

_MODULE_OF = {"Trainer": "trainer", "load_cfg": "launch", "setup_cfg": "launch", "train_or_evaluate": "launch"}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__), name)
