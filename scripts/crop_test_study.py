"""Would a crop test, the mirror test's rule with a random crop in place of the mirror, tell where crops help?

    python scripts/crop_test_study.py                     # every shift-study and transfer-study set at 56 px
    python scripts/crop_test_study.py --sets icons_oxygen,elpv_mono_to_poly,emoji --size 112

For each set the real toolkit is run on the study's reference base up to its checks before training
(training.probe_checks: the same sample of at most 256 training images, laid on the background auto chose), and
stopped there. The linear probe of those checks, fitted 5-fold, answers each held-out image whole and cut to one
random-resized crop (aspect 3/4 to 4/3, the toolkit's crop) of each area range, three crops per image each drawn from
a generator seeded by the draw and the image's place; `changed` is the share of answers a crop changes, averaged
over the three, `wrong_cropped` the share it answers wrongly cropped, `wrong` the share it answers wrongly whole.
The mirror test takes a flip where mirroring changes no more answers than the probe gets wrong; the same rule here
would take a crop range where `changed` <= `wrong`. Rows are appended to scripts/crop_test_results.jsonl.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import torch  # noqa: E402

from transfer_study import reference_base  # noqa: E402
from vit_finetune import data  # noqa: E402
from vit_finetune.training import build, plan, probe  # noqa: E402

RANGES = ((0.08, 1.0), (0.35, 1.0), (0.6, 1.0))
DRAWS = 3
SHIFT_SETS = ("icons_oxygen", "elpv_mono_to_poly", "emoji", "icons_elementary", "digits_to_mnist", "mnist_to_digits")
TRANSFER_SETS = ("fashion", "digits", "elpv", "faces")
RESULTS = REPO / "scripts" / "crop_test_results.jsonl"


class Checked(Exception):
    """Raised once the checks are read: the run goes no further."""


def cropped_features(checks, background: str | None, scale: tuple[float, float], draw: int) -> torch.Tensor:
    """The head's input for one crop of `scale` of each checked training image (the checks' preprocessing)."""
    settings = checks.settings.model_copy(update={"alpha_background": background})

    def pixels(image, index: int, epoch: int) -> torch.Tensor:
        box = data.random_resized_crop_box(image.width, image.height, random.Random(1000 * draw + index), scale)
        return checks.processor(images=image.crop(box), return_tensors="pt")["pixel_values"][0]

    dataset = data.ImageClassificationDataset(
        checks.train, checks.splits.image_column, checks.splits.label_column, settings, pixels,
        data.blank_pixels(checks.image_size, training=False), checks.splits.image_folders,
        encoding=data.target_encoding(checks.splits), outputs=len(checks.splits.labels))
    loader = data.make_loader(dataset, 4 * checks.batch_size, False, 0, 0, False)
    return probe.head_inputs(checks.model, loader, checks.accelerator, mixed_precision=False)[0]


def crop_test(checks, background: str | None) -> dict:
    features, labels = checks.features("train", background)
    strata = checks.task.probe_strata(labels)
    sizes = torch.bincount(strata)
    folds = min(probe.FOLDS, int(sizes[sizes > 0].min()))
    mean, std = features.mean(dim=0), features.std(dim=0).clamp(min=1e-6)
    weights, classes = torch.ones(len(labels)), len(checks.splits.labels)
    c, _, _ = probe.choose_c((features - mean) / std, labels, weights, classes, checks.task)
    fold = probe.fold_of_each_image(strata, folds)
    fits = [probe.fit_logistic((features[fold != k] - mean) / std, labels[fold != k], weights[fold != k], classes, c,
                               checks.task) for k in range(folds)]

    def answers(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(len(labels), dtype=torch.long)
        for k, (weight, bias) in enumerate(fits):
            held = fold == k
            out[held] = checks.task.probe_decisions(((x[held] - mean) / std) @ weight.T + bias).long()
        return out

    whole = answers(features)
    row = {"images": len(labels), "wrong": round(float((whole != labels).float().mean()), 4)}
    for scale in RANGES:
        crops = [answers(cropped_features(checks, background, scale, draw)) for draw in range(DRAWS)]
        row[f"{scale[0]:g}-{scale[1]:g}"] = {
            "changed": round(sum(float((a != whole).float().mean()) for a in crops) / DRAWS, 4),
            "wrong_cropped": round(sum(float((a != labels).float().mean()) for a in crops) / DRAWS, 4)}
    return row


def measure(dataset: Path, size: int, base: Path, out: Path) -> dict:
    found: dict = {}
    planned = plan.plan_from_features

    def reading_the_checks(recipe, checks, *args, **kwargs):
        recipe, facts = planned(recipe, checks, *args, **kwargs)
        found.update(crop_test(checks, recipe.data.alpha_background), background=recipe.data.alpha_background)
        raise Checked

    build.plan.plan_from_features = reading_the_checks
    from vit_finetune.cli import main

    try:
        main(["--quiet", f"model.base={base}", f"model.image_size={size}", f"data.dataset={dataset}",
              "data.eval_split=validation", "data.num_workers=0", "train.max_steps=10", "train.batch_size=16",
              f"output_dir={out}", "overwrite=true"])
    except Checked:
        pass
    finally:
        build.plan.plan_from_features = planned
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", default=",".join(SHIFT_SETS + TRANSFER_SETS))
    parser.add_argument("--size", type=int, default=56)
    args = parser.parse_args()
    base = reference_base(REPO / "outputs" / "transfer")
    for name in args.sets.split(","):
        folder = REPO / "outputs" / ("shift" if name in SHIFT_SETS else "transfer") / "data" / name
        row = {"set": name, "size": args.size,
               **measure(folder, args.size, base, REPO / "outputs" / "crop_test" / f"{name}-{args.size}px")}
        print(json.dumps(row), flush=True)
        with RESULTS.open("a") as handle:
            handle.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
