"""All the glue with detectron2: config keys (and their validation), norm-name registration, frozen stages,
optimizer, checkpoint loading with clear errors.

Importing ``sn_detection`` installs the registration (see ``registry``), so that every name of
``sn_detection.layers.build_norm`` works in detectron2's norm config keys.
"""

from .checkpoint import CheckedCheckpointer
from .config import add_sn_config, norm_options_from_cfg, validate_sn_config
from .freeze import freeze_norms
from .model import build_model
from .optimizer import build_optimizer, get_optimizer_params
from .registry import (
    current_norm_options,
    get_norm,
    install_get_norm,
    norm_options_applied,
    set_norm_options,
    valid_norm_names,
)

__all__ = [
    "CheckedCheckpointer",
    "add_sn_config",
    "build_model",
    "build_optimizer",
    "current_norm_options",
    "freeze_norms",
    "get_norm",
    "get_optimizer_params",
    "install_get_norm",
    "norm_options_applied",
    "norm_options_from_cfg",
    "set_norm_options",
    "valid_norm_names",
    "validate_sn_config",
]
