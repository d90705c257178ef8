"""tools/pretrain_grid.py: every norm's backbone pretrained under a grid of recipes at one budget, so that
each norm can be finetuned from its own best backbone instead of from one recipe tuned for one norm.

    tools/pretrain_grid.py [--config-file CFG] [--norms BN,GN,SN,DN,MGN] [--lrs 0.05,0.1,0.2,0.4]
        [--warmups 0,40] [--target-top1 X] [--equal-top1] [--jobs N] [--output-dir DIR] [--publish FILE]
        [--plan-only | --report-only] [KEY VALUE ...]

A **cell** is a norm and a setting (PRETRAIN.BASE_LR, and PRETRAIN.WARMUP_ITERS with ``--warmups``):
the config's backbone with MODEL.RESNETS.NORM set to the norm, pretrained by the config's PRETRAIN keys
with the setting's overrides, for the config's PRETRAIN.MAX_ITER iterations (the same budget in every
cell). FrozenBN is pretrained as BN (``pretrained_norm``), so it is the BN cell.

- **The cache is the result.** A cell's config is exactly the one ``tools/compare_norms.py --finetune``
  asks for with the same config, KEY VALUE overrides and PRETRAIN overrides (``cell_cfg`` and
  ``compare_norms.plan.pretraining_configs`` make it with ``backbones.with_pretrain_overrides``), so the cell
  lands in the verified backbone cache (``cached_backbone``) under the key the finetune sweep reads. A
  cell is done when its backbone is in the cache, whoever made it: backbones made earlier by the
  finetune sweep or ``make demo`` count.
- **A backbone job per cell** (``sn_detection.experiments.jobs``: a subprocess, ``--jobs N`` at once with
  the threads split) in ``OUTPUT_DIR/cells/<cell>``: it pretrains in ``training/`` with ``resume``, so
  a cell killed mid-way continues from its last checkpoint (PRETRAIN.CHECKPOINT_PERIOD) when the same
  command runs again; a finished one moves into the cache whole, and its work folder is removed.
  ``cell.json`` records what the cell is (its cache folder) and every attempt (wall time, exit status,
  resumed or not, threads); a cell folder planned for another cache folder (another config, budget or
  override) is refused before anything runs.
- **The estimate**, printed before anything runs: cells done and to run, and the wall time of those to
  run: per cell, seconds per iteration x the iterations it still runs (PRETRAIN.MAX_ITER, less those
  before a killed cell's last checkpoint), summed and divided by the jobs. A norm's
  seconds per iteration are the median of detectron2's per-iteration time (metrics.json) over its
  finished cells; for a norm without one, ``--estimate-steps K`` training steps measured here on a
  random batch at the threads one job gets (no data loading, batch average or evaluation: a lower
  bound). Start-up, batch average and evaluations are not in it, nor jobs slowing each other.
- **Results**, per cell: val top-1 (after the batch average), wall time (the grid's attempts together;
  for a cell made elsewhere, its recorded training time), iterations, seconds per iteration, and with
  PRETRAIN.EVAL_PERIOD the top-1 at each evaluation (``metrics.json``'s ``val_top1``; those before the
  end are of the moving-average statistics). ``--target-top1 X``: the first evaluated iteration at which
  val top-1 reached X, from the same runs. It does not train anything further: a cell whose runs never
  reach X within the budget shows "not reached", and the iteration is only as fine as EVAL_PERIOD (the
  end of training is always evaluated).
- **Equal top-1** (``--equal-top1``): once a norm's cells are all done, its best setting is trained again
  in a cell of its own with PRETRAIN.STOP_TOP1 X: it stops at the first periodic evaluation whose top-1
  reaches X, so it is the best cell's run (the same seed, data stream and schedule of PRETRAIN.MAX_ITER)
  cut short where that cell first reached X (on the grid's threads and CPU; elsewhere it may stop at
  another evaluation, and the table shows both), then batch-averaged and evaluated as every cell is, into
  the cache. So every norm gets a backbone of about X % top-1, and the iterations it needed are a
  finding of their own; and since the stop is the config's, ``compare_norms --backbone-seeds`` draws of it
  stop at X too, each after its own number of iterations. X is ``--target-top1``, by default the lowest
  of the norms' best top-1 rounded down to a whole percent (known once every cell is done), so that every
  norm reaches it; a norm whose best never did is reported as not reached. Where a norm's best cell
  first reached X at its end (the final evaluation), or at an evaluation whose model it kept (a grid run
  with PRETRAIN.KEEP_EVALUATED_MODELS), the equal cell is made from the cell's run without training
  (``pretraining.cache.same_run_stop``): a copy of its backbone, or the batch average of that model.
  The stop is checked every PRETRAIN.EVAL_PERIOD of the grid, or every ``--equal-eval-period N``
  iterations: a finer N stops nearer X (top-1 may climb several points between two of the grid's
  evaluations), and the equal cells then train, their run's evaluations not being the grid cell's.
- **Outputs** in OUTPUT_DIR: ``results.md`` (top-1 per norm x setting with wall times, each norm's best
  setting by val top-1 in bold, then a row per cell, and where the cache holds other draws of a best
  setting (another SEED, as ``compare_norms --backbone-seeds`` makes them) a table of the draws),
  ``results.csv``, ``results.json`` (with the curves and those draws), and ``best.json``, ``{norm:
  {PRETRAIN key: value}}``: each norm's best setting, for norms whose cells are all done, with the
  grid's PRETRAIN.EVAL_PERIOD and KEEP_EVALUATED_MODELS where it evaluates periodically (neither changes
  the backbone: a draw of the setting is evaluated, and keeps its models, as the cell was, so that its
  equal-top-1 draw is made from it);
  ``tools/compare_norms.py --finetune --backbones best.json`` finetunes each setting from its backbone
  norm's best backbone (FrozenBN from BN's). With ``--equal-top1``, ``equal_top1.json`` (the same form,
  each norm's best setting with PRETRAIN.STOP_TOP1 and the PRETRAIN.EVAL_PERIOD it is checked at) and the
  equal-top-1 table under the grid's, with a table of its draws where the cache has them.
- **Published** (``--publish FILE``): the markdown, and beside it the settings files, ``FILE`` with
  ``.best.json`` and ``.equal_top1.json`` for its ``.md`` (``published_settings``): the grid's choice
  is then part of the repository, so that a finetune sweep on a machine whose cache and OUTPUT_DIR are
  empty pretrains the same backbones (``--backbones model_zoo/sections/1_pretrain_grid.best.json``)
  without running the grid again.

The grid in modules of one job each: ``plan`` (the cells, their configs and folders, the estimate), ``run``
(the cells as backbone jobs), ``results`` (what the cache holds of each cell, the best, the equal-top-1
cells), ``report`` (the tables, CSV and JSON), ``publish`` (the copies under ``--publish``), ``cli`` (the
command line).
"""
