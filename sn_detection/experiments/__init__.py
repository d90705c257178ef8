"""The sweeps that test the papers' claims at a scale a CPU can run, each a package of modules of one job:
``compare_norms`` (tools/compare_norms.py: a Mask R-CNN trained per norm setting and seed, from scratch or
finetuned, and its tables, CSV and plots) and ``pretrain_grid`` (tools/pretrain_grid.py: every norm's backbone
pretrained under a grid of recipes, into the backbone cache the finetune sweep reads). What both use: the
subprocesses they run ``--jobs`` at a time (``jobs``), the pretraining configs of their backbones, made one way
(``backbones``), and how their tables name a config and a wall time (``labels``).
"""
