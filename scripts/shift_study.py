"""Shift study on a real pretrained ViT: which defaults hold when the evaluation images come from another source.

    python scripts/make_real_base.py       # once: the DINOv2-S/14 backbone (outputs/real_base/...)
    python scripts/shift_study.py --sets mnist_to_digits --arms defaults,peer --steps 60,600 --seeds 0,1,2
    python scripts/shift_study.py --table  # the tables and the picture from every result recorded so far

Each set (scripts/shift_sources.py) trains on one source and is scored on two test splits: `test`, more images of
the training source, and `shifted`, images of the same classes from another source (another scanner, another icon
artist drawing other items, another solar-panel type). The run's own eval split (`validation`, from the training
source) is what every choice of the run sees, as a user's held-out images would be: nothing about the shifted
source reaches training.

Cells are (arm, set, image size, optimiser steps, seed), batch 16, one torch thread, no loader workers, evaluated
once at the end; the same reference base as the transfer study (scripts/transfer_study.py: the real backbone's grid
moved once to 6x6, 84 px, every cell fine-tuned below it at 56 px or above it at 112 px).
Arms: the toolkit's defaults (whatever the schema says when the cell runs, recorded with what auto chose), each
augmentation lever alone on top of them, the methods forced, WiSE-FT's alpha, the defaults with every point of
WiSE-FT's path scored on each split (`wise_path`), and the transformers example recipe on the Trainer (`peer`: crops
of 8-100 % of the area and a flip, lr 2e-5, linear schedule; scripts/peer_example.py).
Results are appended to outputs/shift/results.jsonl or --results FILE (a cell recorded there is not redone unless
--rerun; --table reads the same file); the cells measured so far are kept in scripts/shift_study_results.jsonl: copy
it there to extend it. --override KEY=VALUE adds a recipe override to every toolkit arm (not the peer), recorded with
the cell; each cell also records the device it trained on. --shard K/N runs the K-th of N interleaved slices of the
cell list (sliced before the recorded cells are dropped, so N processes sharing one results file never split it
differently), --deadline SECONDS starts no cell after that long and --keep-going reports a failed cell and goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import shift_sources  # noqa: E402
from transfer_study import BATCH, PEER_LR, cpu_time, reference_base  # noqa: E402

ROOT = REPO / "outputs" / "shift"
RECORDED = REPO / "scripts" / "shift_study_results.jsonl"

# Arm -> overrides on top of the schema's defaults; "peer" is the Trainer, not an option set.
ARMS = {
    "defaults": [],
    # the same run without the data checks: the flip off and alpha dropped, the earlier defaults
    "unchecked": ["data.horizontal_flip=false", "data.alpha_background=null"],
    "alpha_white": ["data.alpha_background=white"],
    "alpha_white_no_flip": ["data.alpha_background=white", "data.horizontal_flip=false"],
    "linear_probe": ["train.method=linear_probe"],
    "lp_ft": ["train.method=lp_ft"],
    "finetune": ["train.method=finetune"],
    "lp_ft_wise1": ["train.method=lp_ft", "train.wise_ft_alpha=1"],
    "lp_ft_wise0.5": ["train.method=lp_ft", "train.wise_ft_alpha=0.5"],
    # each augmentation lever alone, the rest of the defaults kept (auto's method included)
    "flip": ["data.horizontal_flip=true"],
    "crop08": ["data.crop_scale=[0.08,1.0]"],
    "crop35": ["data.crop_scale=[0.35,1.0]"],
    "crop60": ["data.crop_scale=[0.6,1.0]"],
    "no_crop": ["data.crop_scale=[1.0,1.0]"],  # what auto chooses on these runs, pinned: a baseline for the crop arms
    "crop08_flip": ["data.crop_scale=[0.08,1.0]", "data.horizontal_flip=true"],  # the peer's augmentation
    "randaugment": ["augment.policy=randaugment"],
    "mixup_cutmix": ["augment.mixup=true", "augment.cutmix=true"],
    # the other ways to keep a fine-tune near its start: smaller steps in the early blocks, an averaged copy, a low lr
    "layer_decay": ["train.layer_decay=0.75"],  # each block below the head at 0.75 of the lr of the one above
    "layer_decay0.9": ["train.layer_decay=0.9"],  # milder: the patch embedding at 0.9^13 = 0.25 of the lr
    "ema": ["train.ema_decay=0.99"],  # an average over ~100 steps kept beside the weights, saved where it scores better
    "lr1e-5": ["train.lr=1e-5"],  # half the defaults' lr of 2e-5 (after the probe the head trains at it too)
    # regularisers that leave every weight free to move: stochastic depth, softer targets
    "drop_path0.1": ["model.drop_path_rate=0.1"],  # each residual branch dropped with up to 0.1 chance, deeper more
    "label_smoothing0.1": ["train.label_smoothing=0.1"],
    # LoRA (rank 16 on query and value, the toolkit's defaults) in place of every weight: the pretrained weights stay
    "lora": ["model.lora={r: 16}"],
    # the run's own eval split taken from the shifted source, as a user's eval folder from elsewhere would be: what
    # the run chooses on its eval split (the method's end, WiSE-FT's average) then sees the other source
    "eval_shifted": ["data.eval_split=shifted", "data.crop_scale=[1.0,1.0]"],
    "eval_shifted_crop08": ["data.eval_split=shifted", "data.crop_scale=[0.08,1.0]"],
    "eval_shifted_auto": ["data.eval_split=shifted"],  # the crop left to auto, which the shift test then decides
    # the defaults, and beside them every point of WiSE-FT's path scored on each split (PATH_ALPHAS)
    "wise_path": [],
}
# wise_path: alpha x the fine-tuned weights + (1 - alpha) x the probe's model the run averages with, for each alpha;
# 0 is the probe's model itself, 1 the fine-tuned weights. Taken in the run, so the start is the run's own probe.
PATH_ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0)
PATH_SPLITS = ("validation", "test", "shifted")
PEER = "peer"


@dataclass(frozen=True)
class Cell:
    arm: str
    set: str
    size: int
    steps: int  # 0 for linear_probe, which takes no optimiser step: one cell serves every schedule
    seed: int  # the probe draws nothing at random: seed 0 serves every seed

    def name(self) -> str:
        return f"{self.set}-{self.arm}-{self.size}px-{self.steps}st-s{self.seed}"

    def key(self) -> tuple:
        return (self.arm, self.set, self.size, self.steps, self.seed)


def cells(arms: list[str], sets: list[str], sizes: list[int], steps: list[int], seeds: list[int]) -> list[Cell]:
    out = []
    for arm in arms:
        for name in sets:
            for size in sizes:
                if arm == "linear_probe":
                    out.append(Cell(arm, name, size, 0, 0))
                    continue
                out += [Cell(arm, name, size, n, seed) for n in steps for seed in seeds]
    return list(dict.fromkeys(out))


def toolkit_argv(cell: Cell, base: Path, data: Path, out: Path, overrides: tuple[str, ...] = ()) -> list[str]:
    schedule = ([f"train.max_steps={cell.steps}", "train.epochs=1000", f"train.eval_every_steps={cell.steps}",
                 f"train.log_every_steps={cell.steps}"] if cell.steps else [])
    return ["--quiet", f"model.base={base}", f"model.image_size={cell.size}", f"data.dataset={data}",
            "data.eval_split=validation", "data.num_workers=0", *schedule, f"train.batch_size={BATCH}",
            f"train.seed={cell.seed}", f"output_dir={out}", "overwrite=true", *ARMS[cell.arm], *overrides]


def run_toolkit(cell: Cell, base: Path, data: Path, out: Path, overrides: tuple[str, ...] = ()) -> dict:
    import yaml

    from vit_finetune.cli import main

    argv = toolkit_argv(cell, base, data, out, overrides)
    print("$ python -m vit_finetune " + " ".join(argv), flush=True)
    if main(argv) != 0:
        raise SystemExit(f"cell {cell.name()} failed")
    metrics = json.loads((out / "metrics.json").read_text())
    resolved = yaml.safe_load((out / "recipe.yaml").read_text())
    recorded = {"validation_accuracy": metrics["accuracy"], "method_used": resolved["train"]["method"],
                "crop_scale_used": resolved["data"]["crop_scale"],
                "horizontal_flip_used": resolved["data"]["horizontal_flip"],
                "alpha_background_used": resolved["data"].get("alpha_background"),
                "wise_ft_alpha_used": resolved["train"]["wise_ft_alpha"], "lr_used": resolved["train"]["lr"],
                "eval_unlike_train": metrics.get("eval_unlike_train")}
    if "wise_ft" in metrics:
        recorded["wise_ft_kept"] = metrics["wise_ft"]["kept"]
    return recorded


@contextlib.contextmanager
def wise_ft_path_captured(captured: dict):
    """While the run ends, its fine-tuned weights and the probe's model it averages with, copied into `captured`.
    The study reads the toolkit's own WiSE-FT step: the run itself goes on unchanged."""
    from vit_finetune.training import selection, wise_ft

    original = selection.average_if_no_worse

    def capturing(model, start, *args, **kwargs):
        captured.update(fine_tuned=wise_ft.snapshot(model), start=dict(start))
        return original(model, start, *args, **kwargs)

    selection.average_if_no_worse = capturing
    try:
        yield
    finally:
        selection.average_if_no_worse = original


def score_wise_ft_path(out: Path, data: Path, captured: dict, splits: tuple[str, ...] = PATH_SPLITS) -> dict:
    """Accuracy and loss on each of `splits` at each of PATH_ALPHAS: the run's saved model loaded, its weights replaced
    by the point's (the captured weights carry the model's own names, which saving may rename) and saved beside it."""
    import torch
    from transformers import AutoModelForImageClassification

    from vit_finetune.serving.evaluate_saved import evaluate_saved

    if "start" not in captured:
        raise SystemExit(f"{out}: the run made no WiSE-FT average (the method auto chose fits no probe)")
    model = AutoModelForImageClassification.from_pretrained(out)
    unknown = sorted(set(captured["start"]) - set(model.state_dict()))
    if unknown:  # the path would otherwise leave those weights where the run saved them, at every alpha
        raise SystemExit(f"{out}: the saved model has no {', '.join(unknown[:3])}, which the average moves")
    point = out.with_name(out.name + "-path")
    scores, losses = {}, {}
    for alpha in PATH_ALPHAS:
        with torch.no_grad():
            model.load_state_dict({name: alpha * captured["fine_tuned"][name] + (1 - alpha) * start
                                   for name, start in captured["start"].items()}, strict=False)
        shutil.rmtree(point, ignore_errors=True)
        shutil.copytree(out, point, ignore=shutil.ignore_patterns("model.safetensors", "*.png"))
        model.save_pretrained(point)
        metrics = {split: evaluate_saved(str(point), str(data), split) for split in splits}
        scores[f"{alpha:g}"] = {split: metrics[split]["accuracy"] for split in splits}
        losses[f"{alpha:g}"] = {split: metrics[split]["eval_loss"] for split in splits}
    shutil.rmtree(point, ignore_errors=True)
    return {"wise_ft_path": scores, "wise_ft_path_loss": losses}


def path_reproduces_kept(outcome: dict) -> bool:
    """Whether the path's point at the weights the run kept scores what the saved model scored: the check that the
    path moved every weight the average moves (the same sums, made in another order, may still differ in the last
    bit)."""
    alpha = outcome["wise_ft_alpha_used"] if outcome.get("wise_ft_kept") == "average" else 1.0
    point = outcome["wise_ft_path"].get(f"{alpha:g}")
    return point is not None and all(point[split] == outcome[f"{split}_accuracy"] for split in ("test", "shifted"))


def score_toolkit(out: Path, data: Path) -> dict:
    from vit_finetune.serving.evaluate_saved import evaluate_saved

    return {f"{split}_accuracy": evaluate_saved(str(out), str(data), split)["accuracy"] for split in ("test", "shifted")}


def run_peer(cell: Cell, base: Path, data: Path, out: Path) -> dict:
    from peer_example import train_peer

    scores = train_peer(data, base, cell.size, cell.steps, BATCH, PEER_LR, cell.seed, out,
                        score_splits=("validation", "test", "shifted"))
    return {"validation_accuracy": scores["validation"], "test_accuracy": scores["test"],
            "shifted_accuracy": scores["shifted"], "method_used": "finetune", "crop_scale_used": [0.08, 1.0],
            "horizontal_flip_used": True, "alpha_background_used": None, "lr_used": PEER_LR}


def device_name() -> str:
    """The device a cell trains on, in words: the toolkit and the Trainer both take the GPU when there is one."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def run_cell(cell: Cell, base: Path, results: Path, overrides: tuple[str, ...] = ()) -> dict:
    data = shift_sources.write(shift_sources.SETS[cell.set], ROOT / "data" / cell.set)
    out = ROOT / "runs" / cell.name()
    start, cpu_start = time.perf_counter(), cpu_time()
    captured = {}
    with wise_ft_path_captured(captured) if cell.arm == "wise_path" else contextlib.nullcontext():
        outcome = (run_peer(cell, base, data, out) if cell.arm == PEER
                   else run_toolkit(cell, base, data, out, overrides))
    seconds, cpu_seconds = round(time.perf_counter() - start, 1), round(cpu_time() - cpu_start, 1)
    if cell.arm != PEER:  # after the timing: the cell's seconds stay its training's
        outcome.update(score_toolkit(out, data))
    if cell.arm == "wise_path":
        outcome.update(score_wise_ft_path(out, data, captured))
        outcome["path_reproduces_kept"] = path_reproduces_kept(outcome)
    result = {"arm": cell.arm, "set": cell.set, "size": cell.size, "steps": cell.steps, "seed": cell.seed,
              "batch": BATCH, "images_seen": cell.steps * BATCH, "seconds": seconds, "cpu_seconds": cpu_seconds,
              "device": device_name(), **outcome}
    if overrides and cell.arm != PEER:
        result["overrides"] = list(overrides)
    with open(results, "a") as handle:  # one write of one line: processes sharing the file append whole lines
        handle.write(json.dumps(result) + "\n")
    return result


def read_results(path: Path) -> list[dict]:
    """Every cell's latest result (a cell measured again replaces the earlier figure)."""
    latest = {}
    for line in (path.read_text().splitlines() if path.exists() else []):
        run = json.loads(line)
        latest[(run["arm"], run["set"], run["size"], run["steps"], run["seed"])] = run
    return list(latest.values())


def mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", default=",".join(shift_sources.SETS))
    parser.add_argument("--arms", default="defaults,peer")
    parser.add_argument("--sizes", default="56")
    parser.add_argument("--steps", default="60,200,600")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--rerun", action="store_true", help="measure cells already recorded again")
    parser.add_argument("--table", action="store_true")
    parser.add_argument("--results", type=Path, default=ROOT / "results.jsonl",
                        help="the file cells are appended to and read back from (done cells, --table)")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="a recipe override added to every toolkit arm (not the peer); repeatable")
    parser.add_argument("--shard", default="0/1", metavar="K/N",
                        help="run only the cells at positions K, K+N, K+2N, ... of the whole cell list")
    parser.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                        help="start no new cell after this many seconds from the start")
    parser.add_argument("--keep-going", action="store_true", help="report a failed cell and go on to the next")
    args = parser.parse_args()
    started = time.perf_counter()
    if args.table:
        from shift_table import print_tables

        print_tables(read_results(args.results))
        return
    shard, shards = (int(part) for part in args.shard.split("/"))
    if not 0 <= shard < shards:
        raise SystemExit(f"--shard {args.shard}: K must be in 0..N-1")
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ROOT.mkdir(parents=True, exist_ok=True)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    base = reference_base(REPO / "outputs" / "transfer")
    done = {(r["arm"], r["set"], r["size"], r["steps"], r["seed"]) for r in read_results(args.results)}
    every = cells(args.arms.split(","), args.sets.split(","), [int(s) for s in args.sizes.split(",")],
                  [int(s) for s in args.steps.split(",")], [int(s) for s in args.seeds.split(",")])
    todo = [c for c in every[shard::shards] if args.rerun or c.key() not in done]
    for arm in {c.arm for c in every} - set(ARMS) - {PEER}:
        raise SystemExit(f"unknown arm {arm!r}: one of {', '.join([*ARMS, PEER])}")
    print(f"{len(todo)} cells to run", flush=True)
    failed = []
    for number, cell in enumerate(todo, 1):
        if args.deadline is not None and time.perf_counter() - started >= args.deadline:
            print(f"deadline of {args.deadline:g} s reached: {len(todo) - number + 1} cells left", flush=True)
            break
        try:
            result = run_cell(cell, base, args.results, tuple(args.override))
        except (Exception, SystemExit) as error:
            if not args.keep_going:
                raise
            failed.append(cell.name())
            print(f"[{number}/{len(todo)}] {cell.name()} failed: {error!r}", flush=True)
            continue
        print(f"[{number}/{len(todo)}] {cell.name()}: test {result['test_accuracy']:.3f}, shifted "
              f"{result['shifted_accuracy']:.3f} ({result['cpu_seconds']:.0f} s CPU)", flush=True)
    if failed:
        raise SystemExit(f"{len(failed)} cells failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
