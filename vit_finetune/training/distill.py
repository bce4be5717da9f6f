"""Knowledge distillation (train.distill): a frozen teacher's predictions on the very batches the student trains on,
and the loss that follows them (DeiT, arXiv 2012.12877).

The teacher is any image classifier with the dataset's labels: a run of this toolkit, a folder saved with
save_pretrained, a Hub model. It is loaded without its own Python code, frozen, in eval mode, and runs without
gradients at its own resolution and normalisation: the student's batch, after Mixup/CutMix (both see the same
mixed images), is resampled to the teacher's size and normalised with the teacher's mean and std. It is never
saved in a checkpoint: a resume loads it again from train.distill.teacher, which the recipe's identity covers, and
checks that its weights are those the checkpoint was trained with (their digest is recorded in each checkpoint).

With train.distill.cache_logits, training pixels that never change (no random transform at all) are labelled once
before training instead (label_training_images); each batch then looks its rows up by a digest of each image's pixels.

A DeiT student keeps its distillation token: its distillation head follows the teacher, its class head the
labels, and the saved model is DeiTForImageClassificationWithTeacher, whose logits average both heads.

What a distilled run says of its teacher (which one, how it taught, what its forwards cost) and of its student (its
depth, and where it came from: cut from the teacher's own blocks, fine-tuned from a base, or random weights) is built
here, once (report), and shown by the console, metrics.json (`distillation`) and the model card.
"""

from __future__ import annotations

import hashlib
import time
from typing import Callable

import torch
import torch.nn.functional as F

from vit_finetune import data, tasks
from vit_finetune.core import progress
from vit_finetune.core.errors import EXIT_USAGE, VitFinetuneError, problems_of, shortened
from vit_finetune.data import SKIPPED_LABEL
from vit_finetune.model.saved_model import InputError, load_classifier, model_location, refuse_own_code
from vit_finetune.recipe import DistillSettings, Recipe


class DistillError(VitFinetuneError):
    """A teacher that cannot teach this run; the message names it and the fix."""

    exit_code = EXIT_USAGE


def teacher_location(settings: DistillSettings) -> str:
    """The teacher's folder or Hub id, found the way `predict` finds a model; a clear error otherwise."""
    try:
        return model_location(settings.teacher)
    except InputError as error:
        raise DistillError(f"train.distill.teacher={settings.teacher!r}: {error}") from None


def preflight(settings: DistillSettings | None) -> list[VitFinetuneError]:
    """The teacher's problems, from its config alone: one that is not there, not a classifier, or multi-label."""
    return [] if settings is None else problems_of(lambda: teacher_config(settings))


def teacher_config(settings: DistillSettings):
    """The teacher's config.json alone (no weights), read without running any code of its own."""
    from transformers import AutoConfig

    location = teacher_location(settings)
    try:
        refuse_own_code(f"train.distill.teacher={settings.teacher!r}", location)
    except InputError as error:
        raise DistillError(str(error)) from None
    try:
        config = AutoConfig.from_pretrained(location, trust_remote_code=False)
    except (OSError, ValueError) as error:
        raise DistillError(f"train.distill.teacher={settings.teacher!r} could not be read as a model config "
                           f"({shortened(error)}); give a run's output_dir or an image classifier's Hub id") from None
    task = tasks.of_config(config)
    if not task.distills:
        raise DistillError(f"train.distill.teacher={settings.teacher!r} is a {task.name.replace('_', '-')} model; "
                           "distillation follows a single-label teacher's top class or softmax. Give a single-label "
                           "teacher")
    return config


def teacher_labels(config) -> list[str]:
    id2label = {int(index): name for index, name in (config.id2label or {}).items()}
    return [id2label[index] for index in sorted(id2label)]


def refuse_other_labels(settings: DistillSettings, config, labels: list[str]) -> None:
    """The teacher's classes must be the dataset's, in the same order: its logit i must mean the student's class i."""
    theirs = teacher_labels(config)
    if theirs == list(labels):
        return
    order = " (the same names in another order)" if sorted(theirs) == sorted(labels) else ""
    raise DistillError(
        f"train.distill.teacher={settings.teacher!r} predicts the labels {_shown(theirs)}, but the dataset's are "
        f"{_shown(labels)}{order}; a teacher's logit i must mean the dataset's class i. Fix: give a teacher trained "
        "on this dataset's classes (e.g. a run of this toolkit on the same data), or set train.distill=null")


def _shown(labels: list[str], most: int = 12) -> str:
    return repr(labels) if len(labels) <= most else f"{labels[:most]!r}... ({len(labels)} in all)"


def input_size(processor, config) -> tuple[int, int]:
    """The (height, width) the teacher's own image processor feeds it: its crop if it crops, else its size."""
    size = getattr(processor, "crop_size", None) if getattr(processor, "do_center_crop", False) else None
    size = size or getattr(processor, "size", None) or {}
    if "height" in size and "width" in size:
        return int(size["height"]), int(size["width"])
    if "shortest_edge" in size:
        return int(size["shortest_edge"]), int(size["shortest_edge"])
    side = getattr(config, "image_size", None)
    if isinstance(side, int):
        return side, side
    raise DistillError(f"train.distill.teacher: its image processor names no size ({size}); save the teacher with "
                       "an image processor that has size (or crop_size)")


def weights_digest(model: torch.nn.Module) -> str:
    """A hash of every weight's name, shape, type and bytes: checkpoints record it, so a resume whose teacher was
    retrained or replaced under the same folder or Hub id is refused rather than silently followed."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        values = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{tuple(values.shape)}:{values.dtype}".encode())
        digest.update(values.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class Teacher:
    """A frozen classifier that labels the student's batches, at its own resolution and normalisation."""

    def __init__(self, model: torch.nn.Module, processor, student_scale: float, device: torch.device):
        self.digest = weights_digest(model)  # before it moves: the bytes as loaded
        self.model = model.to(device).eval().requires_grad_(False)
        self.device = device
        self.size = input_size(processor, model.config)
        # The student's pixels arrive rescaled by the student's factor (uint8 x 1/255, usually): back to 0-255,
        # then the teacher's own rescale and mean/std.
        scale = float(getattr(processor, "rescale_factor", 1 / 255)) if getattr(processor, "do_rescale", True) else 1.0
        normalises = getattr(processor, "do_normalize", True)
        mean = (getattr(processor, "image_mean", None) or [0.5] * 3) if normalises else [0.0] * 3
        std = (getattr(processor, "image_std", None) or [0.5] * 3) if normalises else [1.0] * 3
        self.scale = scale / student_scale
        self.seconds = 0.0  # wall time of this process's teacher forwards (report says what it cost)
        self.mean = torch.tensor(mean, dtype=torch.float32, device=device).view(1, -1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32, device=device).view(1, -1, 1, 1)

    def pixels(self, rescaled: torch.Tensor) -> torch.Tensor:
        """The student's rescaled batch (before its mean/std) as the teacher's processor would have made it."""
        pixels = rescaled.float()
        if tuple(pixels.shape[-2:]) != self.size:  # antialiased, so shrinking a batch does not alias
            pixels = F.interpolate(pixels, size=self.size, mode="bilinear", align_corners=False, antialias=True)
        return (pixels * self.scale - self.mean) / self.std

    @torch.no_grad()
    def logits(self, rescaled: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        logits = self.model(pixel_values=self.pixels(rescaled)).logits.float()
        if logits.device.type == "cuda":  # the host runs ahead of the GPU: without a wait only the launch is timed
            torch.cuda.synchronize(logits.device)
        self.seconds += time.perf_counter() - started
        return logits


def load_teacher(settings: DistillSettings, labels: list[str], student_scale: float, device: torch.device) -> Teacher:
    """Check the teacher's labels from its config, then load its weights (each process its own copy)."""
    config = teacher_config(settings)
    refuse_other_labels(settings, config, labels)
    try:
        model, processor = load_classifier(teacher_location(settings))
    except InputError as error:
        raise DistillError(f"train.distill.teacher: {error}") from None
    return Teacher(model, processor, student_scale, device)


def pixel_digest(pixels: torch.Tensor) -> str:
    """A training image's key in the teacher's cache: a hash of its pixel tensor's shape, type and bytes."""
    values = pixels.detach().cpu().contiguous()
    digest = hashlib.blake2b(f"{tuple(values.shape)}:{values.dtype}".encode(), digest_size=16)
    digest.update(values.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def collate_with_digests(samples: list) -> dict:
    """data.collate's batch plus each image's pixel digest, the key of its cached teacher row: computed on the host,
    in the loader's workers, before the batch moves to the device."""
    batch = data.collate(samples)
    batch["pixel_digests"] = [pixel_digest(pixels) for pixels, *_ in samples]
    return batch


class TeacherLogitsCache:
    """The teacher's logits of every training image, by the digest of the image's pixels (train.distill.cache_logits):
    one float32 row per distinct image, in host memory."""

    def __init__(self, digests: list[str], logits: torch.Tensor, seconds: float = 0.0):
        self.seconds = seconds  # the pre-pass's wall time: decoding and the teacher's forwards
        # Images with the same pixels (a duplicate, the blank of every skipped bad image) share one digest: the
        # teacher gave them the same logits, so either row serves.
        self.row_of = {digest: row for row, digest in enumerate(digests)}
        self.logits = logits

    def rows(self, digests: list[str], device: torch.device) -> torch.Tensor:
        """The teacher's logits of a training batch, from its images' digests; an image never labelled stops the run."""
        missing = sum(digest not in self.row_of for digest in digests)
        if missing:
            raise DistillError(
                f"train.distill.cache_logits: {missing} image(s) of a training batch have pixels the teacher never "
                f"labelled before training ({len(self.row_of):,} distinct images were): the training pixels changed "
                "between epochs, which cache_logits cannot follow. Set train.distill.cache_logits=false")
        index = torch.tensor([self.row_of[digest] for digest in digests], dtype=torch.long)
        return self.logits[index].to(device)


def label_training_images(teacher: Teacher, images: data.ImageClassificationDataset, batch_size: int,
                          rescale: Callable[[torch.Tensor], torch.Tensor], workers: int) -> TeacherLogitsCache:
    """train.distill.cache_logits' pre-pass: the teacher (eval mode, no gradients) labels every training image once, in
    the split's order, `batch_size` at a time. It runs the same way every time, so a resumed run gets the very logits
    the uninterrupted one had. Each process labels the whole split: its share of the images changes every epoch."""
    loader = data.make_loader(images, batch_size, shuffle=False, seed=0, num_workers=workers, pin_memory=False,
                              collate_fn=collate_with_digests)
    digests, rows = [], []
    started = time.perf_counter()
    with torch.random.fork_rng(devices=[]):  # the run's random state stays as it was, whatever a teacher draws
        for batch in loader:
            rows.append(teacher.logits(rescale(batch["pixel_values"].to(teacher.device))).cpu())
            digests += batch["pixel_digests"]
    return TeacherLogitsCache(digests, torch.cat(rows), time.perf_counter() - started)


def student_heads(output) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits that learn the labels, logits that learn the teacher): a DeiT student's class and distillation heads,
    any other student's one head twice."""
    if getattr(output, "distillation_logits", None) is not None:
        return output.cls_logits, output.distillation_logits
    return output.logits, output.logits


def soft_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """Per image: KL(teacher/T || student/T) x T^2 (Hinton; the T^2 keeps its gradient's size as T changes)."""
    log_student = F.log_softmax(student.float() / temperature, dim=-1)
    log_teacher = F.log_softmax(teacher / temperature, dim=-1)
    return F.kl_div(log_student, log_teacher, reduction="none", log_target=True).sum(-1) * temperature ** 2


def hard_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """Per image: cross-entropy on the teacher's top class (DeiT's hard distillation; no temperature)."""
    return F.cross_entropy(student.float(), teacher.argmax(-1), reduction="none")


MODES: dict[str, Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]] = {"soft": soft_loss, "hard": hard_loss}


def teacher_loss(student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor,
                 settings: DistillSettings) -> torch.Tensor:
    """The mean distillation loss over the batch's real images (a bad image's place, skipped, is left out)."""
    per_image = MODES[settings.mode](student, teacher, settings.temperature)
    real = (labels != SKIPPED_LABEL).float()
    count = real.sum()
    return (per_image * real).sum() / torch.where(count > 0, count, torch.ones_like(count))


def blend(label_loss: torch.Tensor, distillation_loss: torch.Tensor, settings: DistillSettings) -> torch.Tensor:
    return (1 - settings.weight) * label_loss + settings.weight * distillation_loss


# ---------------------------------------------------------------- what a distilled run says of its teacher


def report(settings: DistillSettings, teacher: Teacher, cache: TeacherLogitsCache | None,
           training_seconds: float, student_facts: dict) -> dict:
    """metrics.json's `distillation`: the teacher, how it taught, the student (student.facts: its depth and where it
    came from), and what the teacher cost this process. The teacher's forwards during training are timed one by one
    (with cache_logits there are none: its pre-pass labelled every training image once, before training, and is
    timed apart)."""
    during_training = 0.0 if cache is not None else teacher.seconds
    facts = {"teacher": settings.teacher, "mode": settings.mode, "weight": settings.weight,
             "temperature": settings.temperature, "cache_logits": settings.cache_logits, "student": student_facts,
             "training_seconds": round(training_seconds, 1),
             "teacher_seconds": round(during_training, 3),  # of training_seconds: the teacher's forwards
             "teacher_share": round(during_training / training_seconds, 3) if training_seconds > 0 else None}
    if cache is not None:
        facts["labelling_seconds"] = round(cache.seconds, 3)  # the pre-pass, before training_seconds started
    return facts


def caches_teacher_logits(recipe: Recipe) -> bool:
    """train.distill.cache_logits: the teacher labels every training image once, before training."""
    return recipe.train.distill is not None and recipe.train.distill.cache_logits


def cache_teacher_logits(teacher: Teacher, loader, batch_size: int, rescale: Callable, say: bool) -> TeacherLogitsCache:
    """train.distill.cache_logits: the teacher labels the training images of `loader` once, here, not on every batch
    (every process, each the whole split: label_training_images), and the time it took is said where `say`."""
    started = time.perf_counter()
    images = loader.dataset
    cache = label_training_images(teacher, images, batch_size, rescale, loader.num_workers)
    if say:
        progress.say(f"train.distill.cache_logits: the teacher labelled the {len(images):,} training images once, in "
                     f"{time.perf_counter() - started:.1f} s")
    return cache
