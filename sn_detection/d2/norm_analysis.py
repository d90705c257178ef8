"""What the learned norms of a detectron2 model chose, per component, and a hook that logs it in training.

``learned_choices(model)`` gives the records of every SN / SSN / DN layer (read from parameters and buffers) and
``component_summaries`` averages them per component of ``components.COMPONENTS``.

``NormAnalysis`` (hook, ``cfg.TEST.NORM_ANALYSIS.PERIOD``) puts those per-component values into
detectron2's ``EventStorage`` every PERIOD iterations and after the last one, as scalars named
``norm/<kind>/<component>/<metric>`` (e.g. ``norm/SN/box_head/var_BN``; see ``analysis.summary`` for the
metrics), so they reach metrics.json and TensorBoard through the trainer's writers; after training it
draws their evolution into ``OUTPUT_DIR/norm_evolution_<kind>.png``. It is cheap by design: SN, SSN and DN
values are read from a few parameters, with no forward pass; MN / MGN gates are observed on the
training forward of the logged iteration itself (forward pre-hooks attached for that one iteration).
The hook runs before the writers (``Trainer.build_hooks``), so a value reaches metrics.json at its own
iteration; detectron2's writers keep the latest value of each scalar when they write (every 20
iterations), so a PERIOD that is a multiple of 20 gets every logged value there. The evolution kept for
the plot covers the iterations run by this process (after a resume, those since the resume).
"""

from __future__ import annotations

import logging
import os

from detectron2.engine import HookBase
from detectron2.utils import comm
from torch import nn

from ..analysis import GateRecorder, learned_choices, mode_layers, plot_evolution, summarize
from ..analysis.summary import ComponentSummary, Record
from .components import COMPONENTS, component_of

logger = logging.getLogger(__name__)

EVOLUTION_FILE = "norm_evolution_{kind}.png"


def component_summaries(records: list[Record]) -> list[ComponentSummary]:
    """``records`` averaged per detectron2 component (stem, res2-res5, FPN, RPN, box head, mask head)."""
    return summarize(records, component_of, COMPONENTS)


def storage_scalars(summaries: list[ComponentSummary]) -> dict[str, float]:
    """The summaries as EventStorage scalars ``norm/<kind>/<component>/<metric>`` (spaces become _)."""
    return {
        f"norm/{s.kind}/{s.component.replace(' ', '_')}/{metric}": value
        for s in summaries
        for metric, value in s.metrics.items()
    }


class NormAnalysis(HookBase):
    """Logs the per-component choices of the learned norms every ``period`` iterations and after the
    last one, and plots their evolution into ``output_dir`` after training (see the module docstring)."""

    def __init__(self, model: nn.Module, period: int, output_dir: str):
        if period < 1:
            raise ValueError(f"NormAnalysis needs a period >= 1 (iterations), got {period}")
        self._model = model
        self._period = period
        self._output_dir = output_dir
        self._observes_gates = bool(mode_layers(model))
        self._recorder: GateRecorder | None = None
        self.history: list[tuple[int, list[ComponentSummary]]] = []

    def _logs(self) -> bool:
        next_iter = self.trainer.iter + 1
        return next_iter == self.trainer.max_iter or next_iter % self._period == 0

    def before_step(self):
        if self._observes_gates and self._logs():
            self._recorder = GateRecorder(self._model).start()

    def after_step(self):
        if not self._logs():
            return
        records = learned_choices(self._model)
        if self._recorder is not None:
            records += self._recorder.results()
            self._stop_recording()
        summaries = component_summaries(records)
        self.trainer.storage.put_scalars(**storage_scalars(summaries), smoothing_hint=False)
        self.history.append((self.trainer.iter, summaries))

    def after_train(self):
        self._stop_recording()
        if self.history and comm.is_main_process():
            for path in self.write_plots():
                logger.info("Norm analysis: evolution during training drawn in %s", path)

    def write_plots(self) -> list[str]:
        """Draw the evolution of each kind of layer logged so far; returns the files written."""
        os.makedirs(self._output_dir, exist_ok=True)
        kinds = dict.fromkeys(s.kind for _, summaries in self.history for s in summaries if s.metrics)
        paths = []
        for kind in kinds:
            path = os.path.join(self._output_dir, EVOLUTION_FILE.format(kind=kind))
            plot_evolution(self.history, kind, path)
            paths.append(path)
        return paths

    def _stop_recording(self) -> None:
        if self._recorder is not None:
            self._recorder.stop()
            self._recorder = None


def norm_analysis_hook(model: nn.Module, period: int, output_dir: str) -> NormAnalysis | None:
    """``NormAnalysis(model, period, output_dir)``, or None when the period is 0 or ``model`` has no SN,
    DN, MN or MGN layer."""
    if period < 0:
        raise ValueError(f"the norm analysis period must be >= 0 (0 disables it), got {period}")
    if period == 0:
        return None
    if not (learned_choices(model) or mode_layers(model)):
        logger.info("Norm analysis is disabled: the model has no SN, SSN, DN, MN or MGN layer")
        return None
    return NormAnalysis(model, period, output_dir)


def build_norm_analysis_hook(cfg, model: nn.Module) -> NormAnalysis | None:
    """The ``NormAnalysis`` hook for the yaml config ``cfg`` (period cfg.TEST.NORM_ANALYSIS.PERIOD, plots
    into cfg.OUTPUT_DIR), or None (see ``norm_analysis_hook``)."""
    period = cfg.TEST.NORM_ANALYSIS.PERIOD
    if period < 0:
        raise ValueError(f"TEST.NORM_ANALYSIS.PERIOD must be >= 0 (0 disables the norm analysis), got {period}")
    return norm_analysis_hook(model, period, cfg.OUTPUT_DIR)
