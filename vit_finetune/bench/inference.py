"""Evaluation and predict against the Trainer's evaluate and pipeline("image-classification"), at the model's size.

    python -m vit_finetune.bench.inference                       # CUDA: ViT-B/16 at 384 px, 5,000 images, batch 128
    python -m vit_finetune.bench.inference --device cpu          # a dry run: the tiny model, a few images

  evaluation  our evaluation pass as a training run makes it (build.run_parts' eval loader, loop.measure: decoding in
              the loader's workers, uint8 batches normalised on the device, the run's precision) against
              Trainer.evaluate as the image-classification example sets it up (its Resize + CenterCrop transform,
              float32 batches, bf16=True, the same batch and workers), both over the validation split of the whole
              job's parquet shards (workload.ensure_hub_shards), read through load_dataset.
  predict     `python -m vit_finetune predict MODEL FOLDER --batch-size B` (the command's own function, in this
              process) against pipeline("image-classification", model=MODEL, batch_size=B) over the same JPEG files,
              both with the model in float32, as each loads it.
Each is timed twice, one after the other (the first pass also starts the workers, loads kernels, and compiles where
the run compiles); the report gives both passes' images/s and the ratios of the second.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from vit_finetune import cli, data
from vit_finetune.artifacts.callbacks import TrainingRun
from vit_finetune.artifacts.checkpoint import TrainState
from vit_finetune.bench.device import synchronize
from vit_finetune.bench.flops import MODELS
from vit_finetune.bench.peer import ExampleBatchTransform, ExampleEvalTransform, example_collate_fn
from vit_finetune.bench.whole_job import DEFAULTS as JOB_DEFAULTS
from vit_finetune.bench.workload import ensure_base_model, ensure_hub_shards, ensure_jpeg_folder
from vit_finetune.core.processes import reset_accelerate_state
from vit_finetune.recipe import validate
from vit_finetune.training import loop
from vit_finetune.training.build import run_parts
from vit_finetune.training.devices import make_accelerator, prepare

DEFAULTS = {"cuda": {"predict_images": 1_024}, "cpu": {"predict_images": 16}}
PASSES = 2


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m vit_finetune.bench.inference", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--model", choices=sorted(MODELS))
    parser.add_argument("--images", type=int, help="training images of the whole job's shards (only their "
                        "validation split is read here; the same shards are reused)")
    parser.add_argument("--eval-images", type=int, help="validation images evaluated")
    parser.add_argument("--predict-images", type=int, help="JPEG files predicted (default: 1,024 on CUDA)")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--workers", type=int, help="evaluation loader workers, both sides")
    parser.add_argument("--cache", type=Path, help="default: $VIT_FINETUNE_CACHE/bench")
    parser.add_argument("--out", type=Path, default=Path("bench_out/inference.json"))
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here; use --device cpu")
    for name in ("images", "eval_images", "predict_images", "batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be > 0")
    args.device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    for name, value in {**JOB_DEFAULTS[args.device], **DEFAULTS[args.device]}.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if args.workers is None:
        args.workers = data.default_num_workers(args.device, 1)
    return args


def timed(run, device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    run()
    synchronize(device)
    return time.perf_counter() - start


def rates(images: int, seconds: list[float]) -> dict:
    return {"images": images, "seconds": seconds, "images_per_s": [images / second for second in seconds]}


def our_evaluation(args: argparse.Namespace, base: Path, shards: Path, work: Path) -> dict:
    """Our evaluation pass over the validation split, built and prepared as a run builds it (its plan's `auto`
    choices for a one-step run: no compile)."""
    asked = validate({
        "model": {"base": str(base), "image_size": MODELS[args.model].image_size},
        "data": {"dataset": str(shards), "num_workers": args.workers, "max_train_samples": args.batch_size},
        "train": {"batch_size": args.batch_size, "max_steps": 1, "mixed_precision": args.precision,
                  "method": "finetune"},
        "output_dir": str(work / "ours"),
    }, "inference bench recipe")
    accelerator = make_accelerator(asked)
    recipe, parts = run_parts(asked, accelerator)
    prepare(accelerator, parts, recipe)
    run = TrainingRun(recipe, accelerator, parts, TrainState(), asked)
    found = {}
    seconds = [timed(lambda: found.update(metrics=loop.measure(run)[0]), accelerator.device) for _ in range(PASSES)]
    images = found["metrics"]["eval_samples"]
    reset_accelerate_state()
    return {**rates(images, seconds), "settings": {"precision": recipe.train.mixed_precision,
                                                   "compile": recipe.model.compile, "batch_size": args.batch_size,
                                                   "num_workers": args.workers}}


def peer_evaluation(args: argparse.Namespace, base: Path, shards: Path, work: Path) -> dict:
    """Trainer.evaluate over the same split, set up as the image-classification example sets it up."""
    import datasets
    import numpy as np
    from transformers import AutoImageProcessor, AutoModelForImageClassification, Trainer, TrainingArguments

    validation = datasets.load_dataset(str(shards), split="validation")
    processor = AutoImageProcessor.from_pretrained(base)
    size = processor.size["shortest_edge"] if "shortest_edge" in processor.size else (
        processor.size["height"], processor.size["width"])
    validation.set_transform(ExampleBatchTransform(ExampleEvalTransform(size, processor.image_mean,
                                                                        processor.image_std)))
    cuda = args.device == "cuda"
    trainer = Trainer(
        model=AutoModelForImageClassification.from_pretrained(base, attn_implementation="sdpa"),
        args=TrainingArguments(output_dir=str(work / "peer"), per_device_eval_batch_size=args.batch_size,
                               bf16=args.precision == "bf16", dataloader_num_workers=args.workers,
                               dataloader_pin_memory=cuda, remove_unused_columns=False, report_to="none",
                               disable_tqdm=True, use_cpu=not cuda),
        eval_dataset=validation, data_collator=example_collate_fn, processing_class=processor,
        compute_metrics=lambda p: {"accuracy": float(np.mean(np.argmax(p.predictions, -1) == p.label_ids))})
    seconds = [timed(trainer.evaluate, torch.device(args.device)) for _ in range(PASSES)]
    reset_accelerate_state()
    return {**rates(len(validation), seconds), "settings": {"precision": "bf16" if trainer.args.bf16 else "no",
                                                          "batch_size": args.batch_size, "num_workers": args.workers}}


def our_predict(args: argparse.Namespace, base: Path, folder: Path, work: Path) -> dict:
    output = work / "predictions.jsonl"
    command = ["predict", str(base), str(folder), "--batch-size", str(args.batch_size), "--device", args.device,
               "--output", str(output), "--overwrite"]
    seconds = []
    for _ in range(PASSES):
        seconds.append(timed(lambda: cli.main(command), torch.device(args.device)))
    rows = output.read_text().splitlines()
    return {**rates(len(rows), seconds), "command": ["python", "-m", "vit_finetune", *command]}


def pipeline_predict(args: argparse.Namespace, base: Path, folder: Path) -> dict:
    from transformers import pipeline

    files = sorted(str(path) for path in folder.rglob("*.jpg"))
    found = {}

    def run():
        classifier = pipeline("image-classification", model=str(base), device=args.device, batch_size=args.batch_size)
        found["rows"] = classifier(files, top_k=5)

    seconds = [timed(run, torch.device(args.device)) for _ in range(PASSES)]
    return {**rates(len(found["rows"]), seconds),
            "call": f'pipeline("image-classification", model=MODEL, device="{args.device}", '
                    f'batch_size={args.batch_size})(files, top_k=5)'}


def ratio(ours: dict, peer: dict) -> float | None:
    if "error" in ours or "error" in peer:
        return None
    return ours["images_per_s"][-1] / peer["images_per_s"][-1]


def measured(title: str, run) -> dict:
    print(f"inference bench: {title} ...", flush=True)
    try:
        return run()
    except Exception as error:  # one side failing must not lose the other's figures
        traceback.print_exc()
        return {"error": " ".join(f"{type(error).__name__}: {error}".split())}


def format_table(report: dict) -> str:
    lines = [f"inference on {report['device']}: {report['model']} at {report['image_size']} px, batch "
             f"{report['batch_size']}; images/s of each pass"]
    for title, name in (("evaluation, ours", "evaluation_ours"), ("evaluate, Trainer", "evaluation_peer"),
                        ("predict, ours", "predict_ours"), ("predict, pipeline()", "predict_pipeline")):
        result = report[name]
        shown = (f"failed: {result['error'][:200]}" if "error" in result else
                 " / ".join(f"{rate:,.1f}" for rate in result["images_per_s"]) + f"  ({result['images']:,} images)")
        lines.append(f"  {title:22s} {shown}")
    for name, value in report["ratios"].items():
        lines.append(f"  {name}: " + ("-" if value is None else f"{value:.3f}"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    spec = MODELS[args.model]
    cache = args.cache or data.cache_dir() / "bench"
    shards, _ = ensure_hub_shards(cache, args.images, args.eval_images, spec.num_labels, data.cpu_cores())
    jpegs, _ = ensure_jpeg_folder(cache, args.predict_images, spec.num_labels, data.cpu_cores())
    base = ensure_base_model(cache, args.model, spec)
    with tempfile.TemporaryDirectory(prefix="vit-inference-") as temporary:
        work = Path(temporary)
        report = {
            "schema": "vit_finetune.bench.inference/1", "date": time.strftime("%Y-%m-%d"),
            "device": torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({data.cpu_cores()} cores)",
            "model": args.model, "image_size": spec.image_size, "batch_size": args.batch_size,
            "evaluation_ours": measured("our evaluation pass", lambda: our_evaluation(args, base, shards, work)),
            "evaluation_peer": measured("Trainer.evaluate", lambda: peer_evaluation(args, base, shards, work)),
            "predict_ours": measured("our predict", lambda: our_predict(args, base, jpegs / "train", work)),
            "predict_pipeline": measured("pipeline()", lambda: pipeline_predict(args, base, jpegs / "train")),
        }
    report["ratios"] = {"evaluation: ours / Trainer.evaluate images/s": ratio(report["evaluation_ours"],
                                                                              report["evaluation_peer"]),
                        "predict: ours / pipeline() images/s": ratio(report["predict_ours"],
                                                                     report["predict_pipeline"])}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(format_table(report))
    print(f"wrote {args.out}")
    return 1 if any(value is None for value in report["ratios"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
