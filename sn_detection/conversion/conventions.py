"""The input conventions each pretrained source was trained with: the one table configs and README cite.

A converted backbone only reproduces its ImageNet features when detectron2 feeds it images the way its
trainer did. Per source:

========================  ==============================  ============================  ============  ======
source                    MODEL.PIXEL_MEAN                MODEL.PIXEL_STD               STRIDE_IN_1X1 FORMAT
========================  ==============================  ============================  ============  ======
``sn`` (switchablenorms)  [123.675, 116.280, 103.530]     [58.395, 57.120, 57.375]      False         RGB
``ssn`` (switchablenorms) [123.675, 116.280, 103.530]     [58.395, 57.120, 57.375]      False         RGB
``torchvision``           [123.675, 116.280, 103.530]     [58.395, 57.120, 57.375]      False         RGB
``gn`` (Detectron R-GN)   [103.530, 116.280, 123.675]     [1.0, 1.0, 1.0]               False         BGR
========================  ==============================  ============================  ============  ======

Where the numbers come from:

- ``sn``: the authors' ImageNet trainer reads images with PIL as RGB, scales them to [0, 1] and applies
  ``Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])``; in detectron2's 0-255 pixel
  units that is the mean and std above. Their ResNet (``resnet_v1_sn.py``) puts the stride in the 3x3
  conv, as torchvision does.
- ``ssn``: the SSN authors' trainer (switchablenorms/Sparse_SwitchNorm) normalises alike and its ResNet
  (``resnet_v1_ssn.py``) puts the stride in the 3x3 conv too.
- ``torchvision``: the same normalisation and stride placement; these are also the settings
  detectron2's own ``tools/convert-torchvision-to-d2.py`` prints.
- ``gn``: Detectron (Caffe2) subtracts a BGR pixel mean and divides by nothing, so its GN ImageNet
  models expect unit std; detectron2's ``Misc/mask_rcnn_R_50_FPN_3x_gn.yaml`` (weights
  ``ImageNetPretrained/FAIR/R-50-GN``) keeps the default mean and ``PIXEL_STD`` [1, 1, 1] and sets
  ``STRIDE_IN_1X1: False``; mmdetection's configs for the same weights also use std 1 and BGR. (The
  ImageNet std [57.375, 57.120, 58.395] belongs to other FB Caffe2 models such as X-101-32x8d.)
"""

from typing import NamedTuple


class InputConvention(NamedTuple):
    """How a source's network expects its input, in detectron2 config terms."""

    pixel_mean: tuple[float, float, float]
    pixel_std: tuple[float, float, float]
    stride_in_1x1: bool
    input_format: str

    def config_overrides(self) -> list:
        """KEY, VALUE pairs for ``cfg.merge_from_list`` (or the end of a train_net.py command line)."""
        return [
            "MODEL.PIXEL_MEAN", list(self.pixel_mean),
            "MODEL.PIXEL_STD", list(self.pixel_std),
            "MODEL.RESNETS.STRIDE_IN_1X1", self.stride_in_1x1,
            "INPUT.FORMAT", self.input_format,
        ]  # fmt: skip


_IMAGENET_RGB = InputConvention(
    pixel_mean=(123.675, 116.280, 103.530),
    pixel_std=(58.395, 57.120, 57.375),
    stride_in_1x1=False,
    input_format="RGB",
)

INPUT_CONVENTIONS = {
    "sn": _IMAGENET_RGB,
    "ssn": _IMAGENET_RGB,
    "torchvision": _IMAGENET_RGB,
    "gn": InputConvention(
        pixel_mean=(103.530, 116.280, 123.675),
        pixel_std=(1.0, 1.0, 1.0),
        stride_in_1x1=False,
        input_format="BGR",
    ),
}
