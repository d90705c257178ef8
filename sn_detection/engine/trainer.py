"""The trainer behind tools/train_net.py: detectron2's DefaultTrainer (whose ``build_model`` builds the
config's model, our norms with their options included, through ``SNMetaArch``) with our optimizer rules,
the batch-average and norm-analysis hooks, and a COCO evaluation that also writes its AP to a JSON file
and prints a one-line summary.

Also: several processes on the CPU (``--num-gpus K`` without a GPU: K gloo processes), a resumed
training equal to an uninterrupted one (see ``resume``), and no checkpoint with NaN or Inf
(``CheckedCheckpointer``).
"""

from __future__ import annotations

import json
import logging
import os
import weakref

from detectron2.data import DatasetCatalog, MetadataCatalog
from detectron2.engine import DefaultTrainer, TrainerBase
from detectron2.evaluation import COCOEvaluator
from detectron2.utils import comm
from detectron2.utils.logger import setup_logger

from .. import d2
from ..d2.checkpointer import check_resumed_iteration
from ..d2.hooks import build_batch_average_hook, build_radius_hook, insert_before_evaluation
from ..d2.norm_analysis import build_norm_analysis_hook
from . import resume

logger = logging.getLogger(__name__)

# the final evaluation, written into OUTPUT_DIR by ``write_results`` (the comparison's runs are read from it)
RESULTS_FILE = "eval_results.json"


class Trainer(DefaultTrainer):
    def __init__(self, cfg):
        """A fork of ``DefaultTrainer.__init__`` of the pinned detectron2 (sal-detectron2 0.7.2), with two
        changes: the model in DDP and the trainer of one step come from ``d2.step_trainer`` (on the CPU DDP
        gets no ``device_ids``, which detectron2's ``create_ddp_model`` sets and ``__init__`` offers no seam
        to change; AMP is refused off CUDA), and the checkpointer is a ``CheckedCheckpointer``.
        Re-read upstream's ``__init__`` when updating detectron2."""
        TrainerBase.__init__(self)
        if not logging.getLogger("detectron2").isEnabledFor(logging.INFO):
            setup_logger()
        cfg = DefaultTrainer.auto_scale_workers(cfg, comm.get_world_size())
        model = self.build_model(cfg)
        optimizer = self.build_optimizer(cfg, model)
        data_loader = self.build_train_loader(cfg)
        self._trainer = d2.step_trainer(
            model, data_loader, optimizer, cfg.SOLVER.AMP.ENABLED, "SOLVER.AMP.ENABLED", broadcast_buffers=False
        )
        model = self._trainer.model
        self.scheduler = self.build_lr_scheduler(cfg, optimizer)
        self.checkpointer = d2.CheckedCheckpointer(model, cfg.OUTPUT_DIR, trainer=weakref.proxy(self))
        self.start_iter = 0
        self.max_iter = cfg.SOLVER.MAX_ITER
        self.cfg = cfg
        self.register_hooks(self.build_hooks())

    def resume_or_load(self, resume=True):
        super().resume_or_load(resume=resume)
        check_resumed_iteration(self.start_iter, self.max_iter, "SOLVER.MAX_ITER", self.cfg.OUTPUT_DIR)
        if self.start_iter > 0:
            # The loader built in __init__ starts at the beginning of its stream; a resumed run must
            # read on where the checkpointed one stopped (one batch per iteration). SimpleTrainer
            # creates its data iterator at the first step, so replacing the loader here is enough.
            self._trainer.data_loader = self.build_train_loader(self.cfg, start_batch=self.start_iter)

    @classmethod
    def build_train_loader(cls, cfg, start_batch: int = 0):
        return resume.build_train_loader(cfg, start_batch)

    @classmethod
    def build_optimizer(cls, cfg, model):
        return d2.build_optimizer(cfg, model)

    def build_hooks(self):
        hook = build_batch_average_hook(self.cfg, self.model, self.build_train_loader)
        hooks = insert_before_evaluation(super().build_hooks(), hook)
        radius = build_radius_hook(self.cfg, self.model)
        if radius is not None:  # SSN's radius of the iteration, set before its forward
            hooks.insert(0, radius)
        if self.cfg.SEED >= 0:
            # first, so that every random draw of an iteration follows its seeding
            hooks.insert(0, resume.IterationSeed(self.cfg.SEED))
        # before the writers too, so that the logged values reach metrics.json at their own iteration
        return insert_before_evaluation(hooks, build_norm_analysis_hook(self.cfg, self.model))

    @classmethod
    def build_evaluator(cls, cfg, dataset_name, output_folder=None):
        json_file = MetadataCatalog.get(dataset_name).get("json_file")
        if json_file and not os.path.exists(json_file):
            # COCOEvaluator reads the annotation file as soon as it is built; datasets generated on
            # first load (the embedded shapes) write it when loaded.
            DatasetCatalog.get(dataset_name)
        output_folder = output_folder or os.path.join(cfg.OUTPUT_DIR, "inference", dataset_name)
        return COCOEvaluator(dataset_name, output_dir=output_folder)

    @classmethod
    def test(cls, cfg, model, evaluators=None):
        """Evaluates on cfg.DATASETS.TEST; the latest results (after training: the final AP) go to
        OUTPUT_DIR/eval_results.json. Every process evaluates with the statistics the checkpoint holds."""
        d2.share_first_process_buffers(model)
        results = super().test(cfg, model, evaluators)
        if comm.is_main_process():
            # DefaultTrainer.test unwraps the per-dataset level when there is a single test dataset.
            per_dataset = {cfg.DATASETS.TEST[0]: results} if len(cfg.DATASETS.TEST) == 1 else results
            write_results(cfg.OUTPUT_DIR, per_dataset)
        return results


def write_results(output_dir: str, results: dict) -> None:
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, RESULTS_FILE), "w") as f:
        json.dump(results, f, indent=2)
    for dataset_name, tasks in results.items():
        summary = ", ".join(f"{task} AP {metrics['AP']:.1f}" for task, metrics in tasks.items() if "AP" in metrics)
        logger.info("Final results on %s: %s (all metrics in %s)", dataset_name, summary, RESULTS_FILE)
