"""All the glue with detectron2: config keys and their validation, ``SNMetaArch`` (which builds our norms
with the config's options: see ``meta_arch``), the optimizer's rules, the checked checkpointer, component
names, the hooks (batch average, norm analysis), the trainer of one step (DDP, AMP), and the folding of a
trained model's norms for inference (``fold_norms``).

Importing ``sn_detection`` registers ``SNMetaArch`` in detectron2's ``META_ARCH_REGISTRY``.
"""

from .checkpointer import CheckedCheckpointer
from .config import add_sn_config, norm_factory_from_cfg, valid_norm_names, validate_sn_config
from .folding import FoldedModelError, fold_norms, is_folded
from .meta_arch import SNMetaArch, norm_layer, resolve_norms
from .optimizer import build_optimizer, get_optimizer_params
from .trainers import ddp_model, share_first_process_buffers, step_trainer

__all__ = [
    "CheckedCheckpointer",
    "FoldedModelError",
    "SNMetaArch",
    "add_sn_config",
    "build_optimizer",
    "fold_norms",
    "ddp_model",
    "get_optimizer_params",
    "is_folded",
    "norm_factory_from_cfg",
    "norm_layer",
    "resolve_norms",
    "share_first_process_buffers",
    "step_trainer",
    "valid_norm_names",
    "validate_sn_config",
]
