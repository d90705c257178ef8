"""Conversion of ImageNet-pretrained ResNets into detectron2 backbone checkpoints.

One module per source format (``sn_imagenet``, ``ssn_imagenet``: the SN and SSN authors' checkpoints;
``torchvision_resnet``;
``detectron_gn``: Detectron's GN pickles), the architecture check and key emission they share
(``resnet``), the report, file reading and atomic writing (``report``, ``files``), and the input
conventions each source needs in the config (``conventions.INPUT_CONVENTIONS``). The command line is
``tools/convert_pretrained.py``. Nothing here imports detectron2.
"""

from .conventions import INPUT_CONVENTIONS, InputConvention
from .files import write_checkpoint
from .report import ConversionError, ConversionReport
from .resnet import TARGET_NORMS
from .sources import SOURCES, convert_file, default_norm, weights_terms

__all__ = [
    "INPUT_CONVENTIONS",
    "SOURCES",
    "TARGET_NORMS",
    "ConversionError",
    "ConversionReport",
    "InputConvention",
    "convert_file",
    "default_norm",
    "weights_terms",
    "write_checkpoint",
]
