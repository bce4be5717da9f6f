"""Every way a file becomes RGB pixels: evaluation sees exactly what `pipeline()` sees for the same file.

A run trains one step on a folder holding one file per colour mode (RGB, RGBA, LA, P with transparency, L,
16-bit grey, CMYK, an EXIF-rotated JPEG); then, per file, the pixels and logits of our evaluation path are
compared with `pipeline("image-classification")` on the saved output folder given the file's path.
"""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from runs import train
from tiny import write_label_sets
from vit_finetune import data
from vit_finetune.recipe import DataSettings

SIZE = 32
ORIENTATION = 0x0112  # the EXIF tag


def noise(rng: np.random.Generator, size=(40, 28)) -> np.ndarray:
    """Smooth colour ramps plus noise: any change of orientation, alpha or scale moves the pixels."""
    y, x = np.mgrid[0:size[1], 0:size[0]]
    ramp = np.stack([x * 5, y * 7, (x + y) * 3], axis=-1)
    return np.clip(ramp + rng.normal(0, 30, ramp.shape), 0, 255).astype(np.uint8)


def write_each_mode(folder: Path, rng: np.random.Generator) -> dict[str, Path]:
    """One file per colour mode; transparent pixels hold a colour that is not white, as icons' often do."""
    folder.mkdir(parents=True, exist_ok=True)
    rgb = noise(rng)
    alpha = np.where(np.arange(rgb.shape[1])[None, :] < rgb.shape[1] // 2, 0, 255).repeat(rgb.shape[0], 0)
    files = {}

    def save(name: str, image: Image.Image, **kwargs) -> None:
        files[name] = folder / name
        image.save(files[name], **kwargs)

    save("rgb.png", Image.fromarray(rgb))
    save("rgba.png", Image.fromarray(np.dstack([rgb, alpha]).astype(np.uint8), "RGBA"))
    save("la.png", Image.fromarray(np.dstack([rgb[..., 0], alpha]).astype(np.uint8), "LA"))
    palette = Image.fromarray(rgb).quantize(16)
    save("palette.png", palette, transparency=int(np.asarray(palette)[0, 0]))
    save("grey.png", Image.fromarray(rgb[..., 1]))
    save("grey16.png", Image.fromarray((rgb[..., 2].astype(np.uint16) * 257 // 3 + 20000).astype(np.uint16)))
    save("cmyk.jpg", Image.fromarray(rgb).convert("CMYK"), quality=95)
    exif = Image.Exif()
    exif[ORIENTATION] = 6  # "rotate 90 CW to display": phones write this instead of rotating pixels
    save("rotated.jpg", Image.fromarray(rgb), quality=95, exif=exif)
    assert Image.open(files["grey16.png"]).mode == "I;16" and Image.open(files["cmyk.jpg"]).mode == "CMYK"
    return files


@pytest.fixture(scope="module")
def modes_run(base, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("modes")
    rng = np.random.default_rng(0)
    for split in ("train", "validation"):
        for label in ("a", "b"):
            files = write_each_mode(root / "images" / split / label, rng)
    out = root / "out"
    assert train([f"model.base={base}", f"data.dataset={root / 'images'}", f"model.image_size={SIZE}",
                  "train.batch_size=4", "train.max_steps=1", "model.head_init=random", "data.num_workers=0",
                  "data.alpha_background=null", f"output_dir={out}"]) == 0  # alpha dropped, as pipeline() drops it
    return {"out": out, "images": root / "images", "names": sorted(files)}


def our_eval_pixels_and_logits(out: Path, images: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """file name (class/name) -> (pixels, logits) through the evaluation path of a run, on the saved model."""
    from transformers import AutoImageProcessor, ViTForImageClassification

    settings = DataSettings(dataset=str(images), alpha_background=None)
    splits = data.load_splits(settings, seed=0)
    processor = AutoImageProcessor.from_pretrained(out)
    eval_set = data.eval_dataset(splits, settings, processor, SIZE)
    model = ViTForImageClassification.from_pretrained(out).eval()
    found = {}
    for index in range(len(eval_set)):
        pixels, _label, _skipped = eval_set[(index, 0)]
        path = Path(splits.eval[index][splits.image_column]["path"])
        with torch.no_grad():
            logits = model(pixel_values=data.PixelNormalizer(processor, torch.device("cpu"))(pixels[None])).logits[0]
        found[f"{path.parent.name}/{path.name}"] = (pixels, logits)
    return found


def pipeline_pixels_and_logits(classify, image) -> tuple[torch.Tensor, torch.Tensor]:
    pixels = classify.preprocess(image)["pixel_values"][0]
    scores = classify(image, top_k=None, function_to_apply="none")
    labels = classify.model.config.id2label
    by_label = {entry["label"]: entry["score"] for entry in scores}
    return pixels, torch.tensor([by_label[labels[i]] for i in range(len(labels))])


@pytest.mark.slow
def test_evaluation_sees_the_pixels_and_logits_pipeline_sees_for_each_colour_mode(modes_run):
    from transformers import pipeline

    out, images = modes_run["out"], modes_run["images"]
    ours = our_eval_pixels_and_logits(out, images)
    classify = pipeline("image-classification", model=str(out), device=-1)
    assert len(ours) == 16
    for name, (pixels, logits) in ours.items():
        path = images / "validation" / name
        # 16-bit grey is scaled by our decode (pipeline's load_image clips it): `predict` hands pipeline() our
        # decoded image, so what a user is told to call still sees the evaluated pixels.
        given = data.decode_image({"path": str(path), "bytes": None}, 0, DataSettings()) if "16" in name else str(path)
        their_pixels, their_logits = pipeline_pixels_and_logits(classify, given)
        assert torch.equal(pixels, their_pixels), name
        assert torch.allclose(logits, their_logits, rtol=1e-4, atol=1e-5), (name, logits, their_logits)
    # Alpha is dropped as pipeline() drops it: an RGBA file gives its RGB channels' pixels, transparent or not.
    assert torch.equal(ours["a/rgba.png"][0], ours["a/rgb.png"][0])


def test_a_palette_with_alpha_per_entry_decodes_quietly_to_the_pixels_pipeline_gets():
    """A PNG palette whose entries carry alpha (transparency as bytes): Pillow warns at each convert("RGB"), dozens of
    lines a run; decoded here without a word, to the very pixels convert("RGB") gives (what pipeline() reads)."""
    import warnings

    palette = Image.new("P", (6, 4), 0)
    palette.putpalette([255, 0, 0, 0, 255, 0, 0, 0, 255] + [0] * 759)
    palette.putpixel((0, 0), 1)
    palette.putpixel((1, 0), 2)
    buffer = io.BytesIO()
    palette.save(buffer, format="PNG", transparency=bytes([0, 128, 255]))
    assert isinstance(Image.open(io.BytesIO(buffer.getvalue())).info["transparency"], bytes)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decoded = data.decode_image({"bytes": buffer.getvalue(), "path": None}, 0, DataSettings())
        theirs = Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")
    assert [str(w.message) for w in caught] == ["Palette images with Transparency expressed in bytes should be "
                                                "converted to RGBA images"]  # theirs alone
    assert decoded.mode == "RGB" and np.array_equal(np.asarray(decoded), np.asarray(theirs))


def test_a_16_bit_grey_gradient_is_scaled_to_8_bits_not_clipped():
    gradient = np.linspace(0, 65535, 256).round().astype(np.uint16)[None].repeat(3, 0)
    buffer = io.BytesIO()
    Image.fromarray(gradient).save(buffer, format="PNG")
    assert Image.open(io.BytesIO(buffer.getvalue())).mode == "I;16"
    image = np.asarray(data.decode_image({"bytes": buffer.getvalue(), "path": None}, 0, DataSettings()))
    assert image.shape == (3, 256, 3) and (image == image[..., :1]).all()  # grey in all three channels
    assert image[0, :, 0].tolist() == np.round(gradient[0] / 257).astype(int).tolist()  # 0, 1, ..., 255
    assert image[0, :, 0].tolist() == list(range(256))


def test_exif_orientation_is_applied_as_pipeline_applies_it_for_training_too(tmp_path):
    from transformers.image_utils import load_image

    path = write_each_mode(tmp_path, np.random.default_rng(1))["rotated.jpg"]
    stored = Image.open(path)
    assert stored.size == (40, 28)
    decoded = data.decode_image({"path": str(path), "bytes": None}, 0, DataSettings())
    assert decoded.size == (28, 40)
    assert np.array_equal(np.asarray(decoded), np.asarray(load_image(str(path))))
    # Training decodes through the same function: its crops come from the upright image.
    settings = DataSettings(crop_scale=(1.0, 1.0), horizontal_flip=False)
    table = datasets.Dataset.from_dict({"image": [{"path": str(path), "bytes": None}], "label": [0]})
    splits = data.Splits(table, table, "image", "label", ["a"])
    train_set = data.train_dataset(splits, settings, 8, lambda image, index, epoch: torch.tensor(image.size))
    assert train_set[(0, 0)][0].tolist() == [28, 40]


# ---------------------------------------------------------------- grey deeper than 16 bits, through a training run

GRADIENT = np.linspace(0, 1, 32)  # left to right, black to white in each file's own range


def unsigned_tiff(values: np.ndarray) -> bytes:
    """A 32-bit *unsigned* integer TIFF: Pillow writes only signed ones, so its SampleFormat tag is set by hand."""
    buffer = io.BytesIO()
    Image.fromarray(values.astype(np.uint32).view(np.int32)).save(buffer, format="TIFF")
    signed = b"\x53\x01\x03\x00\x01\x00\x00\x00\x02\x00"  # tag 339 (SampleFormat), SHORT, 1 value: 2 (signed)
    assert buffer.getvalue().count(signed) == 1
    return buffer.getvalue().replace(signed, signed[:-2] + b"\x01\x00")


# class -> (file name, how to write it, the mode Pillow opens it in, the white level the run must scale by)
DEEP_GREY = {
    "int32": ("g.tif", lambda path, v: Image.fromarray(np.round(v * (2**31 - 1)).astype(np.int32)).save(path),
              "I", 2**31 - 1),
    "uint32": ("g.tif", lambda path, v: path.write_bytes(unsigned_tiff(np.round(v * (2**32 - 1)))), "I", 2**32 - 1),
    "float32": ("g.tif", lambda path, v: Image.fromarray(v.astype(np.float32)).save(path), "F", 1.0),
    # Pillow opens a 16-bit PGM as "I" too (stretched to 0..65535): its 32-bit mode must not make it black.
    "pgm16": ("g.pgm", lambda path, v: path.write_bytes(
        b"P5 32 32 65535\n" + np.round(v * 65535).astype(">u2").tobytes()), "I", 65535),
}


def test_32_bit_integer_and_float_grey_tiffs_train_as_their_range_says_not_white_or_black(tmp_path):
    from vit_finetune.artifacts.callbacks import Callback

    images, gradient = tmp_path / "deep-grey", np.tile(GRADIENT, (32, 1))
    for label, (name, write, mode, _) in DEEP_GREY.items():
        for split, copies in (("train", 2), ("validation", 1)):
            for copy in range(copies):
                path = images / split / label / f"{copy}-{name}"
                path.parent.mkdir(parents=True, exist_ok=True)
                write(path, gradient)
                assert Image.open(path).mode == mode
    labels, seen = sorted(DEEP_GREY), {}

    class SeenPixels(Callback):
        def on_batch(self, run, batch):
            for label, pixels in zip(batch["labels"].tolist(), batch["pixel_values"]):
                seen.setdefault(labels[label], []).append(pixels.numpy())

    assert train(["--recipe", "demo", f"data.dataset={images}", f"output_dir={tmp_path / 'out'}", "model.image_size=32",
                  "train.batch_size=8", "train.max_steps=1", "train.warmup_steps=0", "data.crop_scale=[1.0, 1.0]",
                  "data.horizontal_flip=false", "data.num_workers=0"], callbacks=[SeenPixels()]) == 0
    assert sorted(seen) == labels
    for label, (_, _, mode, white) in DEEP_GREY.items():
        # Each file's gradient, scaled by its white level: 0 .. 255 left to right, whatever the file's type.
        stored = gradient if mode == "F" else np.round(gradient * white) / white
        want = np.round(stored * 255).astype(np.uint8)
        assert want[0, 0] == 0 and want[0, -1] == 255
        for pixels in seen[label]:  # CHW uint8: what the model's input is made from
            assert (pixels == pixels[:1]).all(), label  # grey in all three channels
            assert np.array_equal(pixels[0], want), (label, pixels[0][0].tolist())


# ---------------------------------------------------------------- drawings kept in the alpha channel


def icon(kind: str, rng: np.random.Generator, side: int = 32) -> Image.Image:
    """Black strokes on a transparent background, the stroke only in alpha (every pixel's colour is black), as
    drawing tools write icons: a ring or a cross, at a seeded place."""
    y, x = np.mgrid[0:side, 0:side]
    cy, cx = rng.integers(12, side - 12, size=2)
    if kind == "ring":
        stroke = np.abs(np.hypot(y - cy, x - cx) - 8) < 1.5
    else:
        stroke = (np.abs(y - x - (cy - cx)) < 1.5) | (np.abs(y + x - (cy + cx)) < 1.5)
    alpha = np.where(stroke, 255, 0).astype(np.uint8)
    return Image.fromarray(np.dstack([np.zeros((side, side, 3), np.uint8), alpha]), "RGBA")


@pytest.fixture(scope="module")
def icons(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("icons")
    rng = np.random.default_rng(0)
    for split, count in (("train", 8), ("validation", 3)):
        for kind in ("cross", "ring"):
            (root / split / kind).mkdir(parents=True)
            for i in range(count):
                icon(kind, rng).save(root / split / kind / f"{i}.png")
    return root


def test_drawings_in_the_alpha_channel_are_refused_as_flat_with_the_fix_named(base, icons, tmp_path, capsys):
    args = [f"model.base={base}", f"data.dataset={icons}", f"model.image_size={SIZE}", "train.batch_size=4",
            "train.max_steps=2", "data.num_workers=0", "pictures=false", "data.alpha_background=null"]
    assert train([*args, f"output_dir={tmp_path / 'refused'}"]) == 1
    error = capsys.readouterr().err
    assert "16 of the 16 training images checked decode to one flat colour" in error, error[-2000:]
    assert "16 of them keep their drawing in the alpha channel" in error and "data.alpha_background=white" in error
    assert "data.allow_flat_images=true" in error and "Traceback" not in error
    assert not (tmp_path / "refused" / "metrics.json").exists()
    assert train([*args, f"output_dir={tmp_path / 'told'}", "data.allow_flat_images=true"]) == 0
    assert "decode to one flat colour" in capsys.readouterr().out  # said, not refused


@pytest.mark.slow
def test_alpha_background_chosen_by_auto_is_honoured_by_training_predict_explain_export_and_the_page(
        base, icons, tmp_path, capsys):
    from transformers import pipeline

    from vit_finetune.serving.app import classifier
    from vit_finetune.cli import main
    from vit_finetune.serving.onnx_export import parity_images

    out = tmp_path / "out"
    assert train([f"model.base={base}", f"data.dataset={icons}", f"model.image_size={SIZE}", "train.batch_size=4",
                  "train.max_steps=2", "data.num_workers=0", "pictures=false", "data.alpha_background=auto",
                  f"output_dir={out}"]) == 0
    printed = capsys.readouterr().out
    assert "flat colour" not in printed
    line = next(line for line in printed.splitlines() if line.startswith("data.alpha_background=auto"))
    assert "16 keep their drawing in the alpha channel alone" in line and "laid on white" in line, line
    colour = json.loads((out / "config.json").read_text())["alpha_background"]
    assert colour == "white" and yaml.safe_load((out / "recipe.yaml").read_text())["data"]["alpha_background"] == colour
    card = (out / "README.md").read_text()
    assert f"`data.alpha_background: {colour}`" in card
    # What the card tells a pipeline() user to do, run as written: its answers must be predict's.
    snippet = re.search(r"`(Image\.alpha_composite\(.*?\)\.convert\(\"RGB\"\))`", card).group(1)
    files = sorted((icons / "validation").rglob("*.png"))
    prepared = [eval(snippet, {"Image": Image, "image": Image.open(f)}) for f in files]
    classify = pipeline("image-classification", model=str(out))
    expected = [{g["label"]: g["score"] for g in classify(image, top_k=2)} for image in prepared]
    flat = [{g["label"]: g["score"] for g in classify(str(f), top_k=2)} for f in files]  # alpha dropped: all black
    assert all(scores == pytest.approx(flat[0]) for scores in flat) and expected != flat
    assert main(["predict", str(out), *map(str, files), "--output", str(tmp_path / "p.jsonl")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    for row, scores in zip(rows, expected):
        assert {g["label"]: g["score"] for g in row["predictions"]} == pytest.approx(scores, abs=1e-5)
    capsys.readouterr()
    assert main(["explain", str(out), str(files[0]), "--output-dir", str(tmp_path / "explain")]) == 0
    assert f"{files[0]}: {rows[0]['predictions'][0]['label']} {rows[0]['predictions'][0]['score']:.2f}" in \
        capsys.readouterr().out
    page = classifier(str(out), top_k=2, scratch=tmp_path)[0](str(files[0]))[0]
    assert page == pytest.approx({g["label"]: g["score"] for g in rows[0]["predictions"]}, abs=1e-5)
    # export --onnx checks its graph on --images decoded as the model was trained
    from transformers import AutoConfig, AutoImageProcessor

    from vit_finetune.serving.prediction import collect_images

    processor = AutoImageProcessor.from_pretrained(out)
    parity = parity_images(collect_images([str(files[0])]), None, processor, SIZE, AutoConfig.from_pretrained(out))
    assert torch.equal(parity.pixels, processor(images=prepared[:1], return_tensors="pt")["pixel_values"])


# ---------------------------------------------------------------- blank images the task expects


def blank(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (40, 48), (0, 0, 0)).save(path)


def add_rows(label_file: Path, rows: list[dict]) -> None:
    with open(label_file, newline="") as file:
        kept = list(csv.DictReader(file))
    with open(label_file, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(kept[0]))
        writer.writeheader()
        writer.writerows(kept + rows)


def test_blank_multi_label_negatives_are_not_called_flat_but_a_blank_with_labels_is(base, tmp_path, capsys):
    """docs/multilabel.md: images with no label train as negatives; a blank one is a deliberate negative. A blank
    image said to show a label is still named."""
    label_file = write_label_sets(tmp_path / "sets", images=12, split_column=True)
    for i in range(7):
        blank(tmp_path / "sets" / "blank" / f"{i}.png")
    add_rows(label_file, [{"file_name": f"blank/{i}.png", "labels": "red" if i == 0 else "", "split": "train"}
                          for i in range(7)])
    assert train([f"model.base={base}", f"data.dataset={label_file}", f"model.image_size={SIZE}", "train.max_steps=1",
                  "train.batch_size=4", "data.num_workers=0", "pictures=false", "train.method=finetune",
                  f"output_dir={tmp_path / 'out'}"]) == 0
    out = capsys.readouterr().out
    assert "1 of the 15 training images checked decode to one flat colour" in out and "blank/0.png" in out


def test_blank_images_with_a_regression_target_are_not_called_flat(base, tmp_path, capsys):
    """A regression's blank image can have a value (an empty dish counts 0)."""
    rng = np.random.default_rng(0)
    rows = ["file_name,count,split"]
    for i in range(12):
        path = tmp_path / "dishes" / f"{i}.png"
        if i % 2:
            blank(path)
            rows.append(f"{i}.png,0,{'validation' if i % 4 == 1 else 'train'}")
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 255, (48, 40, 3), dtype=np.uint8)).save(path)
            rows.append(f"{i}.png,{i},{'validation' if i % 4 == 0 else 'train'}")
    (tmp_path / "dishes" / "counts.csv").write_text("\n".join(rows) + "\n")
    assert train([f"model.base={base}", f"data.dataset={tmp_path / 'dishes' / 'counts.csv'}", "data.task=regression",
                  "data.label_column=count", f"model.image_size={SIZE}", "train.max_steps=1", "train.batch_size=4",
                  "data.num_workers=0", "pictures=false", f"output_dir={tmp_path / 'out'}"]) == 0
    assert "flat colour" not in capsys.readouterr().out
