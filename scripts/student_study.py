"""Student study: a student cut from a fine-tuned real ViT's own blocks (model.keep_blocks), with and without the
teacher (train.distill), against the teacher and against a tiny student from random weights.

    python scripts/make_real_base.py        # once: the DINOv2-S/14 backbone (outputs/real_base/...)
    python scripts/student_study.py         # teachers, then 6- and 4-block students (labels, hard, soft), seeds 0-2
    python scripts/student_study.py --kinds tiny_none,tiny_match   # the tiny student from random weights
    python scripts/student_study.py --kinds cut6_none --keep 0,2,4,7,9,11   # every other block instead of the first 6
    python scripts/student_study.py --speed --datasets fashion --seeds 0 --images 256
        # CPU images/s of the teacher and its students side by side, 1 thread and all
    python scripts/student_study.py --serve teacher,cut6_soft --datasets fashion --seeds 0 --images 200
        # export --onnx --quantize int8 (one thread), then predict --runtime onnx-int8 etc. against pipeline()
    python scripts/student_study.py --table # the tables from every result recorded so far

Needs `pip install -e ".[study,realbase]"` and Debian's `dataset-fashion-mnist` (apt-get install
dataset-fashion-mnist: the IDX files land in /usr/share/datasets/fashion-mnist/).

Data: Fashion-MNIST (Debian's train file) and scikit-learn's digits, 10 classes each, 40 train / 100 eval images per
class (seeded, stratified; written once with save_to_disk).
Teacher, per dataset and seed: the real DINOv2-S/14 base (moved once to its 84 px reference grid by
scripts/transfer_study.py) fine-tuned by the toolkit at 56 px for TEACHER_STEPS steps of 16 with the schema's defaults
(full fine-tuning, train.lr=auto and train.head_lr=auto).
Students, each cut from the teacher of its dataset and seed (model.base=the teacher's output_dir, model.keep_blocks=N:
the first N of its 12 blocks, with its embeddings, final norm and head), at the teacher's
56 px, full fine-tuning for STUDENT_STEPS steps of 16 with the teacher's recipe (train.lr=auto, train.head_lr=auto,
cosine, no augmentation):
  cut6_none / cut4_none    labels only
  cut6_hard / cut4_hard    train.distill mode=hard weight=0.5 (DeiT's hard distillation)
  cut6_soft / cut4_soft    train.distill mode=soft weight=0.5 temperature=1
The same 6 blocks cut from the pretrained base instead (model.base=the 84 px reference base, a new head), the
same recipe: does the student need the fine-tuned teacher's blocks?
  base6_none / base6_soft  labels only / train.distill mode=soft weight=0.5 temperature=1
The tiny student from random weights, as in scripts/distill_study.py: builtin:tiny-vit-32's architecture (96 wide,
4 blocks, patch 4) with model.pretrained=false at 28 px, TINY_STEPS steps of 32 at lr 1e-3:
  tiny_none                labels only
  tiny_match               train.distill mode=soft weight=1 temperature=1 (function matching, its best there)
Every distilled run sets train.distill.cache_logits=true: no augmentation, so the teacher labels the 400 training
images once before training instead of every batch (its seconds are recorded apart).
Every run uses one torch thread and no loader workers (train.cpu_threads=1). Results are appended to
outputs/student/results.jsonl; a run already recorded is not redone. The runs measured so far are kept in
scripts/student_study_results.jsonl: copy it to outputs/student/results.jsonl to print their tables.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from small_data_study import SmallDataset, write_dataset  # noqa: E402
from transfer_study import FASHION_NAMES, TEN, digits_0_9, fashion_mnist, reference_base  # noqa: E402
from vit_finetune.recipe import key_descriptions  # noqa: E402

ROOT = REPO / "outputs" / "student"
DATASETS = {
    "fashion": SmallDataset(fashion_mnist, TEN, FASHION_NAMES, 40, 100, 0),
    "digits": SmallDataset(digits_0_9, TEN, [str(c) for c in TEN], 40, 100, 0),
}
SIZE, BATCH = 56, 16
TEACHER_STEPS = 200
STUDENT_STEPS = 200
TINY_BASE, TINY_SIZE, TINY_STEPS, TINY_BATCH, TINY_LR = "builtin:tiny-vit-32", 28, 1000, 32, 1e-3
DISTILL = {
    "none": [],
    "hard": ["train.distill.mode=hard", "train.distill.weight=0.5"],
    "soft": ["train.distill.mode=soft", "train.distill.weight=0.5", "train.distill.temperature=1"],
    "match": ["train.distill.mode=soft", "train.distill.weight=1", "train.distill.temperature=1"],
}
# kind -> (student, distillation): "cut6" is 6 blocks cut from the teacher, "tiny" the small ViT from random weights.
KINDS = {f"{student}_{arm}": (student, arm) for student in ("cut6", "cut4") for arm in ("none", "hard", "soft")}
KINDS.update(tiny_none=("tiny", "none"), tiny_match=("tiny", "match"), base6_none=("base6", "none"),
             base6_soft=("base6", "soft"))
COMMON = ["--quiet", "data.eval_split=validation", "data.num_workers=0", "train.cpu_threads=1", "train.epochs=1000",
          "overwrite=true", "pictures=false"]
# Every model here is fully fine-tuned (every weight takes optimiser steps). A toolkit with train.method is told so,
# whatever its default; before that key existed, full fine-tuning was the only method.
COMMON += ["train.method=finetune"] if "train.method" in key_descriptions() else []


def cli(argv: list[str]) -> None:
    from vit_finetune.cli import main

    print("$ python -m vit_finetune " + " ".join(argv), flush=True)
    if main(argv) != 0:
        raise SystemExit("a run failed")


def dataset_folder(name: str) -> Path:
    return write_dataset(DATASETS[name], ROOT / "data" / name)


def teacher(name: str, seed: int) -> Path:
    """The fine-tuned real base of this dataset and seed (trained once)."""
    out = ROOT / "runs" / f"{name}-teacher-s{seed}"
    if not (out / "metrics.json").exists():
        base = reference_base(REPO / "outputs" / "transfer")
        timed(cli, [*COMMON, f"model.base={base}", f"model.image_size={SIZE}", f"data.dataset={dataset_folder(name)}",
                    f"train.max_steps={TEACHER_STEPS}", f"train.batch_size={BATCH}", f"train.seed={seed}",
                    f"train.eval_every_steps={TEACHER_STEPS}", f"train.log_every_steps={TEACHER_STEPS}",
                    f"output_dir={out}"], record=cost_file(out))
    return out


def cost_file(out: Path) -> Path:
    """Where a run's wall and CPU seconds are kept: beside its folder (the folder is the run's own)."""
    return out.parent / f"{out.name}.cost.json"


def timed(function, argv: list[str], record: Path) -> None:
    """Run `function(argv)`, then write its wall and CPU seconds to `record`."""
    start, cpu_start = time.perf_counter(), time.process_time()
    function(argv)
    record.write_text(json.dumps({"seconds": round(time.perf_counter() - start, 1),
                                  "cpu_seconds": round(time.process_time() - cpu_start, 1)}))


@dataclass(frozen=True)
class Variant:
    """A cut student's lr, head lr and blocks, when not the study's (how the study's were chosen)."""

    lr: float | None = None  # None: train.lr=auto (2e-5 for full fine-tuning)
    head_lr: float | None = None  # None: train.head_lr=auto (2e-3 with AdamW)
    keep: tuple[int, ...] | None = None  # None: the kind's count, the first blocks (model.keep_blocks=N)

    def suffix(self) -> str:
        return ((f"-lr{self.lr:g}" if self.lr is not None else "")
                + (f"-head{self.head_lr:g}" if self.head_lr is not None else "")
                + (f"-keep{'-'.join(map(str, self.keep))}" if self.keep is not None else ""))

    def overrides(self) -> list[str]:
        return [f"train.lr={self.lr if self.lr is not None else 'auto'}",
                f"train.head_lr={self.head_lr if self.head_lr is not None else 'auto'}"]

    def fields(self) -> dict:
        return {"lr": self.lr, "head_lr": self.head_lr, "keep": None if self.keep is None else list(self.keep)}


def student_argv(kind: str, name: str, seed: int, teacher_dir: Path, out: Path, variant: Variant) -> list[str]:
    student, arm = KINDS[kind]
    distill = [f"train.distill.teacher={teacher_dir}", "train.distill.cache_logits=true", *DISTILL[arm]] if DISTILL[arm] else []
    common = [*COMMON, f"data.dataset={dataset_folder(name)}", f"train.seed={seed}", f"output_dir={out}", *distill]
    if student == "tiny":
        return [*common, f"model.base={TINY_BASE}", "model.pretrained=false", f"model.image_size={TINY_SIZE}",
                f"train.max_steps={TINY_STEPS}", f"train.batch_size={TINY_BATCH}", f"train.lr={TINY_LR}",
                f"train.eval_every_steps={TINY_STEPS}", f"train.log_every_steps={TINY_STEPS}"]
    keep = int(student[-1]) if variant.keep is None else f"[{','.join(map(str, variant.keep))}]"
    base = teacher_dir if student.startswith("cut") else reference_base(REPO / "outputs" / "transfer")
    return [*common, f"model.base={base}", f"model.keep_blocks={keep}", f"model.image_size={SIZE}",
            f"train.max_steps={STUDENT_STEPS}", f"train.batch_size={BATCH}", *variant.overrides(),
            f"train.eval_every_steps={STUDENT_STEPS}",
            f"train.log_every_steps={STUDENT_STEPS}"]


def run_student(kind: str, name: str, seed: int, variant: Variant) -> dict:
    tiny = KINDS[kind][0] == "tiny"
    out = ROOT / "runs" / f"{name}-{kind}-s{seed}{'' if tiny else variant.suffix()}"
    timed(cli, student_argv(kind, name, seed, teacher(name, seed), out, variant), record=cost_file(out))
    row = result(kind, name, seed, out, json.loads(cost_file(out).read_text()))
    return row if tiny else {**row, **variant.fields()}


def result(kind: str, name: str, seed: int, out: Path, cost: dict) -> dict:
    metrics = json.loads((out / "metrics.json").read_text())
    labelling = metrics.get("distillation", {}).get("labelling_seconds")
    return {"kind": kind, "dataset": name, "seed": seed, "accuracy": metrics["accuracy"], **cost,
            "labelling_seconds": labelling, "folder": str(out.relative_to(REPO))}


def row_key(row: dict) -> tuple:
    """A run's identity: its kind, data, seed, and (cut students) the variant."""
    variant = Variant(row["lr"], row["head_lr"], tuple(row["keep"]) if row["keep"] else None) if "lr" in row else None
    return row["kind"], row["dataset"], row["seed"], variant


# ---------------------------------------------------------------- speed, side by side


def load_average() -> str:
    """The machine's 1/5/15-minute load, as `uptime` prints it."""
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def eval_images(name: str) -> tuple[list, list[int]]:
    """The eval split's decoded images and labels."""
    import datasets

    table = datasets.load_from_disk(str(dataset_folder(name)))["validation"]
    return [image.convert("RGB") for image in table["image"]], list(table["label"])


def speed(name: str, seed: int, batch: int, rounds: int, count: int) -> dict:
    """CPU images/s of the teacher and its students, one thread then all threads: each batch of the eval images goes
    through every model in turn (each at its own size, through its own image processor), so a busy machine slows
    them alike; only the forward pass is timed. The first `count` eval images are used."""
    import torch

    from vit_finetune.model.saved_model import load_classifier

    threads_all = torch.get_num_threads()
    folders = {"teacher": teacher(name, seed), **{kind: ROOT / "runs" / f"{name}-{kind}-s{seed}"
                                                  for kind in ("cut6_none", "cut4_none", "tiny_none")}}
    images = eval_images(name)[0][:count]
    models, pixels = {}, {}
    for kind, folder in folders.items():
        models[kind], processor = load_classifier(str(folder))
        pixels[kind] = [processor(images=images[start:start + batch], return_tensors="pt")["pixel_values"]
                        for start in range(0, len(images) - batch + 1, batch)]
    figures = {"dataset": name, "seed": seed, "batch": batch, "rounds": rounds, "images": len(images),
               "load_before": load_average(),
               "blocks": {kind: model.config.num_hidden_layers for kind, model in models.items()}}
    for threads in (1, threads_all):
        torch.set_num_threads(threads)
        seconds = dict.fromkeys(models, 0.0)
        counted = 0
        with torch.no_grad():
            for kind, model in models.items():  # warm-up, not timed
                model(pixel_values=pixels[kind][0])
            for _ in range(rounds):
                for index in range(len(pixels["teacher"])):
                    for kind, model in models.items():
                        start = time.perf_counter()
                        model(pixel_values=pixels[kind][index])
                        seconds[kind] += time.perf_counter() - start
                    counted += batch
        figures[f"images_per_s_{threads}_threads"] = {kind: round(counted / spent, 1) for kind, spent in seconds.items()}
        print(f"{threads} thread(s): {figures[f'images_per_s_{threads}_threads']} images/s", flush=True)
    figures["threads_all"] = threads_all
    figures["load_after"] = load_average()
    torch.set_num_threads(threads_all)
    return figures


# ---------------------------------------------------------------- serving: ONNX int8 against pipeline()


def serve(name: str, seed: int, kinds: list[str], chunk: int, count: int) -> list[dict]:
    """For each model: `export --onnx --quantize int8` (parity, int8 speed-up and accuracy change on the run's own
    eval split, as export.json records them), then images/s and accuracy on the eval images of plain pipeline() and
    of predict's code path (predict.predict_rows) with --runtime torch, onnx and onnx-int8, one thread and all
    threads, chunk by chunk in turn, on the first `count` eval images. pipeline() is handed the decoded images;
    predict decodes them itself."""
    import torch
    from transformers import pipeline

    from vit_finetune.cli import main
    from vit_finetune.serving.prediction import dataset_images, predict_rows
    from vit_finetune.model.saved_model import load_classifier
    from vit_finetune.serving.onnx_classifier import load_onnx_classifier

    threads_all = torch.get_num_threads()
    images, labels = (column[:count] for column in eval_images(name))
    sources = dataset_images(str(dataset_folder(name)), "validation")[:count]
    rows = []
    for kind in kinds:
        folder = teacher(name, seed) if kind == "teacher" else ROOT / "runs" / f"{name}-{kind}-s{seed}"
        if not (folder / "onnx" / "export.json").exists():
            # One thread for the export's own float/int8 timing: on a shared machine two threads wait on each other
            torch.set_num_threads(1)
            print(f"$ OMP_NUM_THREADS=1 python -m vit_finetune export {folder} --onnx --quantize int8", flush=True)
            if main(["export", str(folder), "--onnx", "--quantize", "int8"]) != 0:
                raise SystemExit("the export failed")
            torch.set_num_threads(threads_all)
        exported = json.loads((folder / "onnx" / "export.json").read_text())
        row = {"dataset": name, "seed": seed, "kind": kind, "export": exported, "images": len(images),
               "load_before": load_average()}
        for threads in (1, threads_all):
            torch.set_num_threads(threads)  # onnxruntime's sessions take torch's thread count (onnx_classifier.session)
            classify = pipeline("image-classification", model=str(folder), device="cpu")
            runners = {"pipeline": None, "torch": load_classifier(str(folder)),
                       **{runtime: load_onnx_classifier(str(folder), runtime) for runtime in ("onnx", "onnx-int8")}}
            seconds, answers = dict.fromkeys(runners, 0.0), {runner: [] for runner in runners}
            for start in range(0, len(images), chunk):
                for runtime, loaded in runners.items():
                    began = time.perf_counter()
                    if loaded is None:
                        given = classify(images[start:start + chunk], batch_size=32, top_k=1)
                        answers[runtime] += [found[0]["label"] for found in given]
                    else:
                        model, processor = loaded
                        given = predict_rows(model, processor, sources[start:start + chunk], 1, 32, show_progress=False)
                        answers[runtime] += [found["predictions"][0]["label"] for found in given]
                    seconds[runtime] += time.perf_counter() - began
            names = DATASETS[name].names
            row[f"{threads}_threads"] = {runtime: {
                "images_per_s": round(len(images) / spent, 1),
                "accuracy": sum(answer == names[label] for answer, label in zip(answers[runtime], labels)) / len(labels),
                "agrees_with_pipeline": sum(a == b for a, b in zip(answers[runtime], answers["pipeline"])) / len(labels)}
                for runtime, spent in seconds.items()}
        torch.set_num_threads(threads_all)
        row["threads_all"], row["load_after"] = threads_all, load_average()
        rows.append(row)
    return rows


def read_results(file: str = "results.jsonl") -> list[dict]:
    path = ROOT / file
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def record(row: dict, file: str = "results.jsonl") -> None:
    with open(ROOT / file, "a") as handle:
        handle.write(json.dumps(row) + "\n")


def train(kinds: list[str], names: list[str], seeds: list[int], variant: Variant) -> None:
    """The teachers first (each is recorded as kind `teacher`), then every student asked for."""
    done = {row_key(row) for row in read_results()}
    for seed in seeds:
        for name in names:
            if ("teacher", name, seed, None) not in done:
                out = teacher(name, seed)
                record(result("teacher", name, seed, out, json.loads(cost_file(out).read_text())))
            for kind in kinds:
                if (kind, name, seed, None if KINDS[kind][0] == "tiny" else variant) not in done:
                    record(run_student(kind, name, seed, variant))


# ---------------------------------------------------------------- tables


def spread(values: list[float]) -> str:
    """mean ± sample std (n)."""
    deviation = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {deviation:.3f} ({len(values)})"


def study_rows(rows: list[dict]) -> list[dict]:
    """The study's runs: teachers, tiny students and cut students at the study's own variant."""
    return [row for row in rows if "lr" not in row or row_key(row)[3] == Variant()]


def accuracy_table(rows: list[dict], names: list[str]) -> str:
    rows = study_rows(rows)
    lines = ["| model | " + " | ".join(f"{name}: accuracy, mean ± std (seeds) | CPU s" for name in names) + " |",
             "|---|" + "---|---|" * len(names)]
    for kind in ["teacher", *KINDS]:
        cells = []
        for name in names:
            runs = [row for row in rows if (row["kind"], row["dataset"]) == (kind, name)]
            cells += [spread([row["accuracy"] for row in runs]) if runs else "–",
                      f"{statistics.mean(row['cpu_seconds'] for row in runs):.0f}" if runs else "–"]
        if any(cell != "–" for cell in cells):
            lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def gain_table(rows: list[dict], names: list[str]) -> str:
    """Distillation against labels alone, seed by seed: the same student, data and seed."""
    rows = study_rows(rows)
    found = {(row["kind"], row["dataset"], row["seed"]): row["accuracy"] for row in rows}
    lines = ["| student | dataset | arm | gain over labels alone, per seed | mean gain | labels-only std |",
             "|---|---|---|---|---|---|"]
    for student, arms in (("cut6", ("hard", "soft")), ("cut4", ("hard", "soft")), ("base6", ("soft",)),
                          ("tiny", ("match",))):
        for name in names:
            alone = {seed: found[(f"{student}_none", name, seed)] for kind, dataset, seed in found
                     if (kind, dataset) == (f"{student}_none", name)}
            for arm in arms:
                gains = [found[(f"{student}_{arm}", name, seed)] - alone[seed] for seed in sorted(alone)
                         if (f"{student}_{arm}", name, seed) in found]
                if gains:
                    deviation = statistics.stdev(alone.values()) if len(alone) > 1 else 0.0
                    lines.append(f"| {student} | {name} | {arm} | {', '.join(f'{gain:+.3f}' for gain in gains)} | "
                                 f"{statistics.mean(gains):+.3f} | {deviation:.3f} |")
    return "\n".join(lines)


def variant_table(rows: list[dict]) -> str:
    """The cut students' lr and blocks tried (labels only): how the study's lr and blocks were chosen."""
    lines = ["| student | dataset | seed | blocks | lr | head lr | accuracy |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        if row["kind"] in ("cut6_none", "cut4_none"):
            blocks = row["keep"] or f"first {row['kind'][3]}"
            lines.append(f"| {row['kind']} | {row['dataset']} | {row['seed']} | {blocks} | {row['lr'] or 'auto'} | "
                         f"{row['head_lr'] or 'auto'} | {row['accuracy']:.3f} |")
    return "\n".join(lines)


def speed_table(rows: list[dict]) -> str:
    lines = []
    for row in rows:
        lines += [f"{row['dataset']} seed {row['seed']}, batch {row['batch']}, {row['rounds']} round(s) over the first "
                  f"{row.get('images', 1000)} eval "
                  f"images; load average before {row['load_before']}, after {row['load_after']}",
                  "| model | blocks | images/s, 1 thread | × teacher | images/s, "
                  f"{row['threads_all']} threads | × teacher |", "|---|---|---|---|---|---|"]
        one, every = row["images_per_s_1_threads"], row[f"images_per_s_{row['threads_all']}_threads"]
        for kind in one:
            lines.append(f"| {kind} | {row['blocks'][kind]} | {one[kind]:.0f} | {one[kind] / one['teacher']:.2f} | "
                         f"{every[kind]:.0f} | {every[kind] / every['teacher']:.2f} |")
    return "\n".join(lines)


def serve_table(rows: list[dict]) -> str:
    lines = []
    for row in rows:
        exported, every = row["export"], row["threads_all"]
        quantised = exported["quantized"]
        lines += [f"{row['kind']} ({row['dataset']} seed {row['seed']}): export parity, max abs logit difference "
                  f"{exported['parity']['max_abs_logit_difference']:.3g}; int8 {quantised['speedup']:.2f}x the float "
                  f"graph ({quantised['float_images_per_s']} -> {quantised['int8_images_per_s']} images/s), accuracy "
                  f"{quantised['float_accuracy']:.3f} -> {quantised['int8_accuracy']:.3f} "
                  f"({quantised['accuracy_change']:+.3f}), top-1 agreement {quantised['top1_agreement']:.3f}; "
                  f"load average before {row['load_before']}, after {row['load_after']}",
                  f"| runtime | images/s, 1 thread | accuracy | agrees with pipeline() | images/s, {every} threads | "
                  "accuracy |", "|---|---|---|---|---|---|"]
        for runtime, one in row["1_threads"].items():
            all_threads = row[f"{every}_threads"][runtime]
            lines.append(f"| {runtime} | {one['images_per_s']:.0f} | {one['accuracy']:.3f} | "
                         f"{one['agrees_with_pipeline']:.3f} | {all_threads['images_per_s']:.0f} | "
                         f"{all_threads['accuracy']:.3f} |")
    return "\n".join(lines)


def tables(names: list[str]) -> str:
    rows = read_results()
    return "\n\n".join([
        accuracy_table(rows, names), gain_table(rows, names), variant_table(rows),
        speed_table(read_results("speed.jsonl")), serve_table(read_results("serve.jsonl"))])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default=",".join(k for k in KINDS if not k.startswith("tiny")))
    parser.add_argument("--datasets", default=",".join(DATASETS))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--lr", type=float, default=None, help="the cut students' lr (default: auto)")
    parser.add_argument("--head-lr", type=float, default=None, help="the cut students' head lr (default: auto)")
    parser.add_argument("--keep", default=None, help="the cut students' blocks, e.g. 0,2,4,7,9,11 (default: first N)")
    parser.add_argument("--speed", action="store_true", help="CPU images/s of teacher and students, side by side")
    parser.add_argument("--serve", default=None, help="export and serving figures of these kinds, e.g. teacher,cut6_soft")
    parser.add_argument("--images", type=int, default=1000, help="--speed and --serve: the first N eval images")
    parser.add_argument("--table", action="store_true", help="only print the tables of the results recorded")
    options = parser.parse_args()
    ROOT.mkdir(parents=True, exist_ok=True)
    names, seeds = options.datasets.split(","), [int(s) for s in options.seeds.split(",")]
    if options.speed:
        record(speed(names[0], seeds[0], batch=32, rounds=1, count=options.images), "speed.jsonl")
    elif options.serve:
        for row in serve(names[0], seeds[0], options.serve.split(","), chunk=100, count=options.images):
            record(row, "serve.jsonl")
    elif not options.table:
        keep = tuple(int(block) for block in options.keep.split(",")) if options.keep else None
        train(options.kinds.split(",") if options.kinds else [], names, seeds, Variant(options.lr, options.head_lr, keep))
    print(tables(names))


if __name__ == "__main__":
    main()
