"""The trainer behind tools/train_net.py: detectron2's DefaultTrainer whose model has our norms
configured by ``cfg.MODEL.SN`` and frozen in frozen stages, whose optimizer applies our norms' rules, and
whose COCO evaluation also writes its AP to a JSON file and prints a one-line summary."""

from __future__ import annotations

import json
import logging
import os

from detectron2.data import DatasetCatalog, MetadataCatalog
from detectron2.engine import DefaultTrainer
from detectron2.evaluation import COCOEvaluator
from detectron2.utils import comm

from .. import d2
from ..d2.hooks import build_batch_average_hook, insert_before_evaluation

RESULTS_FILE = "eval_results.json"

logger = logging.getLogger(__name__)


class Trainer(DefaultTrainer):
    @classmethod
    def build_model(cls, cfg):
        model = d2.build_model(cfg)
        logger.info("Model:\n%s", model)
        return model

    @classmethod
    def build_optimizer(cls, cfg, model):
        return d2.build_optimizer(cfg, model)

    def build_hooks(self):
        hook = build_batch_average_hook(self.cfg, self.model, self.build_train_loader)
        return insert_before_evaluation(super().build_hooks(), hook)

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
        OUTPUT_DIR/eval_results.json."""
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
