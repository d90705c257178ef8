"""The trained model of a config, for the tools that look at one (tools/analyze_norms.py, tools/demo.py).

Which weights: ``MODEL.WEIGHTS`` when it is given on the command line (any file detectron2's
checkpointer reads, or "" for the untrained model), otherwise the last checkpoint that training wrote
into the config's ``OUTPUT_DIR`` (``last_checkpoint``, i.e. model_final.pth after a complete run). They
must hold every tensor of the config's model: weights of another config are refused, not loaded in part. The
config file's own MODEL.WEIGHTS is not used on its own: for a training config it names the initial
(pretrained or empty) weights, not what training produced.
"""

from __future__ import annotations

import argparse

from detectron2.modeling import build_model
from torch import nn

from .. import d2


def add_overrides_argument(parser: argparse.ArgumentParser) -> None:
    """The trailing KEY VALUE config overrides of a tool that loads a trained model (``args.opts``)."""
    parser.add_argument(
        "opts",
        nargs=argparse.REMAINDER,
        help="KEY VALUE config overrides; MODEL.WEIGHTS FILE picks the weights, otherwise the last "
        "checkpoint in OUTPUT_DIR",
    )


def weights_on_command_line(opts: list) -> bool:
    """Whether the KEY VALUE overrides ``opts`` set MODEL.WEIGHTS."""
    return "MODEL.WEIGHTS" in opts[::2]


def load_trained_model(cfg, opts: list) -> tuple[nn.Module, str]:
    """The model of ``cfg`` in evaluation mode, with its trained weights (see the module docstring);
    returns it and the weights file."""
    model = build_model(cfg)
    checkpointer = d2.CheckedCheckpointer(model, save_dir=cfg.OUTPUT_DIR)
    if weights_on_command_line(opts):
        weights = cfg.MODEL.WEIGHTS
    elif checkpointer.has_checkpoint():
        weights = checkpointer.get_checkpoint_file()
    else:
        raise FileNotFoundError(
            f"no trained model: {cfg.OUTPUT_DIR} has no checkpoint of this config; train it first "
            "(tools/train_net.py --config-file ...) or name the weights with MODEL.WEIGHTS path/to/model.pth"
        )
    if weights:  # every tensor of the model, trained: a partial load would show initial values as learned
        checkpointer.evaluate_from(weights, "MODEL.WEIGHTS")
    return model.eval(), weights
