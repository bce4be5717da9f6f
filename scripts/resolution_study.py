"""Resolution study: does a resolution schedule (train.resolution_schedule) keep the accuracy of a run at the final size
for a share of its cost? The evidence train.resolution_schedule=auto waits for (resolution.MEASURED_SCHEDULES).

    python scripts/make_real_base.py            # once: the DINOv2-S/14 backbone (outputs/real_base/...)
    python scripts/resolution_study.py          # every arm on digits, 112 px final, 56 px low, seeds 0-2
    python scripts/resolution_study.py --sets digits,fashion --final-sizes 112,168 --low-sizes 56,84 --steps 300
    python scripts/resolution_study.py --table  # the table from every result recorded so far

Needs `pip install -e ".[study,realbase]"` (and Debian's `dataset-fashion-mnist` for --sets fashion).

Data: the small-data study's sets written once with save_to_disk (scripts/small_data_study.py: seeded, stratified
train / validation / test splits), or Fashion-MNIST (scripts/transfer_study.py). Base: the real DINOv2-S/14 backbone
as scripts/make_real_base.py saves it. Arms, each the same number of optimiser steps (--steps), the same lr schedule
and seed, for every (final size F, low size L) with L < F, both multiples of the patch size 14:
  final     the whole run at F
  low       the whole run at L (the model saved at L)
  sched50   train.resolution_schedule=[[L, 0.5], [F, 0.5]]
  sched70   [[L, 0.7], [F, 0.3]]
  sched85   [[L, 0.85], [F, 0.15]]
  fixres    the low arm's run, then a short fine-tune at F from its saved model, its head kept (FIXRES_SHARE of
            --steps more, FixRes: Touvron et al. 2019, arXiv 1906.06423); its cost is both runs'
  low_at_final  a diagnosis, not a way to train: the low arm's model moved to F untrained (one step at lr 1e-12),
            what a schedule's last stage starts from
Each run uses one torch thread and no loader workers (train.cpu_threads=1), and its cost is its CPU seconds, which
compare even while two studies share the cores (the wall time is kept beside it); the accuracy is
the saved model's on the test split (`vit_finetune evaluate`), never used for a choice. Results are appended to
outputs/resolution/results.jsonl; a run already recorded is not redone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from small_data_study import DATASETS, SmallDataset, write_dataset  # noqa: E402
from transfer_study import FASHION_NAMES, REAL_BASE, fashion_mnist  # noqa: E402

ROOT = REPO / "outputs" / "resolution"
# The small-data study's sets with a test split (faces has no image to spare for one), and Fashion-MNIST.
SETS = {"digits": dataclasses.replace(DATASETS["digits"], test_per_class=50),
        "mnist": dataclasses.replace(DATASETS["mnist"], test_per_class=100),
        "fashion": SmallDataset(fashion_mnist, list(range(10)), FASHION_NAMES, 40, 40, 0, 100)}
SCHEDULES = {"sched50": 0.5, "sched70": 0.7, "sched85": 0.85}  # arm -> share of the steps at the low size
ARMS = ["final", "low", *SCHEDULES, "fixres", "low_at_final"]
FIXRES_SHARE = 0.15
COMMON = ["--quiet", "data.eval_split=validation", "data.num_workers=0", "train.cpu_threads=1", "train.epochs=1000",
          "train.method=finetune", "train.batch_size=16", "pictures=false", "overwrite=true"]


def cli(argv: list[str]) -> tuple[float, float]:
    """One command of the toolkit in this process; its wall time and its CPU time (one thread and no loader workers:
    the CPU time is the run's cost even while other processes share the cores)."""
    from vit_finetune.cli import main

    print("$ python -m vit_finetune " + " ".join(argv), flush=True)
    start, start_cpu = time.perf_counter(), time.process_time()
    if main(argv) != 0:
        raise SystemExit("a run failed")
    return time.perf_counter() - start, time.process_time() - start_cpu


def train(out: Path, base: Path, size: int, data: Path, steps: int, seed: int, extra: list[str]) -> tuple[float, float]:
    return cli([*COMMON, f"model.base={base}", f"model.image_size={size}", f"data.dataset={data}",
                f"train.max_steps={steps}", f"train.seed={seed}", f"train.eval_every_steps={steps}",
                f"train.log_every_steps={steps}", f"output_dir={out}", *extra])


def test_accuracy(model: Path, data: Path) -> float:
    from vit_finetune.cli import evaluate_model

    return evaluate_model(str(model), str(data), "test")["accuracy"]


def run_arm(arm: str, name: str, data: Path, final: int, low: int, steps: int, seed: int, crop: list | None) -> dict:
    runs = ROOT / "runs" / name / (f"{final}-{low}-{steps}st-s{seed}" + (f"-crop{crop[0]}" if crop else ""))
    augment = [f"data.crop_scale=[{crop[0]},{crop[1]}]"] if crop else []
    out = runs / arm
    if arm == "final":
        seconds = train(out, REAL_BASE, final, data, steps, seed, augment)
    elif arm == "low":
        seconds = train(out, REAL_BASE, low, data, steps, seed, augment)
    elif arm in SCHEDULES:
        share = SCHEDULES[arm]
        schedule = f"train.resolution_schedule=[[{low},{share}],[{final},{round(1 - share, 6)}]]"
        seconds = train(out, REAL_BASE, final, data, steps, seed, [schedule, *augment])
    else:  # fixres, low_at_final: the low run (trained again here if its arm was not), then steps at the final size
        first = runs / "low"
        recorded = [cost(r) for r in read_results() if r["folder"] == str(first)]
        seconds = (recorded[-1] if recorded and (first / "model.safetensors").exists()
                   else train(first, REAL_BASE, low, data, steps, seed, augment))
        # model.keep_blocks=every block: the toolkit keeps a base's trained head only for a cut of the same labels
        depth = json.loads((first / "config.json").read_text())["num_hidden_layers"]
        steps_at_final, untrained = ((max(1, round(FIXRES_SHARE * steps)), []) if arm == "fixres" else
                                     (1, ["train.lr=1e-12", "train.head_lr=1e-12"]))
        more = train(out, first, final, data, steps_at_final, seed,
                     ["train.warmup_steps=0", f"model.keep_blocks={depth}", *untrained, *augment])
        seconds = (seconds[0] + more[0], seconds[1] + more[1])
    return {"set": name, "arm": arm, "final": final, "low": low, "steps": steps, "seed": seed, "crop_scale": crop,
            "test_accuracy": test_accuracy(out, data), "seconds": round(seconds[0], 1),
            "cpu_seconds": round(seconds[1], 1), "folder": str(out)}


def cost(result: dict) -> tuple[float, float]:
    """A run's (wall, CPU) seconds."""
    return result["seconds"], result["cpu_seconds"]


def crop_key(crop: list | None) -> tuple | None:
    """A crop range as a run's key holds it: a tuple, or None for the toolkit's auto."""
    return tuple(crop) if crop else None


def key(result: dict) -> tuple:
    """(set, final, low, steps, crop, seed, arm): one run of the study."""
    return (result["set"], result["final"], result["low"], result["steps"], crop_key(result.get("crop_scale")),
            result["seed"], result["arm"])


def read_results() -> list[dict]:
    path = ROOT / "results.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def table(results: list[dict]) -> str:
    lines = ["| set | final px | low px | steps | arm | test accuracy, mean ± std (seeds) | CPU s per run (1 thread) |",
             "|---|---|---|---|---|---|---|"]
    cells = sorted({key(r)[:5] for r in results}, key=lambda cell: (*cell[:4], cell[4] or ()))
    for cell in cells:
        for arm in ARMS:
            runs = [r for r in results if key(r)[:5] == cell and r["arm"] == arm]
            if not runs:
                continue
            values = [r["test_accuracy"] for r in runs]
            spread = statistics.stdev(values) if len(values) > 1 else 0.0
            name = cell[0] + (f", crop {cell[4][0]}-{cell[4][1]}" if cell[4] else "")
            lines.append(f"| {name} | {cell[1]} | {cell[2]} | {cell[3]} | {arm} | {statistics.mean(values):.3f} ± "
                         f"{spread:.3f} ({len(values)}) | {statistics.mean(cost(r)[1] for r in runs):.0f} |")
    return "\n".join(lines)


def sizes(text: str) -> list[int]:
    values = [int(value) for value in text.split(",")]
    bad = [value for value in values if value % 14]
    if bad:
        raise SystemExit(f"sizes {bad} are no multiple of DINOv2's patch size 14")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", default="digits", help=f"of {', '.join(SETS)}")
    parser.add_argument("--final-sizes", default="112")
    parser.add_argument("--low-sizes", default="56")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--steps", type=int, default=200, help="optimiser steps of every arm (fixres: of its low run)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--crop-scale", default="", help="e.g. 0.05,1.0: data.crop_scale for every arm (default: the "
                        "toolkit's auto, no crop at these lengths)")
    parser.add_argument("--table", action="store_true", help="only print the table of the results recorded")
    options = parser.parse_args()
    if not options.table:
        if not (REAL_BASE / "model.safetensors").exists():
            raise SystemExit(f"{REAL_BASE} is missing: python scripts/make_real_base.py")
        ROOT.mkdir(parents=True, exist_ok=True)
        crop = [float(value) for value in options.crop_scale.split(",")] if options.crop_scale else None
        done = {key(r) for r in read_results()}
        for name in options.sets.split(","):
            data = write_dataset(SETS[name], ROOT / "data" / name)
            for final in sizes(options.final_sizes):
                for low in [low for low in sizes(options.low_sizes) if low < final]:
                    for seed in [int(s) for s in options.seeds.split(",")]:
                        for arm in options.arms.split(","):
                            if (name, final, low, options.steps, crop_key(crop), seed, arm) in done:
                                continue
                            result = run_arm(arm, name, data, final, low, options.steps, seed, crop)
                            with open(ROOT / "results.jsonl", "a") as handle:
                                handle.write(json.dumps(result) + "\n")
    print(table(read_results()))


if __name__ == "__main__":
    main()
