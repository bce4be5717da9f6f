"""Image regression on a real set: the toolkit (data.task=regression) against transformers' Trainer with
problem_type="regression", the same base, size, steps, batch and lr.

    python scripts/regression_study.py --base BASE_84PX_FOLDER            # 3 seeds x 60 and 200 steps, both arms
    python scripts/regression_study.py --base BASE --steps 60 --seeds 0   # fewer cells
    python scripts/regression_study.py --table                             # the table from the results so far

Data: ELPV (PyPI elpv-dataset; images CC BY-NC-SA 4.0), electroluminescence images of solar cells with an expert's
defect probability 0, 1/3, 2/3 or 1: the target. A seeded draw of 320 training and 200 eval images, stratified by
that value, downscaled once to 112 px and written as PNGs with a label file (metadata.csv, a `split` column) that
both arms read. The base: the DINOv2-S/14 backbone moved to an 84 px grid (scripts/transfer_study.py's reference
base); every cell trains at 56 px, batch 16, lr 2e-5, AdamW, one torch thread, evaluated once at the end.

  toolkit: `python -m vit_finetune` from the schema defaults with data.task=regression (MSE of the standardised
      target; the head's lr train.head_lr=auto, which the toolkit picks for a new head; no crop, no flip);
  trainer: the image-classification example's recipe with a regression head (num_labels=1, problem_type=
      "regression": MSE of the raw target), its RandomResizedCrop(8-100 %) + flip, one lr for every weight, linear
      schedule without warm-up; eval Resize + CenterCrop.
Results are appended to <root>/results.jsonl, one line per cell; a cell recorded (or claimed by another process of the
study running beside this one: --seeds 2,1,0 in a second shell shares the work) is not redone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

BATCH, LR, SIZE = 16, 2e-5, 56
TRAIN_IMAGES, EVAL_IMAGES, STORED_SIZE = 320, 200, 112


def elpv_rows() -> tuple[Path, list[tuple[str, float]]]:
    try:
        import elpv_dataset
    except ImportError:
        raise SystemExit("the study needs: pip install elpv-dataset") from None
    root = Path(elpv_dataset.__file__).parent / "data"
    rows = [line.split() for line in (root / "labels.csv").read_text().splitlines() if line.strip()]
    return root, [(path, float(probability)) for path, probability, _ in rows]


def write_data(folder: Path, seed: int = 0) -> Path:
    """The label-file folder both arms read (written once)."""
    if (folder / "metadata.csv").is_file():
        return folder
    from PIL import Image

    root, rows = elpv_rows()
    rng = np.random.default_rng(seed)
    values = np.array([p for _, p in rows])
    chosen = {"train": [], "validation": []}
    for value in np.unique(values):  # stratified by the target's four values
        members = rng.permutation(np.flatnonzero(values == value))
        share = len(members) / len(values)
        chosen["train"] += members[:round(TRAIN_IMAGES * share)].tolist()
        chosen["validation"] += members[round(TRAIN_IMAGES * share):][:round(EVAL_IMAGES * share)].tolist()
    (folder / "images").mkdir(parents=True, exist_ok=True)
    lines = ["file_name,defect_probability,split"]
    for split, indices in chosen.items():
        for index in indices:
            path, probability = rows[index]
            name = f"images/{Path(path).stem}.png"
            Image.open(root / path).convert("L").resize((STORED_SIZE, STORED_SIZE), Image.BICUBIC).save(folder / name)
            lines.append(f"{name},{probability:.6f},{split}")
    (folder / "metadata.csv").write_text("\n".join(lines) + "\n")
    return folder


def read_split(data: Path, split: str) -> tuple[list[Path], np.ndarray]:
    import csv

    with open(data / "metadata.csv", newline="") as file:
        rows = [row for row in csv.DictReader(file) if row["split"] == split]
    return [data / row["file_name"] for row in rows], np.array([float(row["defect_probability"]) for row in rows])


def scores(predicted: np.ndarray, true: np.ndarray) -> dict:
    error = predicted - true
    return {"mae": float(np.abs(error).mean()), "rmse": float(np.sqrt((error ** 2).mean())),
            "r2": float(1 - (error ** 2).sum() / ((true - true.mean()) ** 2).sum())}


def run_toolkit(base: Path, data: Path, steps: int, seed: int, out: Path) -> dict:
    from vit_finetune.cli import main

    argv = ["--quiet", f"model.base={base}", f"model.image_size={SIZE}", f"data.dataset={data}", "data.task=regression",
            "data.label_column=defect_probability", "data.num_workers=0", f"train.max_steps={steps}",
            "train.epochs=1000", f"train.eval_every_steps={steps}", f"train.log_every_steps={steps}",
            f"train.batch_size={BATCH}", f"train.lr={LR}", "train.cpu_threads=1", f"train.seed={seed}",
            "pictures=false", f"output_dir={out}", "overwrite=true"]
    print("$ python -m vit_finetune " + " ".join(argv), flush=True)
    if main(argv) != 0:
        raise SystemExit("the toolkit cell failed")
    metrics = json.loads((out / "metrics.json").read_text())
    return {key: metrics[key] for key in ("mae", "rmse", "r2")}


def run_trainer(base: Path, data: Path, steps: int, seed: int, out: Path) -> dict:
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageClassification, Trainer, TrainingArguments
    from transformers.utils import logging as transformers_logging

    from peer_example import eval_transform
    from vit_finetune.bench.peer import ExampleTrainTransform

    processor = AutoImageProcessor.from_pretrained(base)
    train_transform = ExampleTrainTransform(SIZE, processor.image_mean, processor.image_std)
    to_pixels = eval_transform(SIZE, processor.image_mean, processor.image_std)
    train_paths, train_values = read_split(data, "train")
    eval_paths, eval_values = read_split(data, "validation")

    class Images(torch.utils.data.Dataset):
        def __len__(self):
            return len(train_paths)

        def __getitem__(self, index):
            image = Image.open(train_paths[index]).convert("RGB")
            return {"pixel_values": train_transform(image), "labels": torch.tensor([train_values[index]],
                                                                                   dtype=torch.float32)}

    transformers_logging.set_verbosity_error()  # the replaced head's load report
    model = AutoModelForImageClassification.from_pretrained(base, num_labels=1, problem_type="regression",
                                                            ignore_mismatched_sizes=True)
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=BATCH, max_steps=steps, learning_rate=LR,
                             lr_scheduler_type="linear", warmup_steps=0, seed=seed, dataloader_num_workers=0,
                             report_to="none", save_strategy="no", eval_strategy="no", disable_tqdm=True,
                             use_cpu=True, logging_steps=steps)
    trainer = Trainer(model=model, args=args, train_dataset=Images(),
                      data_collator=lambda rows: {"pixel_values": torch.stack([r["pixel_values"] for r in rows]),
                                                  "labels": torch.stack([r["labels"] for r in rows])})
    trainer.train()
    model.eval()
    predicted = []
    with torch.no_grad():
        for start in range(0, len(eval_paths), 64):
            pixels = torch.stack([to_pixels(Image.open(p).convert("RGB")) for p in eval_paths[start:start + 64]])
            predicted.append(model(pixel_values=pixels).logits[:, 0].numpy())
    return scores(np.concatenate(predicted), eval_values)


def claim(path: Path) -> bool:
    """Whether this process takes the cell: the first to create its claim file does (several processes may share the
    work, one thread each); a cell whose process died leaves its claim: delete the file to redo it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.open("x").close()
    except FileExistsError:
        return False
    return True


def table(results: list[dict]) -> str:
    lines = ["| steps | arm | MAE | RMSE | R² | CPU s / run |", "|---|---|---|---|---|---|"]
    for steps in sorted({r["steps"] for r in results}):
        for arm in ("toolkit", "trainer"):
            runs = [r for r in results if r["steps"] == steps and r["arm"] == arm]
            if not runs:
                continue

            def cell(key: str) -> str:
                values = [r[key] for r in runs]
                if len(values) == 1:
                    return f"{values[0]:.3f}"
                return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"
            cpu = statistics.mean(r["cpu_seconds"] for r in runs)
            seeds = f"{len(runs)} seed{'s' if len(runs) > 1 else ''}"
            lines.append(f"| {steps} | {arm} ({seeds}) | {cell('mae')} | {cell('rmse')} | {cell('r2')} | "
                         f"{cpu:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, help="the DINOv2-S/14 base at 84 px (transfer_study.py's reference base)")
    parser.add_argument("--root", type=Path, default=REPO / "outputs" / "regression")
    parser.add_argument("--steps", default="60,200")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--arms", default="toolkit,trainer")
    parser.add_argument("--table", action="store_true", help="print the table of the results so far")
    args = parser.parse_args()
    results_file = args.root / "results.jsonl"
    results = [json.loads(line) for line in results_file.read_text().splitlines()] if results_file.is_file() else []
    if not args.table:
        if args.base is None:
            raise SystemExit("--base is needed to run cells")
        import torch

        torch.set_num_threads(1)
        data = write_data(args.root / "elpv")
        for steps in map(int, args.steps.split(",")):
            for seed in map(int, args.seeds.split(",")):
                for arm in args.arms.split(","):
                    if not claim(args.root / "runs" / f"{arm}-{steps}-{seed}.claimed"):
                        continue  # recorded, or another process of the study runs it
                    started, cpu = time.perf_counter(), time.process_time()
                    run = run_toolkit if arm == "toolkit" else run_trainer
                    outcome = run(args.base, data, steps, seed, args.root / "runs" / f"{arm}-{steps}-{seed}")
                    result = {"arm": arm, "steps": steps, "seed": seed, "batch": BATCH, "lr": LR, "size": SIZE,
                              "train_images": TRAIN_IMAGES, "seconds": round(time.perf_counter() - started, 1),
                              "cpu_seconds": round(time.process_time() - cpu, 1), **outcome}
                    print(json.dumps(result), flush=True)
                    results.append(result)
                    with open(results_file, "a") as handle:
                        handle.write(json.dumps(result) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
