#!/usr/bin/env python
"""Convert an ImageNet-pretrained ResNet into a detectron2 backbone checkpoint.

    tools/convert_pretrained.py SRC DST --source {sn,ssn,torchvision,gn} [--norm {BN,SN,SSN,GN}] [--verbose]

Sources: ``sn`` and ``ssn`` (the SN and SSN authors' ImageNet checkpoints), ``torchvision`` (its BN
ResNets; ``--norm SN`` or ``GN`` initialises those layers from BN), ``gn`` (Detectron's GN pickles). DST is ``.pkl``
(detectron2's model-zoo format) or ``.pth``; use it as MODEL.WEIGHTS with the input convention the
report prints. See ``sn_detection/conversion``.
"""

import sys

from sn_detection.conversion.cli import main

if __name__ == "__main__":
    sys.exit(main())
