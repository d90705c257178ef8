"""Files of the wrong kind fail with a message that names the problem and the expected layout, and the
command line then prints that error first, only the keys that do not fit, and that it wrote nothing, and
exits with status 2."""

import datetime

import pytest
import torch
from resnet_sources import sn_authors_checkpoint, torchvision_resnet, write_pickle

from sn_detection.conversion import ConversionError, convert_file
from sn_detection.conversion.cli import EXIT_FAILURE, main
from sn_detection.layers import SwitchableNorm2d


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """ResNet-18 files (small and quick) of the torchvision and SN layouts, plus a random pickle."""
    directory = tmp_path_factory.mktemp("wrong_kind")
    bn_state = torchvision_resnet(18, seed=7).state_dict()
    torch.save(bn_state, directory / "resnet18.pth")
    sn_net = torchvision_resnet(18, norm_layer=SwitchableNorm2d, seed=8)
    torch.save(sn_authors_checkpoint(sn_net), directory / "resnet18_sn.pth")
    write_pickle({"weights": [1, 2, 3], "name": "not a checkpoint"}, directory / "random.pkl")
    (directory / "garbage.bin").write_bytes(bytes(range(256)) * 64)
    return directory, bn_state


def modified(files, tmp_path, change) -> str:
    """The torchvision file with ``change(state)`` applied."""
    state = dict(files[1])
    change(state)
    path = tmp_path / "modified.pth"
    torch.save(state, path)
    return str(path)


def test_torchvision_file_given_as_sn(files):
    with pytest.raises(ConversionError) as error:
        convert_file("sn", str(files[0] / "resnet18.pth"))
    message = str(error.value)
    assert "does not have the 'sn' layout" in message
    assert "sn1.{weight,bias,mean_weight,var_weight,running_mean,running_var}" in message  # the expected layout
    assert "look like a torchvision BN ResNet (--source torchvision)" in message
    assert "sn1.mean_weight" in error.value.report.missing


def test_sn_file_given_as_torchvision(files):
    with pytest.raises(ConversionError, match=r"look like an SN ImageNet checkpoint \(--source sn\)"):
        convert_file("torchvision", str(files[0] / "resnet18_sn.pth"))


def test_torch_file_given_as_gn(files):
    with pytest.raises(ConversionError, match="zip archive .* not a pickle"):
        convert_file("gn", str(files[0] / "resnet18.pth"))


@pytest.mark.parametrize("source", ["sn", "torchvision", "gn"])
@pytest.mark.parametrize("name", ["random.pkl", "garbage.bin"])
def test_random_files(files, source, name):
    with pytest.raises(ConversionError, match=r"not a PyTorch checkpoint|not a pickle|no key of the expected layout"):
        convert_file(source, str(files[0] / name))


def test_missing_file(tmp_path):
    with pytest.raises(ConversionError, match="no such file"):
        convert_file("torchvision", str(tmp_path / "absent.pth"))


def test_truncated_file(files, tmp_path):
    path = tmp_path / "truncated.pth"
    data = (files[0] / "resnet18.pth").read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ConversionError, match="not a PyTorch checkpoint"):
        convert_file("torchvision", str(path))


def test_missing_tensor_is_named(files, tmp_path):
    path = modified(files, tmp_path, lambda state: state.pop("layer3.1.bn2.running_var"))
    with pytest.raises(ConversionError, match="1 missing") as error:
        convert_file("torchvision", path)
    assert error.value.report.missing == ["layer3.1.bn2.running_var"]


def test_missing_block_is_named(files, tmp_path):
    def drop_block(state):
        for key in [key for key in state if key.startswith("layer2.0.")]:
            del state[key]

    with pytest.raises(ConversionError) as error:
        convert_file("torchvision", modified(files, tmp_path, drop_block))
    assert "layer2.0.conv1.weight" in error.value.report.missing
    assert "layer2.0.downsample.1.running_mean" in error.value.report.missing


def test_wrong_conv_shape_is_mismatched(files, tmp_path):
    path = modified(files, tmp_path, lambda state: state.update({"layer2.1.conv2.weight": torch.zeros(128, 128, 1, 1)}))
    with pytest.raises(ConversionError, match="1 mismatched") as error:
        convert_file("torchvision", path)
    assert error.value.report.mismatched == [
        ("layer2.1.conv2.weight", "shape (128, 128, 1, 1), detectron2 expects (128, 128, 3, 3)")
    ]


def test_wrong_norm_size_is_mismatched(files, tmp_path):
    path = modified(files, tmp_path, lambda state: state.update({"layer1.0.bn1.bias": torch.zeros(63)}))
    with pytest.raises(ConversionError) as error:
        convert_file("torchvision", path)
    assert error.value.report.mismatched == [("layer1.0.bn1.bias", "shape (63,), expected 64 values")]


def test_depth_detectron2_does_not_build(files, tmp_path):
    def drop_last_block(state):
        for key in [key for key in state if key.startswith("layer4.1.")]:
            del state[key]

    with pytest.raises(ConversionError, match=r"basic blocks per stage \(2, 2, 2, 1\) are none of the ResNets"):
        convert_file("torchvision", modified(files, tmp_path, drop_last_block))


def test_sn_layers_must_agree_on_the_bn_branch(files, tmp_path):
    checkpoint = torch.load(files[0] / "resnet18_sn.pth", weights_only=True)
    checkpoint["state_dict"]["module.layer2.0.sn1.mean_weight"] = torch.zeros(2)
    path = tmp_path / "mixed.pth"
    torch.save(checkpoint, path)
    with pytest.raises(ConversionError, match="disagree on the number of logits"):
        convert_file("sn", str(path))


def test_norm_the_source_cannot_initialise(files):
    with pytest.raises(ConversionError, match=r"'sn' checkpoint \(SN\) cannot initialise BN layers"):
        convert_file("sn", str(files[0] / "resnet18_sn.pth"), norm="BN")


def refusal(files, tmp_path, capsys, name, *flags) -> list[str]:
    """The lines a refused conversion of ``name`` prints, after checking that it exits with status 2,
    prints nothing on stdout and writes nothing."""
    destination = tmp_path / "out.pkl"
    assert main([str(files[0] / name), str(destination), *flags]) == EXIT_FAILURE
    out, err = capsys.readouterr()
    assert out == "" and list(tmp_path.iterdir()) == []
    lines = err.splitlines()
    assert lines[-1] == f"nothing was written to {destination}"
    return lines


def test_a_refusal_says_so_first_and_prints_no_report(files, tmp_path, capsys):
    """A wrong-layout file: the error first, then only the keys that do not fit, then that nothing was
    written; no converted keys and no input convention, which read as if part of the file were usable."""
    lines = refusal(files, tmp_path, capsys, "resnet18.pth", "--source", "sn")
    assert lines[0].startswith("error: ") and "does not have the 'sn' layout: 108 missing tensor(s)" in lines[0]
    assert "Its keys look like a torchvision BN ResNet (--source torchvision)" in lines[0]
    assert lines[1] == "what does not fit (--verbose lists every key):"
    assert lines[2:5] == ["  missing: 108", "    sn1.weight", "    sn1.bias"]
    text = "\n".join(lines)
    for report_only in ("converted", "initialised", "skipped", "input convention", "PIXEL_MEAN", "wrote"):
        assert report_only not in text


def test_a_refused_mismatch_names_the_tensor(files, tmp_path, capsys):
    state = dict(files[1])
    state["layer2.1.conv2.weight"] = torch.zeros(128, 128, 1, 1)
    torch.save(state, files[0] / "mismatched.pth")
    lines = refusal(files, tmp_path, capsys, "mismatched.pth", "--source", "torchvision")
    assert "1 mismatched tensor(s) for ResNet-18" in lines[0] and "missing" not in lines[0]
    assert lines[1:-1] == [
        "what does not fit (--verbose lists every key):",
        "  mismatched: 1",
        "    layer2.1.conv2.weight: shape (128, 128, 1, 1), detectron2 expects (128, 128, 3, 3)",
    ]


def test_a_verbose_refusal_lists_every_key(files, tmp_path, capsys):
    lines = refusal(files, tmp_path, capsys, "resnet18.pth", "--source", "sn", "--verbose")
    assert lines[1] == "what does not fit:" and "layer4.1.sn2.running_var" in {line.strip() for line in lines}
    assert "  skipped: 90" in lines and not any("more; --verbose" in line for line in lines)


def test_a_file_of_the_wrong_kind_is_refused_in_two_lines(files, tmp_path, capsys):
    lines = refusal(files, tmp_path, capsys, "resnet18.pth", "--source", "gn")
    assert lines == [
        f"error: {files[0] / 'resnet18.pth'} is a zip archive (torch.save's format), not a pickle",
        f"nothing was written to {tmp_path / 'out.pkl'}",
    ]


def test_a_conversion_prints_its_report_and_what_it_wrote(files, tmp_path, capsys):
    destination = tmp_path / "out.pkl"
    assert main([str(files[0] / "resnet18.pth"), str(destination), "--source", "torchvision"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and destination.is_file()
    assert out.startswith("source 'torchvision': ResNet-18 -> detectron2 ResNet keys for norm BN\n  converted: 100\n")
    assert "    INPUT.FORMAT RGB\n" in out and f"\nwrote {destination}\nlicence: torchvision's" in out


def test_cli_rejects_an_unknown_output_suffix(files, tmp_path, capsys):
    assert main([str(files[0] / "resnet18.pth"), str(tmp_path / "out.txt"), "--source", "torchvision"]) == 2
    assert "must end in one of ['.pkl', '.pt', '.pth']" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_cli_rejects_unknown_norm(files, tmp_path):
    with pytest.raises(SystemExit):
        main([str(files[0] / "resnet18.pth"), str(tmp_path / "o.pkl"), "--source", "torchvision", "--norm", "LN"])


def test_torch_file_with_arbitrary_objects_is_refused(tmp_path):
    """torch sources only unpickle tensors and plain containers (weights_only)."""
    path = tmp_path / "objects.pth"
    torch.save({"conv1.weight": datetime.date(2018, 7, 2)}, path)
    with pytest.raises(ConversionError, match="not a PyTorch checkpoint"):
        convert_file("torchvision", str(path))


def test_the_sn_authors_detection_copy_is_named(files, tmp_path):
    """SwitchNorm_Detection publishes its backbones renamed for Detectron.pytorch ({"model": ...} with keys
    Conv_Body.conv_body.res1.conv1.weight, ...res1.sn1.*, ...res2.0.conv1.weight): the refusal says so and
    points to the ImageNet checkpoint."""
    state = torch.load(files[0] / "resnet18_sn.pth", weights_only=True)["state_dict"]
    renamed = {}
    for key, value in state.items():
        key = key.removeprefix("module.")
        if key.startswith(("conv1.", "sn1.")):
            renamed[f"Conv_Body.conv_body.res1.{key}"] = value
        elif key.startswith("layer"):
            renamed[f"Conv_Body.conv_body.res{int(key[5]) + 1}{key[6:]}"] = value
    assert "Conv_Body.conv_body.res2.0.sn1.mean_weight" in renamed
    path = tmp_path / "resnet-sn-18-fpn.pth"
    torch.save({"model": renamed}, path)
    with pytest.raises(ConversionError) as error:
        convert_file("sn", str(path))
    assert "no key of the expected layout was found" in str(error.value)
    assert "look like the SN authors' detection code's copy of an SN ImageNet ResNet" in str(error.value)
