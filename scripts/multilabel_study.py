"""Multi-label study on real images: does multi-label training beat the obvious baselines, over seeds?

    python scripts/multilabel_study.py --seeds 0,1,2                      # the shipped builtin:tiny-vit-32
    python scripts/multilabel_study.py --seeds 0,1,2 --size 32 --epochs 4 --lr 0.002   # a shorter schedule
    python scripts/make_real_base.py   # once: the real DINOv2-S/14 base (outputs/real_base/...)
    python scripts/multilabel_study.py --base outputs/real_base/dinov2-s14-saliency --size 56 --lr auto --seeds 0,1,2
    python scripts/multilabel_study.py --table                            # every result recorded so far

Data: 2x2 mosaics (56x56 px) of real Fashion-MNIST images (Debian's dataset-fashion-mnist,
/usr/share/datasets/fashion-mnist), 2-4 cells filled, each cell's class drawn with skewed frequencies (weight
1/(rank+1), shirts most often, boots least), empty cells black. A mosaic's labels are the set of its classes. One
label file holds both splits (labels.csv, 'split' column); a single-label copy (labels_single.csv) gives each
mosaic the class of one of its cells, drawn at random, as a user with a single-label tool would label it.

Methods, all scored on the same half of the eval split (the other half chooses thresholds and k):
  multi-label      `python -m vit_finetune` on labels.csv, train.threshold_holdout=0.5 (thresholds chosen on the
                   first half, as saved in config.json); its metrics.json is read as it is
  frequent labels  no model: every image gets each label's training frequency as its score; per-class thresholds
                   chosen on the choosing half (so: the labels that are worth always predicting)
  single top-k     a single-label model trained on labels_single.csv; its k best labels (k chosen on the choosing
                   half) are the prediction; softmax scores for mAP
Both models share one schedule: batch 32, AdamW, --lr (auto: the toolkit's train.lr=auto and head_lr=auto, 2e-5 for
the backbone and 2e-3 for the new head), weight decay 0.05, 10 warm-up steps, cosine decay, one torch thread.
Results are appended to <root>/results.jsonl. The real-base seeds measured so far (docs/multilabel.md) are kept in
scripts/multilabel_study_results.jsonl: copy it to <root>/results.jsonl to print or extend their table.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import statistics
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

FASHION = Path("/usr/share/datasets/fashion-mnist")
CLASSES = ["tshirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "boot"]
FREQUENCY_ORDER = [6, 0, 2, 4, 3, 7, 1, 8, 5, 9]  # most to least frequent: weight 1 / (rank + 1)
CELL = 28


def read_idx(name: str) -> np.ndarray:
    with gzip.open(FASHION / name) as file:
        raw = file.read()
    dims = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def make_mosaics(root: Path, train: int, evaluation: int, seed: int = 1234) -> Path:
    """root/images/*.png and root/labels.csv, labels_single.csv; written once (a fixed data seed)."""
    from PIL import Image

    if (root / "labels.csv").is_file():
        return root
    images, labels = read_idx("train-images-idx3-ubyte.gz"), read_idx("train-labels-idx1-ubyte.gz")
    by_class = {c: np.flatnonzero(labels == c) for c in range(10)}
    rng = np.random.default_rng(seed)
    weights = np.zeros(10)
    weights[FREQUENCY_ORDER] = 1 / np.arange(1, 11)
    weights /= weights.sum()
    (root / "images").mkdir(parents=True, exist_ok=True)
    multi, single = [], []
    for i in range(train + evaluation):
        cells = rng.choice(4, size=int(rng.integers(2, 5)), replace=False)
        classes = rng.choice(10, size=len(cells), p=weights)
        mosaic = np.zeros((2 * CELL, 2 * CELL), dtype=np.uint8)
        for cell, c in zip(cells, classes):
            row, column = divmod(int(cell), 2)
            mosaic[row * CELL:(row + 1) * CELL, column * CELL:(column + 1) * CELL] = images[rng.choice(by_class[c])]
        name = f"images/{i}.png"
        Image.fromarray(mosaic).save(root / name)
        split = "train" if i < train else "validation"
        names = sorted({CLASSES[c] for c in classes})
        multi.append({"file_name": name, "labels": ";".join(names), "split": split})
        single.append({"file_name": name, "label": CLASSES[rng.choice(classes)], "split": split})
    for file_name, rows in (("labels.csv", multi), ("labels_single.csv", single)):
        with open(root / file_name, "w", newline="") as out:
            writer = csv.DictWriter(out, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return root


def train(args: list[str]) -> None:
    from vit_finetune.cli import main
    from vit_finetune.core.processes import reset_accelerate_state

    try:
        if main(args) != 0:
            raise SystemExit(f"training failed: {args}")
    finally:
        reset_accelerate_state()


def eval_rows(root: Path) -> tuple[list[str], np.ndarray]:
    """The validation mosaics in the label file's order, and their 0/1 label rows."""
    with open(root / "labels.csv", newline="") as file:
        rows = [row for row in csv.DictReader(file) if row["split"] == "validation"]
    present = sorted({name for row in rows for name in row["labels"].split(";")})
    truth = np.array([[name in row["labels"].split(";") for name in CLASSES] for row in rows], dtype=int)
    assert present, "no eval labels"
    return [str(root / row["file_name"]) for row in rows], truth


def softmax_scores(model_dir: Path, files: list[str]) -> np.ndarray:
    """Each eval image's softmax over the single-label model's classes, in CLASSES order (0 for an absent class)."""
    import torch
    from PIL import Image

    from vit_finetune.model.saved_model import load_classifier
    from vit_finetune.training.devices import torch_threads

    model, processor = load_classifier(str(model_dir))
    columns = [CLASSES.index(model.config.id2label[i]) for i in range(model.config.num_labels)]
    scores = np.zeros((len(files), len(CLASSES)))
    for start in range(0, len(files), 64):
        images = [Image.open(f).convert("RGB") for f in files[start:start + 64]]
        with torch.no_grad(), torch_threads(1):  # one thread, as the training runs
            logits = model(**processor(images=images, return_tensors="pt")).logits
        scores[start:start + len(images), columns] = logits.softmax(-1).numpy()
    return scores


def set_metrics(predicted: np.ndarray, truth: np.ndarray, scores: np.ndarray) -> dict:
    from vit_finetune.tasks.label_sets import average_precision, f_beta

    hits = (predicted & (truth == 1)).sum(axis=0)
    present = truth.sum(axis=0) > 0
    aps = [average_precision(scores[:, c], truth[:, c]) for c in np.flatnonzero(present)]
    return {"micro_f1": float(f_beta(hits.sum(), predicted.sum(), truth.sum(), 1.0)),
            "macro_f1": float(f_beta(hits, predicted.sum(axis=0), truth.sum(axis=0), 1.0)[present].mean()),
            "map": float(np.mean(aps)), "exact_match": float(((predicted == (truth == 1)).all(axis=1)).mean())}


def top_k_metrics(scores: np.ndarray, truth: np.ndarray, choosing: np.ndarray, scored: np.ndarray) -> dict:
    ranks = np.argsort(-scores, axis=1)

    def top(k, rows):
        predicted = np.zeros_like(truth[rows], dtype=bool)
        np.put_along_axis(predicted, ranks[rows, :k], True, axis=1)
        return predicted

    best_k = max(range(1, 5), key=lambda k: set_metrics(top(k, choosing), truth[choosing], scores[choosing])["micro_f1"])
    return {**set_metrics(top(best_k, scored), truth[scored], scores[scored]), "k": best_k}


def run_seed(root: Path, base: str, seed: int, size: int, epochs: int, lr: str, runs: Path) -> dict:
    from vit_finetune.tasks.label_sets import ThresholdRule, holdout_parts, summarise

    common = ["--quiet", f"model.base={base}", f"model.image_size={size}", "data.crop_scale=[1.0, 1.0]", "data.num_workers=0",
              f"train.epochs={epochs}", "train.batch_size=32", f"train.lr={lr}", "train.weight_decay=0.05",
              "train.warmup_steps=10", f"train.seed={seed}", "train.log_every_steps=20", "train.cpu_threads=1"]
    tag = f"{Path(base).name.replace(':', '-')}-{size}px-{epochs}ep-lr{lr}-s{seed}"
    multi_dir, single_dir = runs / f"multi-{tag}", runs / f"single-{tag}"
    if not (multi_dir / "metrics.json").is_file():
        train([*common, f"data.dataset={root / 'labels.csv'}", f"output_dir={multi_dir}", "overwrite=true",
               "train.threshold_holdout=0.5"])
    if not (single_dir / "metrics.json").is_file():
        train([*common, f"data.dataset={root / 'labels_single.csv'}", f"output_dir={single_dir}", "overwrite=true"])
    files, truth = eval_rows(root)
    choosing, scored = holdout_parts(len(files), 0.5, seed)  # as the multi-label run split them (train.seed)
    multi = json.loads((multi_dir / "metrics.json").read_text())
    assert multi["eval_samples"] == len(scored)
    train_rows = [row for row in csv.DictReader(open(root / "labels.csv", newline="")) if row["split"] == "train"]
    frequency = np.array([np.mean([c in row["labels"].split(";") for row in train_rows]) for c in CLASSES])
    constant = np.tile(frequency, (len(files), 1))
    frequent = summarise(constant, truth, np.zeros(len(files)), CLASSES, ThresholdRule("f1", 0.5, seed))
    single = top_k_metrics(softmax_scores(single_dir, files), truth, choosing, scored)
    return {"base": base, "seed": seed, "size": size, "epochs": epochs, "lr": lr, "scored_images": len(scored),
            "multi_label": {"micro_f1": multi["micro_f1"], "macro_f1": multi["macro_f1"], "map": multi["map"],
                            "exact_match": multi["accuracy"]},
            "frequent_labels": {"micro_f1": frequent["micro_f1"], "macro_f1": frequent["macro_f1"],
                                "map": frequent["map"], "exact_match": frequent["accuracy"]},
            "single_top_k": single}


def table(results: Path) -> None:
    records = [json.loads(line) for line in results.read_text().splitlines()]
    def setting_of(record: dict) -> tuple:
        return record["base"], record["size"], record["epochs"], record.get("lr", "0.005")  # the first records: 0.005

    for setting in dict.fromkeys(setting_of(r) for r in records):
        chosen = [r for r in records if setting_of(r) == setting]
        print(f"\n{setting[0]} at {setting[1]} px, {setting[2]} epochs, lr {setting[3]}: {len(chosen)} seed(s) "
              f"{[r['seed'] for r in chosen]}, {chosen[0]['scored_images']} scored images (mean ± sd over seeds)")
        print(f"{'method':16s} {'micro F1':>14s} {'macro F1':>14s} {'mAP':>14s} {'exact match':>14s}")
        for method in ("multi_label", "frequent_labels", "single_top_k"):
            cells = []
            for key in ("micro_f1", "macro_f1", "map", "exact_match"):
                values = [r[method][key] for r in chosen]
                spread = statistics.stdev(values) if len(values) > 1 else 0.0
                cells.append(f"{statistics.mean(values):.3f} ± {spread:.3f}")
            print(f"{method:16s} " + " ".join(f"{cell:>14s}" for cell in cells))


def lr_argument(value: str) -> str:
    if value != "auto":
        try:
            float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--lr must be a number or auto, got {value!r}") from None
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=REPO / "outputs" / "multilabel_study")
    parser.add_argument("--base", default="builtin:tiny-vit-32")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--train", type=int, default=1200, help="training mosaics")
    parser.add_argument("--eval", type=int, default=400, help="eval mosaics (half choose thresholds, half are scored)")
    parser.add_argument("--size", type=int, default=32, help="px; the 56 px mosaics are resized by the processor")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--lr", type=lr_argument, default="0.005",
                        help="train.lr for both models: a number, or auto (the toolkit's choice; use it on a real base)")
    parser.add_argument("--table", action="store_true")
    args = parser.parse_args()
    results = args.root / "results.jsonl"
    if args.table:
        return table(results)
    data_root = make_mosaics(args.root / f"mosaics-{args.train}-{args.eval}", args.train, args.eval)
    for seed in (int(s) for s in args.seeds.split(",")):
        record = run_seed(data_root, args.base, seed, args.size, args.epochs, args.lr, args.root / "runs")
        with open(results, "a") as out:
            out.write(json.dumps(record) + "\n")
        print(json.dumps(record))
    table(results)


if __name__ == "__main__":
    main()
