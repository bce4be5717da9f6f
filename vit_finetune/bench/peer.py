"""The peer: transformers.Trainer set up as its image-classification example (run_image_classification.py) does it.

Per-sample transforms set with `set_transform`, float32 collation, bf16=True, SDPA attention, and the same
workers, batch and model as ours: a fair, tuned peer.
"""

from __future__ import annotations

import math
from typing import Iterator

import numpy as np
import torch
from PIL import Image

from vit_finetune.bench.device import PeakMemory
from vit_finetune.bench.flops import training_flops_per_image
from vit_finetune.bench.timing import StepClock, measured
from vit_finetune.bench.workload import Setup


class ExampleTrainTransform:
    """Compose([RandomResizedCrop(size), RandomHorizontalFlip(), ToTensor(), Normalize(mean, std)]) of the example.

    torchvision's own classes when it is installed; otherwise the same steps with PIL and torch, following
    torchvision's code: same defaults (scale 0.08-1, ratio 3/4-4/3, bilinear), same torch RNG, float32 output.
    """

    def __init__(self, size: int | tuple[int, int], mean: list[float], std: list[float]):
        self.size = (size, size) if isinstance(size, int) else tuple(size)
        self.mean = torch.as_tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.as_tensor(std, dtype=torch.float32).view(-1, 1, 1)
        try:
            from torchvision.transforms import Compose, Normalize, RandomHorizontalFlip, RandomResizedCrop, ToTensor

            normalize = Normalize(mean=mean, std=std)
            self.compose = Compose([RandomResizedCrop(size), RandomHorizontalFlip(), ToTensor(), normalize])
            self.source = "torchvision.transforms"
        except ImportError:
            self.compose = None
            self.source = "PIL + torch, torchvision's steps rewritten (torchvision is not installed)"

    def __call__(self, image: Image.Image) -> torch.Tensor:
        if self.compose is not None:
            return self.compose(image)
        top, left, height, width = self._crop_box(*image.size)
        image = image.crop((left, top, left + width, top + height)).resize(self.size[::-1], Image.BILINEAR)
        if torch.rand(1) < 0.5:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
        tensor = torch.from_numpy(np.array(image, np.uint8, copy=True)).permute(2, 0, 1).contiguous()
        tensor = tensor.to(torch.float32).div(255)
        return tensor.sub_(self.mean).div_(self.std)

    @staticmethod
    def _crop_box(width: int, height: int, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
        area = height * width
        log_ratio = torch.log(torch.tensor(ratio))
        for _ in range(10):
            target_area = area * torch.empty(1).uniform_(scale[0], scale[1]).item()
            aspect = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1])).item()
            w, h = int(round(math.sqrt(target_area * aspect))), int(round(math.sqrt(target_area / aspect)))
            if 0 < w <= width and 0 < h <= height:
                top = torch.randint(0, height - h + 1, size=(1,)).item()
                left = torch.randint(0, width - w + 1, size=(1,)).item()
                return top, left, h, w
        in_ratio = width / height
        if in_ratio < min(ratio):
            w, h = width, int(round(width / min(ratio)))
        elif in_ratio > max(ratio):
            w, h = int(round(height * max(ratio))), height
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w


class ExampleEvalTransform:
    """Compose([Resize(size), CenterCrop(size), ToTensor(), Normalize(mean, std)]) of the example's evaluation.

    torchvision's own classes when it is installed; otherwise the same steps with PIL and torch: an int size resizes
    the shorter side (bilinear, antialiased as PIL is) and crops the centre, a (height, width) resizes to it.
    """

    def __init__(self, size: int | tuple[int, int], mean: list[float], std: list[float]):
        self.size = size
        self.mean = torch.as_tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.as_tensor(std, dtype=torch.float32).view(-1, 1, 1)
        try:
            from torchvision.transforms import CenterCrop, Compose, Normalize, Resize, ToTensor

            self.compose = Compose([Resize(size), CenterCrop(size), ToTensor(), Normalize(mean=mean, std=std)])
        except ImportError:
            self.compose = None

    def __call__(self, image: Image.Image) -> torch.Tensor:
        if self.compose is not None:
            return self.compose(image)
        if isinstance(self.size, int):
            width, height = image.size
            scale = self.size / min(width, height)
            image = image.resize((max(self.size, round(width * scale)), max(self.size, round(height * scale))),
                                 Image.BILINEAR)
            crop_height = crop_width = self.size
        else:
            crop_height, crop_width = self.size
            image = image.resize((crop_width, crop_height), Image.BILINEAR)
        left, top = (image.width - crop_width) // 2, (image.height - crop_height) // 2
        image = image.crop((left, top, left + crop_width, top + crop_height))
        tensor = torch.from_numpy(np.array(image, np.uint8, copy=True)).permute(2, 0, 1).float().div(255)
        return (tensor - self.mean) / self.std


class ExampleBatchTransform:
    """The example's `train_transforms(example_batch)` (or `val_transforms`), a class so that spawned workers could
    pickle it."""

    def __init__(self, transform: ExampleTrainTransform | ExampleEvalTransform, image_column: str = "image"):
        self.transform, self.image_column = transform, image_column

    def __call__(self, example_batch: dict) -> dict:
        images = example_batch[self.image_column]
        example_batch["pixel_values"] = [self.transform(image.convert("RGB")) for image in images]
        return example_batch


def example_collate_fn(examples: list[dict]) -> dict[str, torch.Tensor]:
    pixel_values = torch.stack([example["pixel_values"] for example in examples])
    labels = torch.tensor([example["label"] for example in examples])
    return {"pixel_values": pixel_values, "labels": labels}


def build_trainer(setup: Setup, clock: StepClock):
    """The example's dataset, transforms, model and TrainingArguments in a Trainer whose `next()` calls are timed."""
    import datasets
    from transformers import (AutoImageProcessor, AutoModelForImageClassification, Trainer, TrainerCallback,
                              TrainingArguments)

    cuda = setup.device.type == "cuda"

    class TimedIterator:
        def __init__(self, iterator: Iterator, trainer: Trainer):
            self.iterator, self.trainer = iterator, trainer

        def __iter__(self):
            return self

        def __next__(self):
            return clock.fetch(self.iterator, self.trainer.state.global_step)

    class TimedTrainer(Trainer):
        def get_batch_samples(self, epoch_iterator, *args, **kwargs):  # the one place the Trainer calls next()
            return super().get_batch_samples(TimedIterator(epoch_iterator, self), *args, **kwargs)

    class CloseWindow(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == setup.warmup + setup.steps:
                clock.close()

    train_set = datasets.load_dataset("imagefolder", data_dir=str(setup.jpegs))["train"]
    if len(train_set) < (setup.warmup + setup.steps) * setup.batch_size:
        raise RuntimeError(f"{setup.jpegs} holds {len(train_set)} training images, fewer than one epoch of "
                           f"{setup.warmup + setup.steps} steps needs; pass a larger --images")
    image_processor = AutoImageProcessor.from_pretrained(setup.base)
    if "shortest_edge" in image_processor.size:
        size = image_processor.size["shortest_edge"]
    else:
        size = (image_processor.size["height"], image_processor.size["width"])
    transform = ExampleTrainTransform(size, image_processor.image_mean, image_processor.image_std)
    train_set.set_transform(ExampleBatchTransform(transform))
    model = AutoModelForImageClassification.from_pretrained(setup.base, attn_implementation="sdpa")
    args = TrainingArguments(
        output_dir=str(setup.work_dir / "peer"),
        per_device_train_batch_size=setup.batch_size,
        max_steps=setup.warmup + setup.steps,
        learning_rate=2e-5,  # the example's README value; speed does not depend on it
        bf16=setup.precision == "bf16",
        dataloader_num_workers=setup.workers,
        dataloader_pin_memory=cuda,  # the Trainer's default on CUDA; it only warns on CPU
        remove_unused_columns=False,  # the example's README requires it: the transform reads the image column
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        disable_tqdm=True,
        use_cpu=not cuda,
        seed=0,
    )
    trainer = TimedTrainer(model=model, args=args, train_dataset=train_set, processing_class=image_processor,
                           data_collator=example_collate_fn, callbacks=[CloseWindow()])
    return trainer, transform


def peer_settings(trainer, transform: ExampleTrainTransform) -> dict:
    args = trainer.args
    return {
        "precision": "bf16" if args.bf16 else "no",
        "torch_compile": args.torch_compile,
        "attention": trainer.model.config._attn_implementation,
        "optimizer": str(args.optim.value if hasattr(args.optim, "value") else args.optim),
        **peer_loader_settings(trainer, transform),
    }


def peer_loader_settings(trainer, transform: ExampleTrainTransform) -> dict:
    args = trainer.args
    return {
        "num_workers": args.dataloader_num_workers,
        "pin_memory": args.dataloader_pin_memory,
        "persistent_workers": args.dataloader_persistent_workers,
        "prefetch_factor": args.dataloader_prefetch_factor,
        "transforms": transform.source,
        "batch_dtype": "float32, normalised per sample in the workers",
    }


def run_peer(setup: Setup, peak: dict, memory: PeakMemory) -> dict:
    """peer: trainer.train(), timed by a Trainer subclass and a callback."""
    clock = setup.clock("peer")
    memory.reset()
    trainer, transform = build_trainer(setup, clock)
    trainer.train()
    flops = training_flops_per_image(trainer.model.config)
    return measured(clock, flops, peak, memory, peer_settings(trainer, transform))


def run_peer_loader(setup: Setup, peak: dict, memory: PeakMemory) -> dict:
    """data_peer: the Trainer's training loader alone (the example's per-sample transforms, float32 collation,
    the copy to the device), no model step."""
    clock = setup.clock("data_peer")
    trainer, transform = build_trainer(setup, clock)
    memory.reset()
    clock.drain(trainer.get_train_dataloader())
    return measured(clock, None, peak, memory, peer_loader_settings(trainer, transform))
