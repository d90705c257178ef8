"""Measurements to run by hand, one module per tool: the layers' time and memory (``norms``,
``tools/benchmark_norms.py``), their kernel launches and host time (``launch_counts``,
``tools/count_launches.py``, and the counting the kernel tests hold the layers to), Triton's ordinary launch
path against the direct one (``launch_paths``, ``tools/benchmark_launch.py``), a detector's training step and
inference per norm (``train``, ``tools/benchmark_train.py``) and a pretraining step per norm (``pretrain``,
``tools/benchmark_pretrain.py``); the interleaved rounds they share (``timing``) and another commit's layers
timed beside this one's (``baseline``).

Nothing is imported here: ``launch_counts`` runs where detectron2 is not installed, as in the kernel-test
environment.
"""
