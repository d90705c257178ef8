"""A layer's state as torch's own layers save it: without the identity ours add (``layers.base``)."""

from sn_detection.layers import IDENTITY_KEY


def tensors(layer) -> dict:
    """``layer.state_dict()`` without its identity: what nn.GroupNorm, nn.BatchNorm2d or a scripted layer save."""
    return {key: value for key, value in layer.state_dict().items() if key != IDENTITY_KEY}
