"""What the learned normalization layers chose: SN's importance weights, SSN's choices, DN's pooling, MN / MGN
gates.

Pure PyTorch and matplotlib, no detectron2: ``choices`` reads SN / SSN / DN layers from a model or a state
dict, ``gates`` observes MN / MGN gates on inputs, ``summary`` averages per network component,
``report`` and ``plots`` write markdown, CSV and PNG. The detectron2 side (which module names form
which component, the training hook) is in ``sn_detection.d2``, and the command line of
``tools/analyze_norms.py``, which loads a trained model with detectron2, in
``sn_detection.engine.analyze_norms``: both call this package, which imports neither.
"""

from .choices import (
    DynamicChoice,
    ModeGates,
    SparseSwitchableChoice,
    SwitchableChoice,
    choices_from_state_dict,
    learned_choices,
    mode_layers,
    mode_layers_in_state_dict,
)
from .gates import GateRecorder, gate_probabilities
from .plots import plot_evolution
from .report import write_report
from .summary import ComponentSummary, summarize

__all__ = [
    "ComponentSummary",
    "DynamicChoice",
    "GateRecorder",
    "ModeGates",
    "SparseSwitchableChoice",
    "SwitchableChoice",
    "choices_from_state_dict",
    "gate_probabilities",
    "learned_choices",
    "mode_layers",
    "mode_layers_in_state_dict",
    "plot_evolution",
    "summarize",
    "write_report",
]
