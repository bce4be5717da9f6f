"""The measured window: a clock around the training loop's own `next()` calls, and the figures it yields."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterable, Iterator

import torch

from vit_finetune.bench.device import PeakMemory, synchronize
from vit_finetune.bench.flops import ModelSpec


class StepClock:
    """The measured window: opened after the warm-up, closed after the last step, the device synchronised only then.

    Data wait is the time the training loop spends in `next()` on its batches inside the window (for our loader
    and the Trainer's, accelerate copies the batch to the device in there). On CUDA the host may run ahead of the
    GPU, so a wait can overlap GPU work: the share then bounds from above the time the GPU starves for data.
    """

    def __init__(self, device: torch.device, warmup: int, steps: int, profile_to: Path | None = None):
        self.device, self.warmup, self.steps = device, warmup, steps
        self.started = self.finished = None
        self.wait = 0.0
        self.images = 0
        self.profile_to = profile_to
        self.profiler = None

    @property
    def running(self) -> bool:
        return self.started is not None and self.finished is None

    def open(self) -> None:
        synchronize(self.device)
        if self.profile_to is not None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.start()
        self.started = time.perf_counter()

    def close(self) -> None:
        if not self.running:
            raise RuntimeError("the measured window never opened: fewer batches than warm-up + steps")
        synchronize(self.device)
        self.finished = time.perf_counter()
        if self.profiler is not None:
            self.profiler.stop()
            sort = "device_time_total" if self.device.type == "cuda" else "cpu_time_total"
            self.profile_to.parent.mkdir(parents=True, exist_ok=True)
            self.profile_to.write_text(self.profiler.key_averages().table(sort_by=sort, row_limit=40))

    def fetch(self, iterator: Iterator, index: int) -> dict:
        """next(iterator) for batch `index` (0-based), timed and counted once the window is open."""
        if index == self.warmup:
            self.open()
        start = time.perf_counter()
        batch = next(iterator)
        if self.running:
            self.wait += time.perf_counter() - start
            self.images += batch["labels"].shape[0]  # a shape: no device sync
        return batch

    def drain(self, batches: Iterable) -> None:
        """Time a loader alone: fetch warm-up + measured batches and drop them, then close the window."""
        iterator = iter(batches)
        for index in range(self.warmup + self.steps):
            self.fetch(iterator, index)
        self.close()

    @property
    def seconds(self) -> float:
        return self.finished - self.started


class TimedBatches:
    """Stands in for the prepared loader so our unchanged training loop is timed: the clock sees every `next()`.

    Batches come from `source` (the loader itself, or batches already on the device); anything else the loop
    asks of its loader (set_epoch, ...) goes to the real `loader`.
    """

    def __init__(self, source: Iterable, clock: StepClock, loader):
        self.source, self.clock, self.loader = source, clock, loader

    def __getattr__(self, name: str):
        return getattr(self.loader, name)

    def __iter__(self):
        iterator = iter(self.source)
        for index in range(self.clock.warmup + self.clock.steps):  # = recipe.train.max_steps: the loop stops there
            yield self.clock.fetch(iterator, index)


def device_batches(spec: ModelSpec, batch_size: int, device: torch.device) -> Iterator[dict]:
    """Endless uint8 batches already on the device, laid out as our prepared loader delivers them."""
    generator = torch.Generator(device=device).manual_seed(0)
    shape = (batch_size, 3, spec.image_size, spec.image_size)
    batches = [{
        "pixel_values": torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=generator),
        "labels": torch.randint(0, spec.num_labels, (batch_size,), device=device, generator=generator),
        "skipped": [],  # the names of bad images skipped (none here)
    } for _ in range(2)]
    while True:
        yield from batches


def measured(clock: StepClock, flops: float | None, peak: dict, memory: PeakMemory, settings: dict) -> dict:
    """The figures of one configuration; `flops` None for a loader timed alone (no model runs, no MFU)."""
    images_per_s = clock.images / clock.seconds
    return {
        "images_per_s": images_per_s,
        "mfu": None if flops is None else flops * images_per_s / (peak["tflops"] * 1e12),
        "flops_per_image": flops,
        "peak_memory_gib": memory.read_gib(),
        "data_wait_share": clock.wait / clock.seconds,
        "step_time_ms": 1000 * clock.seconds / clock.steps,
        "measured_steps": clock.steps,
        "measured_images": clock.images,
        "seconds": clock.seconds,
        "settings": settings,
    }
