"""The main recipe's job, short, timed whole: each side a fresh process, from its start to its exit.

    python -m vit_finetune.bench.whole_job                     # CUDA: ViT-B/16 at 384 px, 20,000 images, 2 epochs
    python -m vit_finetune.bench.whole_job --device cpu        # a dry run: the tiny model, a few hundred images

Both sides train on the same data, laid out as the Hub holds ethz/food101 (workload.ensure_hub_shards: parquet shards
of encoded JPEGs and the card that declares them), read through `load_dataset` as a Hub dataset is: 2 epochs,
evaluated on the validation split after each, a checkpoint, the final save.
  ours  `python -m vit_finetune --recipe food101_384` with overrides for the job's size only: the base, the data,
        the epochs, the warm-up (the recipe's share of its steps, 200 of 1,480), a checkpoint every epoch; the rest is
        the recipe's (SGD, batch 128 x 4 accumulated, bf16, cosine) and its `auto` choices.
  peer  transformers.Trainer as its image-classification example's README runs it: the example's transforms,
        AdamW at 2e-5, evaluation and a checkpoint every epoch, the best model loaded at the end, then save_model
        and a final evaluate; the same batch, accumulation, precision and workers as ours.
Each process marks the events of its run (ours through vit_finetune.artifacts.callbacks, the peer through a TrainerCallback);
the time between two marks is given to the phase the second one ends: start-up (imports, data, model, ours' linear
probe), the first step (with any compile), training, evaluation, checkpoints, and the final save with the exit. The
report prints the wall-time ratio and each phase's share, and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from vit_finetune import cli, data
from vit_finetune.artifacts import callbacks
from vit_finetune.bench.flops import MODELS
from vit_finetune.bench.peer import (
    ExampleBatchTransform, ExampleEvalTransform, ExampleTrainTransform, example_collate_fn,
)
from vit_finetune.bench.workload import ensure_base_model, ensure_hub_shards

DEFAULTS = {
    "cuda": {"model": "vit-b16-384", "images": 20_000, "eval_images": 5_000, "batch_size": 128, "grad_accum": 4,
             "precision": "bf16"},
    "cpu": {"model": "tiny", "images": 192, "eval_images": 48, "batch_size": 8, "grad_accum": 1, "precision": "no"},
}
RECIPE = "food101_384"
RECIPE_WARMUP_SHARE = 200 / 1480  # the recipe's warm-up steps over its steps (10 epochs of Food-101 at 512 a step)
PEER_LEARNING_RATE = 2e-5  # the example README's
PEER_SEED = 1337  # the example README's
# The phase each mark ends (the time since the previous mark), and the group the report shows it in.
PHASES = {"train_start": "start-up", "first_step": "first step", "step": "training", "evaluation": "evaluation",
          "checkpoint": "checkpoints", "train_end": "wrap-up", "final_save": "final save", "exit": "to exit"}
GROUPS = {"start-up and compile": ("start-up", "first step"), "training": ("training",),
          "evaluation": ("evaluation",), "saving": ("checkpoints", "wrap-up", "final save", "to exit")}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m vit_finetune.bench.whole_job", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--model", choices=sorted(MODELS))
    parser.add_argument("--images", type=int, help="training images (default: 20,000 on CUDA)")
    parser.add_argument("--eval-images", type=int, help="validation images, evaluated after each epoch")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, help="per device, both sides")
    parser.add_argument("--grad-accum", type=int, help="batches per optimiser step, both sides (the recipe's 4)")
    parser.add_argument("--workers", type=int, help="data loader workers, both sides (default: data.default_num_workers)")
    parser.add_argument("--sides", default="ours,peer", help="ours, peer or both, in that order")
    parser.add_argument("--ours", nargs="*", default=[], metavar="KEY=VALUE",
                        help="more overrides for our side, after the job's (e.g. model.compile=regional)")
    parser.add_argument("--cache", type=Path, help="where the shards and the base are written once "
                        "(default: $VIT_FINETUNE_CACHE/bench)")
    parser.add_argument("--work", type=Path, help="the sides' output folders and logs (default: a new temporary one)")
    parser.add_argument("--out", type=Path, default=Path("bench_out/whole_job.json"))
    parser.add_argument("--side", choices=("ours", "peer"), help=argparse.SUPPRESS)  # one side, in this process
    parser.add_argument("--job", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--marks", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side:
        return args
    sides = args.sides.split(",")
    if not sides or not set(sides) <= {"ours", "peer"}:
        parser.error(f"--sides={args.sides!r}: choose ours, peer or ours,peer")
    args.sides = sides
    for name in ("images", "eval_images", "epochs", "batch_size", "grad_accum"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be > 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here; use --device cpu")
    args.device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    for name, value in DEFAULTS[args.device].items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if args.workers is None:
        args.workers = data.default_num_workers(args.device, 1)
    return args


# ---------------------------------------------------------------- one side, in its own process

class Marks:
    """Appends `{"mark": name, "t": wall-clock time, ...}` lines to a file as the run passes its events."""

    def __init__(self, path: Path):
        self.path, self.steps = path, 0

    def __call__(self, mark: str, **extra) -> None:
        if mark == "step":
            self.steps += 1
            mark = "first_step" if self.steps == 1 else "step"
        with open(self.path, "a") as out:
            out.write(json.dumps({"mark": mark, "t": time.time(), **extra}) + "\n")


def peak_memory_gib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def run_ours(job: dict, mark: Marks) -> int:
    """Our side: the command line itself, observed through the documented hook (callbacks.register)."""
    class MarkEvents(callbacks.Callback):
        def on_train_start(self, run):
            mark("train_start")

        def on_step_end(self, run):
            mark("step")

        def on_evaluate(self, run, metrics):
            mark("evaluation", images=metrics.get("eval_samples"))

        def on_checkpoint(self, run, path):
            mark("checkpoint")

        def on_train_end(self, run, model):
            mark("train_end", peak_memory_gib=peak_memory_gib())

    callbacks.register(MarkEvents())
    return cli.main(job["argv"])


def run_peer(job: dict, mark: Marks) -> int:
    """The peer's side: what run_image_classification.py's main() does with the README's arguments, on our data."""
    import datasets
    import numpy as np
    from transformers import (AutoImageProcessor, AutoModelForImageClassification, Trainer, TrainerCallback,
                              TrainingArguments)

    class MarkEvents(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            mark("train_start")

        def on_step_end(self, args, state, control, **kwargs):
            mark("step")

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            mark("evaluation", images=(metrics or {}).get("eval_samples"))

        def on_save(self, args, state, control, **kwargs):
            mark("checkpoint")

        def on_train_end(self, args, state, control, **kwargs):
            mark("train_end", peak_memory_gib=peak_memory_gib())

    splits = datasets.load_dataset(job["dataset"])
    labels = splits["train"].features["label"].names
    processor = AutoImageProcessor.from_pretrained(job["base"])
    size = processor.size["shortest_edge"] if "shortest_edge" in processor.size else (
        processor.size["height"], processor.size["width"])
    splits["train"].set_transform(ExampleBatchTransform(ExampleTrainTransform(size, processor.image_mean,
                                                                              processor.image_std)))
    splits["validation"].set_transform(ExampleBatchTransform(ExampleEvalTransform(size, processor.image_mean,
                                                                                  processor.image_std)))
    model = AutoModelForImageClassification.from_pretrained(
        job["base"], num_labels=len(labels), id2label=dict(enumerate(labels)),
        label2id={label: index for index, label in enumerate(labels)}, ignore_mismatched_sizes=True)
    cuda = torch.cuda.is_available() and job["device"] == "cuda"
    args = TrainingArguments(
        output_dir=job["output_dir"], per_device_train_batch_size=job["batch_size"],
        per_device_eval_batch_size=job["batch_size"], gradient_accumulation_steps=job["grad_accum"],
        num_train_epochs=job["epochs"], learning_rate=PEER_LEARNING_RATE, bf16=job["precision"] == "bf16",
        dataloader_num_workers=job["workers"], dataloader_pin_memory=cuda, remove_unused_columns=False,
        eval_strategy="epoch", save_strategy="epoch", load_best_model_at_end=True, save_total_limit=3,
        logging_strategy="steps", logging_steps=10, seed=PEER_SEED, report_to="none", disable_tqdm=True,
        use_cpu=not cuda)

    def accuracy(prediction) -> dict:  # the example's evaluate.load("accuracy") needs the Hub
        return {"accuracy": float(np.mean(np.argmax(prediction.predictions, axis=-1) == prediction.label_ids))}

    trainer = Trainer(model=model, args=args, train_dataset=splits["train"], eval_dataset=splits["validation"],
                      processing_class=processor, data_collator=example_collate_fn, compute_metrics=accuracy,
                      callbacks=[MarkEvents()])
    result = trainer.train()
    trainer.save_model()
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics)
    trainer.save_state()
    mark("final_save")
    metrics = trainer.evaluate()
    trainer.log_metrics("eval", metrics)
    trainer.save_metrics("eval", metrics)
    return 0


SIDES: dict[str, Callable[[dict, Marks], int]] = {"ours": run_ours, "peer": run_peer}


# ---------------------------------------------------------------- the job, both sides

def ours_argv(args: argparse.Namespace, base: Path, shards: Path, output_dir: Path) -> list[str]:
    """The main recipe with the job's size: its steps, warm-up and checkpoints follow from the images and epochs."""
    spec = MODELS[args.model]
    steps_per_epoch = math.ceil(math.ceil(args.images / args.batch_size) / args.grad_accum)  # as plan.RunSize counts
    warmup = max(1, round(RECIPE_WARMUP_SHARE * steps_per_epoch * args.epochs))
    return ["--recipe", RECIPE, f"model.base={base}", f"model.image_size={spec.image_size}", f"data.dataset={shards}",
            f"train.epochs={args.epochs}", f"train.batch_size={args.batch_size}", f"train.grad_accum={args.grad_accum}",
            f"train.warmup_steps={warmup}", f"train.checkpoint_every_steps={steps_per_epoch}",
            f"train.mixed_precision={args.precision}", f"data.num_workers={args.workers}",
            f"output_dir={output_dir}", "overwrite=true", *args.ours]  # overwrite: --work may hold an earlier run


def fresh_process(argv: list[str], env: dict[str, str], log: Path) -> int:
    """`python -m vit_finetune.bench.whole_job ARGV` as a new interpreter, its output in `log`; its exit code."""
    with open(log, "w") as out:
        return subprocess.run([sys.executable, "-m", "vit_finetune.bench.whole_job", *argv], stdout=out,
                              stderr=subprocess.STDOUT, env=env).returncode


def phases(started: float, marks: list[dict], ended: float) -> dict[str, float]:
    """Seconds per phase: each stretch between two marks goes to the phase of the mark that ends it."""
    seconds = dict.fromkeys(PHASES.values(), 0.0)
    before = started
    for entry in [*marks, {"mark": "exit", "t": ended}]:
        seconds[PHASES[entry["mark"]]] += entry["t"] - before
        before = entry["t"]
    return seconds


def time_side(side: str, job: dict, work: Path, launch: Callable[[list[str], dict, Path], int]) -> dict:
    """One side launched, timed from before its start to after its exit, its marks read back."""
    job_file, marks_file, log = work / f"{side}.job.json", work / f"{side}.marks.jsonl", work / f"{side}.log"
    job_file.write_text(json.dumps(job))
    marks_file.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    print(f"whole job: {side} ...", flush=True)
    started = time.time()
    code = launch(["--side", side, "--job", str(job_file), "--marks", str(marks_file)], env, log)
    ended = time.time()
    marks = [json.loads(line) for line in marks_file.read_text().splitlines()] if marks_file.exists() else []
    result = {"exit_code": code, "log": str(log), "wall_s": ended - started, "marks": marks}
    if code != 0:
        tail = log.read_text()[-3000:] if log.exists() else ""
        print(f"whole job: {side} failed (exit {code}); the end of {log}:\n{tail}", flush=True)
        return {**result, "error": f"exit code {code}; see {log}"}
    seconds = phases(started, marks, ended)
    evaluations = [entry for entry in marks if entry["mark"] == "evaluation"]
    return {**result, "phases_s": seconds,
            "groups_s": {group: sum(seconds[phase] for phase in members) for group, members in GROUPS.items()},
            "steps": sum(entry["mark"] in ("first_step", "step") for entry in marks),
            "evaluations": len(evaluations),
            "peak_memory_gib": next((entry.get("peak_memory_gib") for entry in marks if entry["mark"] == "train_end"),
                                    None)}


def run_job(args: argparse.Namespace, work: Path, launch: Callable[[list[str], dict, Path], int] = fresh_process
            ) -> dict:
    """Both sides of the job on data and a base written once under the cache; the report."""
    cache = args.cache or data.cache_dir() / "bench"
    spec = MODELS[args.model]
    shards, stats = ensure_hub_shards(cache, args.images, args.eval_images, spec.num_labels, data.cpu_cores())
    base = ensure_base_model(cache, args.model, spec)
    jobs = {
        "ours": {"argv": ours_argv(args, base, shards, work / "ours")},
        "peer": {"dataset": str(shards), "base": str(base), "output_dir": str(work / "peer"), "device": args.device,
                 "batch_size": args.batch_size, "grad_accum": args.grad_accum, "epochs": args.epochs,
                 "workers": args.workers, "precision": args.precision},
    }
    sides = {side: time_side(side, jobs[side], work, launch) for side in args.sides}
    report = {"schema": "vit_finetune.bench.whole_job/1", "date": time.strftime("%Y-%m-%d"),
              "device": torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({data.cpu_cores()} cores)",
              "job": {"model": args.model, "image_size": spec.image_size, "train_images": args.images,
                      "eval_images": args.eval_images, "epochs": args.epochs, "batch_size": args.batch_size,
                      "grad_accum": args.grad_accum, "workers": args.workers, "precision": args.precision,
                      "data": {"folder": str(shards), **stats}, "ours_command": ["python", "-m", "vit_finetune",
                                                                                 *jobs["ours"]["argv"]]},
              "sides": sides}
    if all(side in sides and "error" not in sides[side] for side in ("ours", "peer")):
        report["ours / peer wall time"] = sides["ours"]["wall_s"] / sides["peer"]["wall_s"]
    return report


def format_table(report: dict) -> str:
    job = report["job"]
    lines = [f"whole job on {report['device']}: {job['model']} at {job['image_size']} px, {job['train_images']:,} "
             f"training images x {job['epochs']} epochs, {job['eval_images']:,} evaluated after each, batch "
             f"{job['batch_size']} x {job['grad_accum']}, {job['precision']}, {job['workers']} workers",
             f"{'side':6s} {'wall s':>8s} " + " ".join(f"{group:>22s}" for group in GROUPS) + f" {'peak memory':>12s}"]
    for side, result in report["sides"].items():
        if "error" in result:
            lines.append(f"{side:6s} failed: {result['error']}")
            continue
        wall = result["wall_s"]
        shares = " ".join(f"{seconds:13.1f} s ({100 * seconds / wall:3.0f}%)" for seconds in result["groups_s"].values())
        memory = "-" if result["peak_memory_gib"] is None else f"{result['peak_memory_gib']:.1f} GiB"
        lines.append(f"{side:6s} {wall:8.1f} {shares} {memory:>12s}")
    if "ours / peer wall time" in report:
        lines.append(f"ours / peer wall time: {report['ours / peer wall time']:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None, launch: Callable[[list[str], dict, Path], int] = fresh_process) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.side:
        import datasets

        datasets.disable_progress_bars()
        return SIDES[args.side](json.loads(args.job.read_text()), Marks(args.marks))
    with tempfile.TemporaryDirectory(prefix="vit-whole-job-") as temporary:
        work = args.work or Path(temporary)
        work.mkdir(parents=True, exist_ok=True)
        report = run_job(args, work, launch)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(format_table(report))
    print(f"wrote {args.out}")
    return 1 if any("error" in result for result in report["sides"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
