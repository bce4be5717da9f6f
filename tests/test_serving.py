"""Serving: `export --onnx` on a short fine-tune of the shipped demo model (moved from 32 to 64 px), the parity check
that refuses a graph and leaves nothing half-written, int8 quantisation measured on the run's eval split, LoRA runs
exported merged, and `predict --runtime onnx` giving the torch path's labels."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from runs import train
from tiny import run_cli
from vit_finetune import synthetic
from vit_finetune.cli import main

pytestmark = pytest.mark.slow  # a short demo run and three exports (~1-3 min on 2 shared cores)
pytest.importorskip("onnxruntime", reason="the [onnx] extra is not installed (pip install -e .[dev] installs it)")
pytest.importorskip("onnxscript", reason="the [onnx] extra is not installed (pip install -e .[dev] installs it)")

# The demo recipe, cut to a few steps: the model is the shipped tiny ViT resampled to 64 px.
SHORT_DEMO = ["--recipe", "demo", "--quiet", "train.epochs=1", "train.warmup_steps=0", "data.max_train_samples=96",
              "data.max_eval_samples=24", "data.num_workers=0"]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("serving") / "demo"
    assert train([*SHORT_DEMO, f"output_dir={output}"]) == 0
    return output


@pytest.fixture(scope="module")
def exported(demo_run) -> Path:
    """The demo run exported through the real command line, with int8 weights."""
    result = run_cli("export", str(demo_run), "--onnx", "--quantize", "int8")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "parity: max abs logit difference" in result.stdout
    return demo_run / "onnx"


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_the_export_is_at_the_trained_resolution_with_a_dynamic_batch_axis(exported, demo_run):
    import onnx

    graph = onnx.load(str(exported / "model.onnx")).graph
    (pixels,), (logits,) = graph.input, graph.output
    dims = [d.dim_param or d.dim_value for d in pixels.type.tensor_type.shape.dim]
    assert pixels.name == "pixel_values" and dims[1:] == [3, 64, 64] and isinstance(dims[0], str)
    classes = len(synthetic.TASKS["demo"]["classes"])
    assert logits.name == "logits" and logits.type.tensor_type.shape.dim[1].dim_value == classes
    report = json.loads((exported / "export.json").read_text())
    assert report["image_size"] == 64 and 0 <= report["parity"]["max_abs_logit_difference"] <= 1e-3
    for name in ("config.json", "preprocessor_config.json", "model_quantized.onnx"):
        assert (exported / name).is_file()
    assert not [p.name for p in demo_run.iterdir() if ".partial-" in p.name or ".old-" in p.name]
    assert "onnx" in json.loads((demo_run / ".vit_finetune_manifest.json").read_text())["written"]


def test_int8_figures_are_measured_on_the_runs_own_eval_split(exported, demo_run):
    quantized = json.loads((exported / "export.json").read_text())["quantized"]
    metrics = json.loads((demo_run / "metrics.json").read_text())
    assert quantized["images"] == metrics["eval_samples"] == 24
    # The float graph equals PyTorch (parity), so on the same split it scores the run's own accuracy.
    assert quantized["float_accuracy"] == pytest.approx(metrics["accuracy"])
    assert quantized["accuracy_change"] == pytest.approx(quantized["int8_accuracy"] - quantized["float_accuracy"])
    assert quantized["speedup"] > 0 and quantized["float_images_per_s"] > 0


@pytest.mark.parametrize("runtime", ["onnx", "onnx-int8"])
def test_predict_with_the_onnx_runtime_gives_the_torch_labels(exported, demo_run, runtime, tmp_path):
    every = sorted(str(p) for p in _demo_validation_folder().rglob("*.png"))
    images = every[::len(every) // 24][:24]  # spread over the classes, which come folder by folder
    assert main(["predict", str(demo_run), *images, "--output", str(tmp_path / "torch.csv")]) == 0
    assert main(["predict", str(demo_run), *images, "--runtime", runtime, "--output", str(tmp_path / "onnx.csv")]) == 0
    torch_rows, onnx_rows = read_csv(tmp_path / "torch.csv"), read_csv(tmp_path / "onnx.csv")
    assert len(onnx_rows) == 24 and [r["image"] for r in onnx_rows] == [r["image"] for r in torch_rows]
    assert [r["label_1"] for r in onnx_rows] == [r["label_1"] for r in torch_rows]
    if runtime == "onnx":
        assert all(float(o["score_1"]) == pytest.approx(float(t["score_1"]), abs=1e-5)
                   for o, t in zip(onnx_rows, torch_rows))
    # The export folder itself is a model one can name.
    assert main(["predict", str(exported), images[0], "--runtime", runtime, "--output", str(tmp_path / "e.csv")]) == 0
    assert read_csv(tmp_path / "e.csv")[0]["label_1"] == torch_rows[0]["label_1"]


def _demo_validation_folder() -> Path:
    from vit_finetune.data import cache_dir

    return synthetic.ensure_demo_dataset(cache_dir() / "shapes") / "validation"  # where builtin:shapes lives


def test_a_graph_outside_the_tolerance_is_refused_and_the_earlier_export_kept(exported, demo_run, capsys):
    before = {p.name: p.read_bytes() for p in exported.iterdir()}
    # fp32 export and PyTorch differ by rounding (~1e-7 here, see export.json), never by less than 1e-15.
    assert main(["export", str(demo_run), "--onnx", "--tolerance", "1e-15"]) == 1
    error = capsys.readouterr().err
    assert "differ from PyTorch's by" in error and "more than the tolerance 1e-15" in error
    assert {p.name: p.read_bytes() for p in exported.iterdir()} == before  # quantised file and all: untouched
    assert not [p.name for p in demo_run.iterdir() if ".partial-" in p.name or ".old-" in p.name]


def test_a_folder_of_the_users_is_never_an_export_target(demo_run, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert main(["export", str(demo_run), "--onnx", "--output", str(mine)]) == 1
    assert "not an ONNX export of this toolkit" in capsys.readouterr().err
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and (mine / "notes.txt").read_text() == "keep me"


def test_bad_export_requests_fail_before_work(demo_run, tmp_path, capsys):
    assert main(["export", str(demo_run)]) == 1
    assert "pass --onnx" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "no-such-run"), "--onnx"]) == 1
    assert "folder not found" in capsys.readouterr().err


def test_predict_onnx_without_an_export_names_the_command_that_makes_it(args, tmp_path, images, capsys):
    output = tmp_path / "plain"
    assert train([*args, f"output_dir={output}", "train.epochs=1"]) == 0
    image = next((images / "validation").rglob("*.png"))
    assert main(["predict", str(output), str(image), "--runtime", "onnx"]) == 1
    assert f"python -m vit_finetune export {output} --onnx" in capsys.readouterr().err


def test_a_lora_run_exports_its_merged_model(args, tmp_path, images):
    import onnx

    output = tmp_path / "lora"
    assert train([*args, f"output_dir={output}", "train.epochs=1", "model.lora={r: 4, alpha: 8, dropout: 0.0}"]) == 0
    assert (output / "adapter" / "adapter_config.json").is_file()
    assert main(["export", str(output), "--onnx", "--output", str(tmp_path / "served")]) == 0
    initializers = [i.name for i in onnx.load(str(tmp_path / "served" / "model.onnx")).graph.initializer]
    assert initializers and not [name for name in initializers if "lora" in name.lower()]
    picked = sorted(str(p) for p in (images / "validation").rglob("*.png"))
    assert main(["predict", str(output), *picked, "--output", str(tmp_path / "t.csv")]) == 0
    assert main(["predict", str(tmp_path / "served"), *picked, "--runtime", "onnx", "--output", str(tmp_path / "o.csv")]) == 0
    assert [r["label_1"] for r in read_csv(tmp_path / "o.csv")] == [r["label_1"] for r in read_csv(tmp_path / "t.csv")]
