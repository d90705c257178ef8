"""Learned and adaptive normalization layers as first-class detectron2 norm types.

With detectron2 installed, importing this package registers ``SNMetaArch``, the meta-architecture that
builds every norm name of ``sn_detection.layers`` with the options of the config
(``sn_detection.d2.meta_arch``); without it, the pure-PyTorch layers still import.

The package's rooms, from the top down: its subpackages, ``model_zoo.py`` and this file (``__init__``).
A room imports only rooms on the lines below its own, imports inside functions included, and the rooms of
one line import nothing of each other; layers and data, at the ground, import nothing of the package
(``tests/test_imports.py`` reads this list and checks every module's imports against it):

    experiments
    benchmarks
    engine, model_zoo
    pretraining, __init__
    d2
    analysis, conversion
    layers, data

So the command lines that load a config live in ``engine`` (``analyze_norms``, ``pretrain_backbone``,
beside ``train_net``), ``d2`` calls ``analysis`` for its norm-analysis hook, and the ``PRETRAIN`` keys are
pretraining's own, which the engine's ``load_cfg`` adds beside d2's.
"""

import importlib.util

__version__ = "0.1.0"

if importlib.util.find_spec("detectron2") is not None:
    from . import d2  # noqa: F401  registers SNMetaArch
