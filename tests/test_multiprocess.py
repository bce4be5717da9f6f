"""Many processes: a 2-process CPU run (gloo), launched the way the README tells CPU users
(`torchrun --nproc_per_node 2 -m vit_finetune ...`), agrees on everything and writes each file once.

The package is observed from outside (tests/recorder.py, loaded through sitecustomize with the user's
command line unchanged): each rank dumps its own final weights and logs every file it writes.

The run trains with data.skip_bad_images=true on a folder where rank 0's first batch holds only bad files:
the skip count must be summed over the ranks, and a rank with nothing to train on must still take the step.
One validation image is bad too: the ranks' eval batches must still gather, and the metrics leave it out.
It keeps an EMA of the weights and the best evaluation's weights (train.ema_decay, train.keep_best): the ranks
must agree on them too, and only the main process writes them.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import recorder
from runs import FLOAT32, assert_bit_identical, torchrun_command
from vit_finetune.core.processes import reset_accelerate_state
from tiny import REPO, make_tiny_vit, write_colour_folder

pytestmark = pytest.mark.slow

# 24 training images = 2 processes x batch 4 x 3 steps; 9 validation images: not a multiple of 2 x 4, so
# Accelerate pads the last eval batch with duplicates that must not be counted. 24 is a multiple of 2 x 4, so no
# training sample is drawn twice in an epoch: each bad file is met exactly once per epoch.
TRAIN_IMAGES, EVAL_IMAGES, BATCH, SEED, EPOCHS = 24, 9, 4, 1, 2
BAD_IMAGES = BATCH  # all of rank 0's first batch
BAD_EVAL_IMAGES = 1
TEST_IMAGES = 9  # data.test_split's: padded by Accelerate like the eval split


def spoil_first_batch_of_rank_0(images: Path) -> None:
    """Overwrite, in place (the dataset's order stays), the files that make up rank 0's first batch of epoch 0."""
    from vit_finetune import data
    from vit_finetune.recipe import DataSettings

    train = data.load_splits(DataSettings(dataset=str(images)), SEED).train
    order = [index for index, _epoch in data.EpochSampler(len(train), SEED, shuffle=True)]
    # Accelerate deals the sampler's batches out in turn: batch 0 to rank 0, batch 1 to rank 1, batch 2 to rank 0...
    files = [Path(train[index]["image"]["path"]) for index in order[:BATCH]]
    for path, content in zip(files, (b"", b"not an image", b"\x89PNG\r\n\x1a\n truncated", b"")):
        path.write_bytes(content)


def spoil_one_eval_image(images: Path) -> None:
    """One bad image in rank 0's first eval batch: left out, the ranks' batches would differ in size."""
    next((images / "validation").rglob("*.png")).write_bytes(b"")


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("ddp")
    base = make_tiny_vit(root / "tiny-vit")
    images = write_colour_folder(root / "colours", classes=3, train=8, validation=3, test=TEST_IMAGES // 3)
    spoil_first_batch_of_rank_0(images)
    spoil_one_eval_image(images)
    out, record = root / "out", root / "record"
    result = subprocess.run(
        [*torchrun_command(), "-m", "vit_finetune",
         f"model.base={base}", f"data.dataset={images}", f"output_dir={out}", "model.image_size=32",
         f"train.batch_size={BATCH}", f"train.epochs={EPOCHS}", "train.lr=0.005", f"train.seed={SEED}",
         "data.num_workers=0", "data.skip_bad_images=true", "train.checkpoint_every_steps=3",
         "train.ema_decay=0.5", "train.keep_best=eval_loss", "data.test_split=test",
         FLOAT32],  # the one-process check below evaluates in float32
        capture_output=True, text=True, timeout=300, env=recorder.subprocess_env(record), cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    return {"out": out, "record": record, "images": images, "stdout": result.stdout}


@pytest.mark.timeout(400)
def test_both_ranks_end_with_identical_weights_and_share_each_epoch(two_process_run):
    from safetensors.torch import load_file
    from transformers import ViTForImageClassification

    out, record = two_process_run["out"], two_process_run["record"]
    assert "on 2 process(es)" in two_process_run["stdout"]
    assert_bit_identical(record / "weights-0.safetensors", record / "weights-1.safetensors")
    saved = ViTForImageClassification.from_pretrained(out).state_dict()  # on disk under 4.x names: load to compare
    rank0 = load_file(str(record / "weights-0.safetensors"))
    assert saved.keys() == rank0.keys() and all(torch.equal(saved[k], rank0[k]) for k in saved)

    steps = recorder.read_samples(record)
    assert {entry["rank"] for entry in steps} == {0, 1} and len(steps) == 2 * 6
    good = TRAIN_IMAGES - BAD_IMAGES
    for epoch in (0, 1):
        seen = [s for entry in steps if entry["epoch"] == epoch for s in entry["samples"]]
        assert len(seen) == good and len(set(seen)) == good  # each good sample on one rank, once


@pytest.mark.timeout(400)
def test_skipped_images_are_counted_over_all_ranks_and_a_rank_with_only_bad_images_still_steps(two_process_run):
    out, record = two_process_run["out"], two_process_run["record"]
    steps = recorder.read_samples(record)
    first = {entry["rank"]: entry for entry in steps if entry["step"] == 1}
    assert first[0]["samples"] == [] and len(first[1]["samples"]) == BATCH  # the case under test did happen
    assert {entry["places"] for entry in steps} == {BATCH}  # the bad images kept their places in the batch
    # Every bad file is met once per epoch, on one rank or the other; the count is the run's total over ranks.
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["skipped_images"] == BAD_IMAGES * EPOCHS and metrics["steps"] == 6
    # Each checkpoint holds the total so far (a resumed run continues from it): epoch 0 ends at step 3.
    saved = {step: json.loads((out / "checkpoints" / f"step-{step:08d}" / "trainer_state.json").read_text())
             for step in (3, 6)}
    assert saved[3]["skipped_images"] == BAD_IMAGES and saved[6]["skipped_images"] == BAD_IMAGES * EPOCHS
    assert metrics["best_step"] in (3, 6) and metrics["weights"] in ("raw", "ema")  # kept, and said which
    history = json.loads((out / "history.json").read_text())
    assert all(math.isfinite(value) for entry in history for key, value in entry.items() if "loss" in key)
    # The console says so at the end of each epoch, counted over both ranks, naming the files.
    for epoch in range(EPOCHS):
        line = next(line for line in two_process_run["stdout"].splitlines() if line.startswith(f"epoch {epoch}: skip"))
        assert line.startswith(f"epoch {epoch}: skipped {BAD_IMAGES} bad image(s)") and str(two_process_run["images"]) in line


@pytest.mark.timeout(400)
def test_evaluation_counts_each_image_once_and_equals_a_one_process_evaluation(two_process_run):
    from accelerate import Accelerator
    from transformers import AutoImageProcessor, ViTForImageClassification

    from vit_finetune import data
    from vit_finetune.recipe import DataSettings
    from vit_finetune.tasks import single_label

    out = two_process_run["out"]
    metrics = json.loads((out / "metrics.json").read_text())
    good = EVAL_IMAGES - BAD_EVAL_IMAGES
    assert metrics["eval_samples"] == good and np.array(metrics["confusion_matrix"]).sum() == good
    assert metrics["eval_skipped_images"] == BAD_EVAL_IMAGES

    # The same weights and eval split, evaluated by one process.
    reset_accelerate_state()
    accelerator = Accelerator(cpu=True)
    settings = DataSettings(dataset=str(two_process_run["images"]), skip_bad_images=True)
    splits = data.load_splits(settings, seed=1)
    processor = AutoImageProcessor.from_pretrained(out)
    eval_set = data.eval_dataset(splits, settings, processor, image_size=32)
    model = ViTForImageClassification.from_pretrained(out)
    model, loader = accelerator.prepare(model, data.make_loader(eval_set, BATCH, False, 1, 0, False))
    single = single_label.evaluate_model(model, loader, accelerator, data.PixelNormalizer(processor, torch.device("cpu")),
                                       len(splits.labels))
    assert single["eval_samples"] == good and single["eval_skipped_images"] == BAD_EVAL_IMAGES
    assert single["confusion_matrix"] == metrics["confusion_matrix"] and single["accuracy"] == metrics["accuracy"]
    assert single["eval_loss"] == pytest.approx(metrics["eval_loss"], rel=1e-5)  # batches differ: float sums may


def test_the_test_split_is_counted_once_and_scores_what_one_process_evaluating_the_saved_model_scores(
        two_process_run):
    from vit_finetune.serving.evaluate_saved import evaluate_saved

    test = json.loads((two_process_run["out"] / "metrics.json").read_text())["test"]
    assert test["test_samples"] == TEST_IMAGES and np.array(test["confusion_matrix"]).sum() == TEST_IMAGES
    reset_accelerate_state()
    single = evaluate_saved(str(two_process_run["out"]), dataset=str(two_process_run["images"]), split="test")
    assert (single["confusion_matrix"], single["accuracy"]) == (test["confusion_matrix"], test["accuracy"])
    assert single["eval_loss"] == pytest.approx(test["test_loss"], rel=1e-5)


@pytest.mark.timeout(400)
def test_only_the_main_process_writes_outputs_and_no_file_is_written_twice(two_process_run):
    out, record = two_process_run["out"], two_process_run["record"]
    writers = recorder.writers_by_path(record, out)
    by_rank1 = sorted(Path(path).name for path, ranks in writers.items() if "1" in ranks)
    written = set(writers)
    # The recorder saw the native writers too: safetensors (model) and torch.save (optimizer).
    assert {"model.safetensors", "metrics.json", "README.md", "recipe.yaml"} <= written
    assert any(path.endswith("optimizer.bin") for path in written)
    assert by_rank1 and set(by_rank1) == {"random_states_1.pkl"}  # its own RNG state in each checkpoint, nothing else
    assert all(len(ranks) == 1 for ranks in writers.values()), {p: r for p, r in writers.items() if len(r) > 1}
