"""Training and evaluation as detectron2's ``engine`` means them: the trainer (``trainer``, thin over
DefaultTrainer, and ``resume``), the processes (``launch``), the entry points of tools/train_net.py and
tools/lazyconfig_train_net.py (``train_net``, ``lazy``), a trained model loaded back (``trained``), drawn
(``demo``), exported (``export``) and what its norms chose reported (``analyze_norms``, for
tools/analyze_norms.py), the command line of tools/pretrain_backbone.py (``pretrain_backbone``), and the
command-line types every tool shares (``arguments``).

The package's names below are imported from their modules when first asked for: ``arguments`` serves tools
that run where detectron2 is not installed (``tools/count_launches.py``, in the kernel-test environment).
"""

import importlib

_MODULE_OF = {"Trainer": "trainer", "load_cfg": "launch", "setup_cfg": "launch", "train_or_evaluate": "launch"}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__), name)
