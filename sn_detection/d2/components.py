"""Which part of a detectron2 R-CNN a module belongs to, from its name: the components over which the
SN paper averages importance weights (Fig. 1c: backbone, box head, mask head; Fig. 3: ResNet stages).

    backbone.bottom_up.stem, backbone.stem             stem      (FPN models, C4 models)
    backbone.bottom_up.resN, backbone.resN             resN
    backbone.fpn_lateral*, backbone.fpn_output*,
    backbone.top_block                                 FPN
    proposal_generator                                 RPN
    roi_heads.box_head; roi_heads.res5 (C4)            box head
    roi_heads.mask_head                                mask head
    anything else                                      other

A leading ``module.`` (DistributedDataParallel's wrapper) is ignored. In C4 models res5 runs on the
RoIs, so it is the box head, as in the SN paper's setting 1.
"""

from __future__ import annotations

import re

COMPONENTS = ("stem", "res2", "res3", "res4", "res5", "FPN", "RPN", "box head", "mask head", "other")

_RULES = (
    (re.compile(r"backbone\.(bottom_up\.)?stem(\.|$)"), "stem"),
    (re.compile(r"backbone\.(bottom_up\.)?(?P<stage>res[2-5])(\.|$)"), None),
    (re.compile(r"backbone\.(fpn_(lateral|output)\w*|top_block)(\.|$)"), "FPN"),
    (re.compile(r"proposal_generator(\.|$)"), "RPN"),
    (re.compile(r"roi_heads\.(box_head|res5)(\.|$)"), "box head"),
    (re.compile(r"roi_heads\.mask_head(\.|$)"), "mask head"),
)


def component_of(module_name: str) -> str:
    """The component (one of ``COMPONENTS``) of the module called ``module_name`` in a detectron2 model."""
    name = module_name.removeprefix("module.")
    for pattern, component in _RULES:
        match = pattern.match(name)
        if match:
            return component or match.group("stage")
    return "other"
