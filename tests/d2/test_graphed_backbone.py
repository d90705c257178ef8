"""GraphedBackbone: the wrapped backbone's names, state-dict keys and interface, so checkpoints load into
the model with or without it; bad options and a call off CUDA refused with what is wrong. On CUDA
(tools/gpu_checks.sh), replays against the eager backbone for SN and GN: the same outputs, gradients and
running statistics over training steps (also under autocast with its cache on, accumulating gradients,
and in DistributedDataParallel), the same inference; an input signature beyond the bound runs eagerly,
says so once, and matches; moving or loading the model drops the graphs."""

import copy
import logging

import pytest
import torch
import torch.distributed as dist
from detectron2.modeling import Backbone, build_model
from tiny_rcnn import IMAGE_SIZE, tiny_cfg
from torch import nn

from sn_detection.d2.graphed_backbone import GraphedBackbone, graph_backbone

NORMS = ["SN", "GN"]
STEPS = 6  # 3 eager warm-up steps, the capture, and replays
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def tiny_model(norm="SN", seed=0, device="cpu"):
    """A narrow Mask R-CNN R50-FPN (tiny_rcnn) with ``norm`` everywhere, stem and res2 frozen."""
    torch.manual_seed(seed)
    return build_model(tiny_cfg(norm, "fpn", "MODEL.DEVICE", device))


def test_names_keys_and_interface_are_the_wrapped_backbones():
    model = tiny_model()
    backbone = model.backbone
    names = [name for name, _ in model.named_modules()]
    state = model.state_dict()
    parameters = dict(model.named_parameters())
    graph_backbone(model)
    assert isinstance(model.backbone, GraphedBackbone) and isinstance(model.backbone, Backbone)
    assert [name for name, _ in model.named_modules()] == names
    assert list(model.state_dict()) == list(state)
    assert {name: id(p) for name, p in model.named_parameters()} == {name: id(p) for name, p in parameters.items()}
    assert model.backbone.output_shape() == backbone.output_shape()
    assert model.backbone.size_divisibility == backbone.size_divisibility == 32
    assert model.backbone.padding_constraints == backbone.padding_constraints
    assert model.backbone.bottom_up is backbone.bottom_up and model.backbone._out_features == backbone._out_features


def test_checkpoints_load_both_ways():
    graphed, eager = graph_backbone(tiny_model(seed=1)), tiny_model(seed=2)
    graphed.load_state_dict(eager.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(graphed.state_dict().values(), eager.state_dict().values()))
    other = graph_backbone(tiny_model(seed=3))
    eager.load_state_dict(other.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), eager.state_dict().values()))


def test_a_copy_is_the_same_backbone_with_its_own_modules():
    model = graph_backbone(tiny_model())
    copied = copy.deepcopy(model)
    assert copied.backbone.bottom_up is not model.backbone.bottom_up
    assert copied.backbone.bottom_up is copied.backbone._backbone.bottom_up  # one module, under both
    assert repr(copied) == repr(model)


def test_a_call_off_cuda_is_refused():
    model = graph_backbone(tiny_model())
    with pytest.raises(RuntimeError, match="replays CUDA graphs: its input must be on a CUDA device, not cpu"):
        model.backbone(torch.zeros(2, 3, IMAGE_SIZE, IMAGE_SIZE))


class OwnWeight(Backbone):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return {"out": x * self.scale}


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: GraphedBackbone(tiny_model().backbone, max_graphs=0), "max_graphs=0 is invalid: it must be an int"),
        (lambda: GraphedBackbone(tiny_model().backbone, warmup="3"), "warmup='3' is invalid: it must be an int >= 1"),
        (lambda: GraphedBackbone(OwnWeight()), r"OwnWeight holds parameters or buffers of its own \(\['scale'\]\)"),
        (lambda: graph_backbone(graph_backbone(tiny_model())), "the model's backbone is a GraphedBackbone already"),
        (lambda: graph_backbone(nn.Linear(2, 2)), "Linear has no detectron2 Backbone called 'backbone'"),
    ],
    ids=["no graphs", "warmup not an int", "own parameters", "twice", "no backbone"],
)
def test_bad_options_are_refused(build, message):
    with pytest.raises(ValueError, match=message):
        build()


# --- CUDA: replays against the eager backbone -------------------------------------------------------------


def twins(norm, **options):
    """The eager backbone of a tiny model on CUDA and a graphed copy of it, and an SGD (momentum) of each."""
    eager = tiny_model(norm, device="cuda").backbone
    graphed = GraphedBackbone(copy.deepcopy(eager), **options)
    return [(module, sgd(module)) for module in (eager, graphed)]


def sgd(module):
    return torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)


def inputs(count, size=IMAGE_SIZE, seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(2, 3, size, size, device="cuda", generator=generator) for _ in range(count)]


def loss_of(features):
    """A loss that weighs every output element differently, fixed per level."""
    total = 0
    for index, value in enumerate(features.values()):
        weights = torch.linspace(-1, 1, value.numel(), device=value.device).view_as(value) * (index + 1)
        total = total + (value.float() * weights).sum()
    return total


def train_steps(module, optimizer, batches, zero=True):
    """Outputs and gradients (copies) of a training step per batch."""
    module.train()
    record = []
    for batch in batches:
        features = module(batch)
        if zero:
            optimizer.zero_grad(set_to_none=True)
        loss_of(features).backward()
        record.append(
            (
                {key: value.detach().clone() for key, value in features.items()},
                [None if p.grad is None else p.grad.clone() for p in module.parameters()],
            )
        )
        optimizer.step()
    return record


def assert_close(actual, expected, tolerance):
    """Equal up to ``tolerance`` of the expected tensor's largest magnitude: what the order of a sum in a
    convolution's algorithm may change."""
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance * scale)


def assert_same(eager, graphed, tolerance=1e-4):
    for (outputs, grads), (outputs_g, grads_g) in zip(eager, graphed):
        assert outputs.keys() == outputs_g.keys()
        for key in outputs:
            assert_close(outputs_g[key], outputs[key], tolerance)
        for grad, grad_g in zip(grads, grads_g):
            assert (grad is None) == (grad_g is None)
            if grad is not None:
                assert_close(grad_g, grad, tolerance)


def assert_same_buffers(eager, graphed):
    buffers = dict(eager.named_buffers())
    assert buffers.keys() == dict(graphed.named_buffers()).keys()
    for name, buffer in graphed.named_buffers():
        assert_close(buffer.double(), buffers[name].double(), 1e-5)


@cuda
@pytest.mark.parametrize("norm", NORMS)
def test_cuda_training_replays_as_eager_training(norm):
    """Outputs and gradients at every step (frozen stages get none), running statistics and weights after."""
    (eager, eager_sgd), (graphed, graphed_sgd) = twins(norm, max_graphs=1)
    batches = inputs(STEPS)
    assert_same(train_steps(eager, eager_sgd, batches), train_steps(graphed, graphed_sgd, batches))
    assert len(graphed.captured) == 1 and graphed.captured[0].training and graphed.captured[0].needs_grad
    assert_same_buffers(eager, graphed)
    if norm == "SN":
        assert int(graphed.bottom_up.res3[0].conv1.norm.num_batches_tracked) == STEPS
    for p, p_graphed in zip(eager.parameters(), graphed.parameters()):
        assert_close(p_graphed, p, 1e-4)


@cuda
def test_cuda_gradients_accumulate_as_eagerly():
    """Two backward passes into the same .grad: the second replay must not overwrite the first's."""
    (eager, eager_sgd), (graphed, graphed_sgd) = twins("SN", max_graphs=1, warmup=1)
    batches = inputs(4)
    train_steps(eager, eager_sgd, batches[:2])
    train_steps(graphed, graphed_sgd, batches[:2])  # captured at the second
    assert_same(
        train_steps(eager, eager_sgd, batches[2:], zero=False),
        train_steps(graphed, graphed_sgd, batches[2:], zero=False),
    )


@cuda
@pytest.mark.parametrize("norm", NORMS)
def test_cuda_inference_replays_as_eager_inference(norm):
    (eager, _), (graphed, _) = twins(norm, max_graphs=2, warmup=2)
    eager.eval()
    graphed.eval()
    with torch.no_grad():
        for batch in inputs(4):
            expected, replayed = eager(batch), graphed(batch)
            for key in expected:
                assert_close(replayed[key], expected[key], 1e-4)
    assert [signature.training for signature in graphed.captured] == [False]


class Messages(logging.Handler):
    """The messages logged to a logger while attached (detectron2's setup_logger stops "sn_detection"
    propagating to the root logger, where pytest's caplog listens)."""

    def __init__(self, name):
        super().__init__(logging.INFO)
        self.logger, self.messages = logging.getLogger(name), []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        self.level = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc_info):
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level)


@cuda
def test_cuda_a_signature_beyond_the_bound_runs_eagerly_and_matches():
    (eager, eager_sgd), (graphed, graphed_sgd) = twins("SN", max_graphs=1, warmup=1)
    small, large = inputs(2), inputs(3, size=2 * IMAGE_SIZE, seed=1)
    assert_same(train_steps(eager, eager_sgd, small), train_steps(graphed, graphed_sgd, small))
    with Messages("sn_detection.d2.graphed_backbone") as log:
        assert_same(train_steps(eager, eager_sgd, large), train_steps(graphed, graphed_sgd, large))
    assert [signature.shape for signature in graphed.captured] == [(2, 3, IMAGE_SIZE, IMAGE_SIZE)]
    bound = [message for message in log.messages if "max_graphs=1" in message]
    assert len(bound) == 1 and f"input [2, 3, {2 * IMAGE_SIZE}, {2 * IMAGE_SIZE}]" in bound[0]
    assert_same_buffers(eager, graphed)


@cuda
def test_cuda_autocast_with_its_cache_replays_as_eagerly():
    """detectron2's AMPTrainer autocasts with the weight-cast cache on; the weights change every step."""
    (eager, eager_sgd), (graphed, graphed_sgd) = twins("SN", max_graphs=1, warmup=2)
    batches = inputs(5)
    with torch.autocast("cuda", dtype=torch.float16):
        expected = train_steps(eager, eager_sgd, batches)
        replayed = train_steps(graphed, graphed_sgd, batches)
    assert graphed.captured[0].autocast == torch.float16
    assert_same(expected, replayed, tolerance=2e-3)


@cuda
def test_cuda_ddp_gets_every_gradient(tmp_path):
    """DistributedDataParallel (one process) reduces the replayed gradients: its hooks fire at every step,
    else its next forward would fail for the reduction it still waits for."""
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        (eager, eager_sgd), (graphed, graphed_sgd) = twins("GN", max_graphs=1, warmup=1)
        ddp = nn.parallel.DistributedDataParallel(graphed, device_ids=[torch.cuda.current_device()])
        batches = inputs(4)
        assert_same(train_steps(eager, eager_sgd, batches), train_steps(ddp, graphed_sgd, batches))
        assert len(graphed.captured) == 1
    finally:
        dist.destroy_process_group()


@cuda
def test_cuda_moving_or_loading_the_model_drops_the_graphs():
    (eager, _), (graphed, graphed_sgd) = twins("SN", max_graphs=1, warmup=1)
    batches = inputs(2)
    train_steps(graphed, graphed_sgd, batches)
    assert len(graphed.captured) == 1
    graphed.cuda()
    assert graphed.captured == []
    train_steps(graphed, graphed_sgd, batches)
    graphed.load_state_dict(eager.state_dict())
    assert graphed.captured == []
    assert_same(train_steps(eager, sgd(eager), batches), train_steps(graphed, sgd(graphed), batches))
    assert len(graphed.captured) == 1


@cuda
def test_cuda_hooks_inside_the_backbone_run_eagerly_while_registered():
    """A replay would skip them (the MN / MGN gate recorder of the norm analysis is such a hook)."""
    (eager, eager_sgd), (graphed, graphed_sgd) = twins("SN", max_graphs=1, warmup=1)
    batches = inputs(5)
    assert_same(train_steps(eager, eager_sgd, batches[:2]), train_steps(graphed, graphed_sgd, batches[:2]))
    assert len(graphed.captured) == 1
    seen = []
    handle = graphed.bottom_up.res3[0].conv1.norm.register_forward_pre_hook(lambda module, args: seen.append(1))
    assert_same(train_steps(eager, eager_sgd, batches[2:4]), train_steps(graphed, graphed_sgd, batches[2:4]))
    handle.remove()
    assert_same(train_steps(eager, eager_sgd, batches[4:]), train_steps(graphed, graphed_sgd, batches[4:]))
    assert len(seen) == 2
