"""Source networks and files for the conversion tests, built here in each source's exact layout.

Each source is a torchvision ResNet whose norm layers are the source's (BN; this package's
SwitchableNorm2d for the SN authors' layer; nn.GroupNorm(32, C) for Detectron's GN) with random
parameters and statistics, so it computes res2..res5 features independently of detectron2. Its state
dict is then written the way the source's own code stores it: the SN authors' key names, shapes and
checkpoint wrapper, or Detectron's Caffe2 blob names in a Python 2 compatible pickle. The name mapping
here is written from the source formats' descriptions, not taken from the converter.
"""

import logging
import pickle
import re

import torch
import torchvision
from detectron2.checkpoint import DetectionCheckpointer
from detectron2.modeling.backbone.resnet import BasicStem, ResNet
from torch import nn

from sn_detection.layers import IDENTITY_KEY, SwitchableNorm2d

FEATURES = ("res2", "res3", "res4", "res5")


def torchvision_resnet(depth=50, norm_layer=None, seed=0) -> nn.Module:
    """torchvision's ResNet-``depth`` with ``norm_layer`` (BN if None) and random norm parameters and
    statistics."""
    torch.manual_seed(seed)
    builder = getattr(torchvision.models, f"resnet{depth}")
    net = builder(weights=None, **({"norm_layer": norm_layer} if norm_layer else {}))
    with torch.no_grad():
        for module in net.modules():
            if isinstance(module, (nn.BatchNorm2d, nn.GroupNorm, SwitchableNorm2d)):
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_(0, 0.2)
            if isinstance(module, SwitchableNorm2d):
                module.mean_weight.normal_(0, 1)
                module.var_weight.normal_(0, 1)
            if getattr(module, "running_mean", None) is not None:
                module.running_mean.normal_(0, 0.2)
                module.running_var.uniform_(0.5, 2.0)
                module.num_batches_tracked.fill_(1000)
    return net.eval()


def torchvision_features(net: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """res2..res5 (torchvision's layer1..layer4 outputs)."""
    x = net.maxpool(net.relu(net.bn1(net.conv1(x))))
    features = {}
    for name, layer in zip(FEATURES, (net.layer1, net.layer2, net.layer3, net.layer4)):
        x = layer(x)
        features[name] = x
    return features


def detectron2_resnet(norm, depth=50) -> ResNet:
    """detectron2's ResNet-``depth`` (stride in the 3x3 conv) from its public builders; ``norm`` is a
    detectron2 norm name or a callable channels -> layer."""
    stem = BasicStem(in_channels=3, out_channels=64, norm=norm)
    options = {"stride_in_1x1": False} if depth >= 50 else {}
    stages = ResNet.make_default_stages(depth, norm=norm, **options)
    return ResNet(stem, stages, out_features=list(FEATURES)).eval()


def assert_same_features(source_net, detectron2_net, seed=0):
    """Both networks (eval mode) give the same res2..res5 on a 1x3x64x64 input, up to float32
    rounding (1e-5 of each map's largest value; on CPU they agree bit for bit)."""
    torch.manual_seed(seed)
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        expected = torchvision_features(source_net.eval(), x)
        actual = detectron2_net.eval()(x)
    for name in FEATURES:
        scale = expected[name].abs().max()
        assert scale > 0
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-5 * scale)


def sn_authors_checkpoint(net: nn.Module, prefix="module.", with_bn=True) -> dict:
    """The SN authors' checkpoint of ``net`` (a torchvision ResNet with SwitchableNorm2d): ``sn`` module
    names, (1, C, 1, 1) affine and (1, C, 1) running statistics, no counter nor our layers' identity, in
    their trainer's dict."""
    state = {}
    for key, value in net.state_dict().items():
        if key.endswith(("num_batches_tracked", IDENTITY_KEY)):
            continue
        key = re.sub(r"(^|\.)bn(\d)\.", r"\1sn\2.", key)
        if re.search(r"\.(weight|bias)$", key) and value.dim() == 1 and not key.startswith("fc."):
            value = value.reshape(1, -1, 1, 1)
        elif key.endswith(("running_mean", "running_var")):
            value = value.reshape(1, -1, 1)
        state[prefix + key] = value.clone()
    if with_bn:
        assert all(v.shape == (3,) for k, v in state.items() if k.endswith("mean_weight"))
    return {
        "epoch": 100,
        "model": "resnetv1sn50",
        "state_dict": state,
        "best_prec1": torch.tensor(76.9),
        "optimizer": {"state": {}, "param_groups": [{"lr": 0.0, "momentum": 0.9, "params": [0, 1]}]},
    }


def ssn_authors_checkpoint(net: nn.Module, prefix="module.", with_bn=True) -> dict:
    """The SSN authors' checkpoint of ``net`` (a torchvision ResNet with SparseSwitchableNorm2d): the SN authors'
    layout (``sn_authors_checkpoint``) with, per layer, 0/1 int64 flags ``mean_fixed`` and ``var_fixed`` of
    shape (1,) in place of our fixed branches, the logits of a fixed vector overwritten with the one-hot
    values of its branch, as their layer does, and ``radius`` of shape (1,); none of our other buffers."""
    checkpoint = sn_authors_checkpoint(net, prefix, with_bn)
    state = checkpoint["state_dict"]
    for key in [key for key in state if key.endswith(("_fixed_at", ".iteration"))]:
        del state[key]
    for key in [key for key in state if key.endswith(("mean_fixed", "var_fixed"))]:
        branch = int(state[key])
        logits = key.replace("_fixed", "_weight")
        if branch >= 0:
            state[logits] = torch.nn.functional.one_hot(torch.tensor(branch), len(state[logits])).float()
        state[key] = torch.tensor([int(branch >= 0)], dtype=torch.int64)
    for key in [key for key in state if key.endswith(".radius")]:
        state[key] = state[key].reshape(1)
    checkpoint["model"] = "resnetv1ssn50"
    return checkpoint


def detectron_gn_blobs(net: nn.Module) -> dict:
    """Detectron's Caffe2 blobs of ``net`` (a torchvision ResNet with nn.GroupNorm), as float32 numpy
    arrays, with the classifier and an SGD momentum blob per parameter, as in a trained file."""
    branches = {"conv1": "branch2a", "conv2": "branch2b", "conv3": "branch2c"}
    blobs = {}
    for key, value in net.state_dict().items():
        array = value.float().numpy().copy()
        if key.startswith("fc."):
            name = "fc1000_" + key[3]
        elif key.startswith(("conv1.", "bn1.")):
            name = {"conv1.weight": "conv1_w", "bn1.weight": "conv1_gn_s", "bn1.bias": "conv1_gn_b"}[key]
        else:
            layer, block, module, *rest = key.split(".")
            stage = f"res{int(layer[-1]) + 1}_{block}"
            if module == "downsample":
                branch, param = "branch1", {"0": "w", "1": {"weight": "gn_s", "bias": "gn_b"}[rest[1]]}[rest[0]]
            elif module.startswith("conv"):
                branch, param = branches[module], "w"
            else:
                branch, param = branches["conv" + module[-1]], {"weight": "gn_s", "bias": "gn_b"}[rest[0]]
            name = f"{stage}_{branch}_{param}"
        blobs[name] = array
        blobs[name + "_momentum"] = array * 0
    return blobs


def write_pickle(obj, path, protocol=2) -> None:
    with open(path, "wb") as stream:
        pickle.dump(obj, stream, protocol=protocol)


def read_converted(path) -> dict[str, torch.Tensor]:
    """The model state of a converted file, read as a user would (pickle or torch.load)."""
    if str(path).endswith(".pkl"):
        with open(path, "rb") as stream:
            checkpoint = pickle.load(stream)
    else:
        checkpoint = torch.load(path, weights_only=True)
    return {key: torch.as_tensor(value) for key, value in checkpoint["model"].items()}


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def load_with_checkpointer(model: nn.Module, path) -> list[str]:
    """``DetectionCheckpointer(model).load(path)``; returns the warnings it logged (missing,
    unexpected or mis-shaped keys)."""
    handler = _Records()
    loggers = [logging.getLogger(name) for name in ("fvcore.common.checkpoint", "detectron2.checkpoint")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        DetectionCheckpointer(model).load(str(path))
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    return handler.messages


def assert_loaded(model: nn.Module, converted: dict, prefixes: tuple[str, ...], ignore=()):
    """Every model key under ``prefixes`` (but names ending in ``ignore``) holds the value of exactly
    one converted key it ends with, and every converted key went to one of them."""
    model_state = model.state_dict()
    used = set()
    for key in model_state:
        # our layers' identities are not converted: converted weights load unchecked (layers.base)
        if not key.startswith(prefixes) or key.endswith((*ignore, IDENTITY_KEY)):
            continue
        matches = [name for name in converted if key == name or key.endswith("." + name)]
        assert len(matches) == 1, f"{key}: matched by {matches}"
        assert torch.equal(model_state[key], converted[matches[0]].to(model_state[key].dtype)), key
        used.add(matches[0])
    assert used == set(converted), sorted(set(converted) - used)[:5]
