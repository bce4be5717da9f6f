"""Distillation study: does a small student trained with a teacher (train.distill) beat the same student without it?

    python scripts/make_real_base.py       # once: the DINOv2-S/14 backbone (outputs/real_base/...)
    python scripts/distill_study.py        # the teacher, then the student without it and with soft targets, seeds 0-2
    python scripts/distill_study.py --arms hard --seeds 0,1
    python scripts/distill_study.py --steps 500     # a longer schedule for the student
    python scripts/distill_study.py --augment strong --arms none,match --steps 500   # both arms augmented alike
    python scripts/distill_study.py --table   # the table from every result recorded so far

Needs `pip install -e ".[study,realbase]"` and Debian's `dataset-fashion-mnist` (apt-get install
dataset-fashion-mnist: the IDX files land in /usr/share/datasets/fashion-mnist/).

Data: Fashion-MNIST (Debian's train file), 10 classes, 100 train / 50 eval images per class (seeded, stratified;
written once with save_to_disk, as scripts/transfer_study.py writes it).
Teacher: the real DINOv2-S/14 base (moved once to its 84 px reference grid by scripts/transfer_study.py), fine-tuned
by the toolkit at 56 px for TEACHER_STEPS steps of 16 with the schema's defaults, seed 0.
Student: a small ViT from random weights (builtin:tiny-vit-32's architecture: 96 wide, 4 blocks, patch 4, with
model.pretrained=false) at 28 px, the same schedule in every arm (STUDENT_LR, cosine, batch 32), seeds 0-2:
  none  labels only
  hard  train.distill mode=hard weight=0.5 (DeiT's hard distillation)
  soft  train.distill mode=soft weight=0.5 temperature=4 (timm's default temperature)
  soft1 train.distill mode=soft weight=0.5 temperature=1
  match train.distill mode=soft weight=1 temperature=1 (function matching: the teacher's probabilities alone,
        Beyer et al. 2022, arXiv 2106.05237)
--augment picks the training images' augmentation, the same in every arm (the teacher labels the very crops and
mixes the student sees):
  none    no crop, no flip, no mixing (the schema's defaults)
  light   random-resized crops of 35-100 % of the area and horizontal flips
  strong  light, and Mixup or CutMix on every batch
The teacher runs at its own 56 px and ImageNet mean/std; the student's 28 px batches are resampled for it.
Speed: images/s of a forward pass (eval mode, no gradients, batch 32, one torch thread, CPU) of the saved student and
teacher, each at its own resolution. Every run uses one torch thread and no loader workers (train.cpu_threads=1).
Results are appended to outputs/distill/results.jsonl; a run already recorded is not redone. The runs measured so far
are kept in scripts/distill_study_results.jsonl: copy it to outputs/distill/results.jsonl to print their table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from small_data_study import SmallDataset, write_dataset  # noqa: E402
from transfer_study import FASHION_NAMES, fashion_mnist, reference_base  # noqa: E402

ROOT = REPO / "outputs" / "distill"
DATA = SmallDataset(fashion_mnist, list(range(10)), FASHION_NAMES, 100, 50, 0)
TEACHER_SIZE, TEACHER_STEPS = 56, 200
STUDENT_BASE, STUDENT_SIZE, STUDENT_STEPS, STUDENT_BATCH, STUDENT_LR = "builtin:tiny-vit-32", 28, 200, 32, 1e-3
ARMS = {
    "none": [],
    "hard": ["train.distill.mode=hard", "train.distill.weight=0.5"],
    "soft": ["train.distill.mode=soft", "train.distill.weight=0.5", "train.distill.temperature=4"],
    "soft1": ["train.distill.mode=soft", "train.distill.weight=0.5", "train.distill.temperature=1"],
    "match": ["train.distill.mode=soft", "train.distill.weight=1", "train.distill.temperature=1"],
}
# The student's augmentation, the same in every arm; results recorded before --augment existed have no key: "none".
LIGHT = ["data.crop_scale=[0.35,1.0]", "data.horizontal_flip=true"]
AUGMENTS = {"none": [], "light": LIGHT, "strong": [*LIGHT, "augment.mixup=true", "augment.cutmix=true"]}
COMMON = ["--quiet", "data.eval_split=validation", "data.num_workers=0", "train.cpu_threads=1", "train.epochs=1000",
          "overwrite=true"]


def cli(argv: list[str]) -> None:
    from vit_finetune.cli import main

    print("$ python -m vit_finetune " + " ".join(argv), flush=True)
    if main(argv) != 0:
        raise SystemExit("a run failed")


def teacher(data: Path) -> Path:
    out = ROOT / "runs" / "teacher"
    if not (out / "metrics.json").exists():
        base = reference_base(REPO / "outputs" / "transfer")
        cli([*COMMON, f"model.base={base}", f"model.image_size={TEACHER_SIZE}", f"data.dataset={data}",
             f"train.max_steps={TEACHER_STEPS}", "train.batch_size=16", "train.seed=0",
             f"train.eval_every_steps={TEACHER_STEPS}", f"train.log_every_steps={TEACHER_STEPS}", f"output_dir={out}"])
    return out


def student(arm: str, seed: int, steps: int, augment: str, data: Path, teacher_dir: Path) -> dict:
    name = f"student-{arm}" + ("" if augment == "none" else f"-{augment}")
    out = ROOT / "runs" / (f"{name}-s{seed}" if steps == STUDENT_STEPS else f"{name}-{steps}st-s{seed}")
    distill = [f"train.distill.teacher={teacher_dir}", *ARMS[arm]] if ARMS[arm] else []
    start, cpu_start = time.perf_counter(), time.process_time()
    cli([*COMMON, f"model.base={STUDENT_BASE}", "model.pretrained=false", f"model.image_size={STUDENT_SIZE}",
         f"data.dataset={data}", f"train.max_steps={steps}", f"train.batch_size={STUDENT_BATCH}",
         f"train.lr={STUDENT_LR}", f"train.seed={seed}", f"train.eval_every_steps={steps}",
         f"train.log_every_steps={steps}", f"output_dir={out}", *AUGMENTS[augment], *distill])
    metrics = json.loads((out / "metrics.json").read_text())
    return {"arm": arm, "augment": augment, "seed": seed, "accuracy": metrics["accuracy"], "steps": steps,
            "seconds": round(time.perf_counter() - start, 1), "cpu_seconds": round(time.process_time() - cpu_start, 1),
            "folder": str(out)}


def images_per_second(folder: Path, batch: int = 32, repeats: int = 10) -> float:
    """Forward passes of the saved model at its own resolution, one thread, after two warm-up passes."""
    import torch

    from vit_finetune.training.distill import input_size
    from vit_finetune.model.saved_model import load_classifier

    torch.set_num_threads(1)
    model, processor = load_classifier(str(folder))
    pixels = torch.randn(batch, 3, *input_size(processor, model.config))
    with torch.no_grad():
        for _ in range(2):
            model(pixel_values=pixels)
        start = time.perf_counter()
        for _ in range(repeats):
            model(pixel_values=pixels)
    return batch * repeats / (time.perf_counter() - start)


def read_results() -> list[dict]:
    path = ROOT / "results.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [{"augment": "none", **row} for row in rows]  # rows written before --augment existed: not augmented


def table(results: list[dict], teacher_dir: Path) -> str:
    teacher_accuracy = json.loads((teacher_dir / "metrics.json").read_text())["accuracy"]
    students = [r for r in results if r["arm"] in ARMS]
    saved = [Path(r["folder"]) for r in students if (Path(r["folder"]) / "config.json").exists()]
    student_speed = images_per_second(saved[-1]) if saved else float("nan")  # the architecture is the same in all
    teacher_speed = images_per_second(teacher_dir)
    lines = [f"Fashion-MNIST, {DATA.train_per_class} train / {DATA.eval_per_class} eval images per class; student "
             f"{STUDENT_BASE} architecture from random weights at {STUDENT_SIZE} px, batches of "
             f"{STUDENT_BATCH}; teacher DINOv2-S/14 fine-tuned at {TEACHER_SIZE} px ({TEACHER_STEPS} steps of 16)\n",
             "| model | augment | steps | eval accuracy, mean ± std (seeds) | CPU s per run | images/s (CPU, 1 thread, "
             "batch 32) |",
             "|---|---|---|---|---|---|",
             f"| teacher (DINOv2-S/14, {TEACHER_SIZE} px) | none | {TEACHER_STEPS} of 16 | {teacher_accuracy:.3f} (seed 0) "
             f"| – | {teacher_speed:.0f} |"]
    for augment in AUGMENTS:
        for steps in sorted({r["steps"] for r in students}):
            for arm in ARMS:
                runs = [r for r in students if (r["arm"], r["steps"], r["augment"]) == (arm, steps, augment)]
                if not runs:
                    continue
                values = [r["accuracy"] for r in runs]
                spread = statistics.stdev(values) if len(values) > 1 else 0.0
                name = "student, labels only" if arm == "none" else f"student + teacher ({' '.join(ARMS[arm])})"
                lines.append(f"| {name} | {augment} | {steps} | {statistics.mean(values):.3f} ± {spread:.3f} "
                             f"({len(values)}) | {statistics.mean(r['cpu_seconds'] for r in runs):.0f} | "
                             f"{student_speed:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # soft and none by default: each run with a teacher costs ~6x one without on a CPU (the teacher's forward passes)
    parser.add_argument("--arms", default="none,soft")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=STUDENT_STEPS, help="the student's optimiser steps")
    parser.add_argument("--augment", choices=sorted(AUGMENTS), default="none",
                        help="the student's augmentation, the same in every arm")
    parser.add_argument("--table", action="store_true", help="only print the table of the results recorded (the "
                        "teacher is trained first if its folder is missing: the table measures both models' speed)")
    options = parser.parse_args()
    ROOT.mkdir(parents=True, exist_ok=True)
    data = write_dataset(DATA, ROOT / "data" / "fashion")
    teacher_dir = teacher(data)
    if not options.table:
        done = {(r["arm"], r["seed"], r["steps"], r["augment"]) for r in read_results()}
        for seed in [int(s) for s in options.seeds.split(",")]:
            for arm in options.arms.split(","):
                if (arm, seed, options.steps, options.augment) in done:
                    continue
                result = student(arm, seed, options.steps, options.augment, data, teacher_dir)
                with open(ROOT / "results.jsonl", "a") as handle:
                    handle.write(json.dumps(result) + "\n")
    print(table(read_results(), teacher_dir))


if __name__ == "__main__":
    main()
