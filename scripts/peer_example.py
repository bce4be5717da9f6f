"""The peer: transformers' image-classification example recipe (run_image_classification.py) on a saved dataset.

    python scripts/peer_example.py --dataset DATA --model BASE --image_size 56 --max_steps 60 --output_dir OUT
    python scripts/peer_example.py ... --eval_strategy epoch   # the example's documented command: evaluate, save
                                                               # and keep the best model every epoch

What the example does, on a folder written by datasets' save_to_disk (splits train and validation, columns image and
label): a new head (`ignore_mismatched_sizes=True`); the Trainer's AdamW with a linear schedule and no warm-up, one lr
for every weight (2e-5, the example README's value); training transform RandomResizedCrop(size) over 8-100 % of the
area, aspect 3/4-4/3, then a horizontal flip; evaluation Resize(size) then CenterCrop(size); at the end it saves the
model and evaluates. With `--eval_strategy epoch` (as its README's command) it also evaluates and saves a checkpoint
after every epoch, keeps the 3 newest and loads the best (by eval loss) at the end.

torchvision cannot be imported on these CPU machines, so the transforms are torchvision's steps written with PIL and
torch (vit_finetune.bench.peer). Accuracy is computed here: the example's evaluate.load("accuracy") needs the Hub.
The last line printed is a JSON object with the eval accuracy.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LEARNING_RATE = 2e-5  # the example README's documented value


def peer_model(base: Path, labels: list[str]):
    """The peer's model, loaded as the example loads it: a new head for these labels. transformers reports that head
    as an incompatible num_labels and a MISSING (or MISMATCH) load report, which read like errors; it is the head swap
    the example intends, so one line says it instead."""
    from transformers import AutoModelForImageClassification
    from transformers.utils import logging as transformers_logging

    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        model = AutoModelForImageClassification.from_pretrained(
            base, num_labels=len(labels), id2label=dict(enumerate(labels)),
            label2id={n: i for i, n in enumerate(labels)}, ignore_mismatched_sizes=True)
    finally:
        transformers_logging.set_verbosity(verbosity)
    print(f"peer: a new head for {len(labels)} labels on {Path(base).name}, as the example makes it (transformers' load "
          "report of the replaced head is not shown)")
    return model


def train_peer(dataset: Path, model: Path, image_size: int, max_steps: int, batch_size: int, learning_rate: float,
               seed: int, output_dir: Path, eval_every_epoch: bool = False,
               score_splits: tuple[str, ...] | None = None) -> float | dict[str, float]:
    """The example's run on `dataset`; returns the final eval accuracy, or with `score_splits` the accuracy on each
    of those splits of `dataset` (the example's evaluation transform on each)."""
    import datasets
    from transformers import AutoImageProcessor, Trainer, TrainingArguments

    from vit_finetune.bench.peer import (
        ExampleBatchTransform, ExampleEvalTransform, ExampleTrainTransform, example_collate_fn
    )

    splits = datasets.load_from_disk(str(dataset))
    labels = splits["train"].features["label"].names
    processor = AutoImageProcessor.from_pretrained(model)
    train_transform = ExampleTrainTransform(image_size, processor.image_mean, processor.image_std)
    train_set, eval_set = splits["train"], splits["validation"]
    train_set.set_transform(ExampleBatchTransform(train_transform))
    eval_batch = ExampleBatchTransform(ExampleEvalTransform(image_size, processor.image_mean, processor.image_std))
    eval_set.set_transform(eval_batch)
    network = peer_model(model, labels)
    per_epoch = "epoch" if eval_every_epoch else "no"
    args = TrainingArguments(
        output_dir=str(output_dir), per_device_train_batch_size=batch_size, per_device_eval_batch_size=batch_size,
        max_steps=max_steps, learning_rate=learning_rate, lr_scheduler_type="linear", warmup_steps=0, seed=seed,
        dataloader_num_workers=0, remove_unused_columns=False, report_to="none", eval_strategy=per_epoch,
        save_strategy=per_epoch, load_best_model_at_end=eval_every_epoch, save_total_limit=3 if eval_every_epoch else None,
        disable_tqdm=True, use_cpu=True, logging_steps=max_steps)

    def accuracy(prediction) -> dict:
        return {"accuracy": float(np.mean(np.argmax(prediction.predictions, axis=-1) == prediction.label_ids))}

    trainer = Trainer(model=network, args=args, train_dataset=train_set, eval_dataset=eval_set,
                      data_collator=example_collate_fn, compute_metrics=accuracy)
    trainer.train()
    trainer.save_model()
    if score_splits is None:
        return trainer.evaluate()["eval_accuracy"]
    scores = {}
    for name in score_splits:
        part = splits[name]
        part.set_transform(eval_batch)
        scores[name] = trainer.evaluate(eval_dataset=part)["eval_accuracy"]
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", type=Path, required=True, help="a save_to_disk folder: train and validation")
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--image_size", type=int, required=True)
    parser.add_argument("--max_steps", type=int, required=True)
    parser.add_argument("--per_device_train_batch_size", type=int, default=16)
    parser.add_argument("--learning_rate", type=float, default=LEARNING_RATE)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval_strategy", choices=["no", "epoch"], default="no")
    parser.add_argument("--output_dir", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the study's cells run on one)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    accuracy = train_peer(args.dataset, args.model, args.image_size, args.max_steps, args.per_device_train_batch_size,
                          args.learning_rate, args.seed, args.output_dir, args.eval_strategy == "epoch")
    print(json.dumps({"accuracy": accuracy}))


if __name__ == "__main__":
    main()
