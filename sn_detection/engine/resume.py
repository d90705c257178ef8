"""What a checkpoint does not hold, settled so that a resumed training equals an uninterrupted one.

detectron2's checkpoints hold the model (weights and buffers: running and batch-averaged statistics,
DN's gates are parameters), the optimizer (SGD momentum), the LR scheduler, the iteration and the hooks'
states (the batch-average hook's count of batches read). Two things are missing:

- The position in the training data. A resumed run builds its data loader again, and detectron2's
  sampler restarts its seeded stream, so the resumed run would see the first batches again.
  ``build_train_loader`` builds detectron2's training loader over a sampler whose stream of batches
  can start at any batch. Batches are formed from indices alone: detectron2's aspect-ratio grouping
  (``AspectRatioGroupedDataset``, two groups, w > h or not) groups the loaded images by their
  ``width`` and ``height``, which a dataset dict already holds and the mapper keeps, so
  ``GroupedBatchSampler`` on those sizes forms the same batches from the sampler's indices. Skipping
  the batches an interrupted run consumed therefore reads no image.
- The random state. RoI sampling in the RPN and the heads draws from torch's global generator, the
  mapper's random flips from numpy's; the checkpoint does not hold their states (each process has its
  own). ``IterationSeed`` seeds them before each iteration from (SEED, rank, iteration), so that an
  iteration draws the same numbers whether or not the run was interrupted before it. The loaders get
  generators of their own for the same reason (creating a loader's iterator draws a seed).

Guarantee: with a fixed SEED (>= 0), detectron2's default TrainingSampler and DATALOADER.NUM_WORKERS 0,
a run resumed from the checkpoint of iteration n computes what the uninterrupted run computes: the same
batches, losses, gradients, weights and buffers (bit for bit on the CPU; on GPUs nondeterministic
kernels already make two uninterrupted runs differ). Limits:

- With data loader workers the flips are drawn in the workers, whose generators restart with the
  loader: a resumed run sees the same images in the same batches, possibly flipped differently.
- SEED < 0 (a random seed per run) reseeds nothing; other samplers (SAMPLER_TRAIN) restart their
  stream on resume, with a warning.
- detectron2's EventStorage is not checkpointed: the median-smoothed losses that metrics.json and the
  console show during the first 20 iterations after a resume cover only the iterations since then.
"""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from detectron2.data import build_detection_train_loader, get_detection_dataset_dicts
from detectron2.data.samplers import GroupedBatchSampler, TrainingSampler
from detectron2.engine import HookBase
from detectron2.utils import comm
from torch.utils.data import Sampler

logger = logging.getLogger(__name__)


class BatchStreamSampler(Sampler):
    """The indices of the infinite stream of batches that ``sampler``'s indices form, from batch
    ``start_batch`` on: batches of ``batch_size`` consecutive indices or, with ``group_ids`` (the group
    of each index), ``GroupedBatchSampler``'s batches of indices of one group each.

    A loader that batches ``batch_size`` consecutive indices of this stream (detectron2's loader
    without aspect-ratio grouping; its workers take whole batches) yields exactly these batches.
    """

    def __init__(self, sampler: Sampler, batch_size: int, group_ids: Sequence[int] | None = None, start_batch=0):
        self._sampler = sampler
        self._batch_size = batch_size
        self._group_ids = group_ids
        self._start_batch = start_batch

    def __iter__(self) -> Iterator[int]:
        if self._group_ids is None:
            yield from itertools.islice(self._sampler, self._start_batch * self._batch_size, None)
            return
        batches = GroupedBatchSampler(self._sampler, self._group_ids, self._batch_size)
        for batch in itertools.islice(batches, self._start_batch, None):
            yield from batch


def build_train_loader(cfg, start_batch: int = 0):
    """detectron2's training data loader for ``cfg`` whose per-process stream of batches starts at its
    batch ``start_batch``: with ``start_batch`` = k, batch i of this loader is batch k + i of the loader
    built with 0. The sampler's shuffle is seeded by cfg.SEED when it is fixed."""
    seed = cfg.SEED if cfg.SEED >= 0 else None
    dataset = get_detection_dataset_dicts(
        cfg.DATASETS.TRAIN,
        filter_empty=cfg.DATALOADER.FILTER_EMPTY_ANNOTATIONS,
        min_keypoints=cfg.MODEL.ROI_KEYPOINT_HEAD.MIN_KEYPOINTS_PER_IMAGE if cfg.MODEL.KEYPOINT_ON else 0,
        proposal_files=cfg.DATASETS.PROPOSAL_FILES_TRAIN if cfg.MODEL.LOAD_PROPOSALS else None,
    )
    grouping = cfg.DATALOADER.ASPECT_RATIO_GROUPING
    if cfg.DATALOADER.SAMPLER_TRAIN != "TrainingSampler" or (grouping and not _all_have_sizes(dataset)):
        if start_batch > 0:
            logger.warning(
                "The training data restarts from the beginning of its stream: resuming at a batch needs "
                "SAMPLER_TRAIN TrainingSampler and, with aspect-ratio grouping, width and height in every "
                "dataset dict"
            )
        return build_detection_train_loader(cfg)
    group_ids = [_aspect_ratio_group(d) for d in dataset] if grouping else None
    batch_size = cfg.SOLVER.IMS_PER_BATCH // comm.get_world_size()
    sampler = BatchStreamSampler(TrainingSampler(len(dataset), seed=seed), batch_size, group_ids, start_batch)
    return build_detection_train_loader(cfg, dataset=dataset, sampler=sampler, aspect_ratio_grouping=False, seed=seed)


def _all_have_sizes(dataset: list) -> bool:
    return all("width" in d and "height" in d for d in dataset)


def _aspect_ratio_group(dataset_dict: dict) -> int:
    """The group of detectron2's AspectRatioGroupedDataset: 0 for landscape images, 1 otherwise."""
    return 0 if dataset_dict["width"] > dataset_dict["height"] else 1


def iteration_seed(seed: int, rank: int, iteration: int) -> int:
    """The seed of the random draws of ``iteration`` on process ``rank`` of a run seeded with ``seed``."""
    return int(np.random.SeedSequence([seed, rank, iteration]).generate_state(1)[0])


class IterationSeed(HookBase):
    """Seeds torch's, numpy's and Python's global generators before each iteration with
    ``iteration_seed(seed, rank, iteration)``. It should come first among the hooks, before any of them
    draws a random number in ``before_step``."""

    def __init__(self, seed: int):
        self._seed = seed

    def before_step(self):
        seed = iteration_seed(self._seed, comm.get_rank(), self.trainer.iter)
        torch.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)
