"""tools/compare_norms.py: the same CPU-sized Mask R-CNN trained from scratch once per norm setting and
seed, evaluated (COCO box and mask AP), and the results written as a table, a CSV and plots.

The sweep in modules of one job each: ``plan`` (the settings, the runs and their folders, the estimate),
``run`` (the backbones it lacks, then the runs, as subprocesses: ``sn_detection.experiments.jobs``),
``runs`` (what is read from a run's folder), ``report`` and ``plots`` (the tables, CSV and figures),
``publish`` (the files written), ``cli`` (the command line).

Choices:

- **A subprocess of tools/train_net.py per run**, not an in-process call: every run starts from a fresh
  interpreter, so nothing carries over between runs (detectron2's catalogs, loggers and event storage,
  our norm options, allocator state, RNGs), a crash or an out-of-memory kill loses that run only, and a
  run is exactly the train_net command recorded in its folder (``sweep_run.json``), reproducible by hand.
  The price, a few seconds of start-up per run, is small next to minutes of training.
- **Runs one at a time, or ``--jobs N`` at a time** with the intra-op threads split between them
  (``OMP_NUM_THREADS``: the environment's, else the usable cores, divided by N). One run of these small
  models does not keep several cores busy (its ops are too small to split well), so on a machine with
  few cores, runs side by side on a share of the threads each finish more runs per hour.
- **Settings**: ``NORM`` puts one norm in the backbone, FPN and both heads; ``BACKBONE/HEAD`` puts
  ``HEAD`` in the FPN and the box and mask heads (the FPN is new, like the heads: the configs' rule).
- **Test statistics**: a setting with a norm that has batch-dependent test statistics (decided by the
  batch-average hook's own ``has_batch_statistics`` on a layer built with the config's options: BN, SN,
  DN, not GN or MGN) evaluates after the SN paper's batch average over ``TEST.BATCH_AVERAGE.NUM_BATCHES``
  training batches. BN gets it too (the hook recomputes torch BN's running statistics exactly), so
  that every norm with batch statistics is tested with the same estimator; detectron2's PreciseBN, the
  same idea, is not used on top.
- **Backbones** (``--finetune``): pretrained with each setting's backbone norm by the config's PRETRAIN
  keys, or with ``--backbones BEST_JSON`` by each norm's PRETRAIN overrides in that file
  (tools/pretrain_grid.py's best.json; FrozenBN takes BN's), made in the cache if not there yet before
  the runs, as the grid makes its cells (``jobs.execute_job``, ``--jobs`` at a time), each in
  ``OUTPUT_DIR/backbones/<cache folder>`` with checkpoints, so that a sweep killed there resumes the
  backbone (PRETRAIN.CHECKPOINT_PERIOD); its work folder goes once it is cached. Every
  seed finetunes the one backbone pretrained with the config's SEED, so the spread over seeds is the
  finetuning's only; with ``--backbone-seeds`` seed k finetunes a backbone pretrained with SEED k (the
  config's SEED gives the grid's cell), so that the spread includes the backbone's draw, which moves AP
  more than the finetuning seed does. Settings whose runs of a seed start from the same weights are
  also compared seed by seed (``report.within_backbone_differences``), where that draw cancels.
- **Budget**: ``--iters N`` scales the config's schedule linearly (``SOLVER.STEPS`` and
  ``WARMUP_ITERS`` by N / MAX_ITER); without it the config's schedule is used as is.
- **Resume**: each run has its own folder, ``OUTPUT_DIR/<setting>/seed<k>``; a run is finished when its
  ``eval_results.json`` exists and is then skipped. Any other started run is run again with train_net's
  ``--resume``: detectron2 continues from the folder's last checkpoint, or starts over if there is none
  (then the metrics of the abandoned attempt are removed, so the learning curve is that of one
  training). A folder whose record has other train_net arguments than planned is an error before
  anything runs: one sweep never mixes budgets or configs.
"""
