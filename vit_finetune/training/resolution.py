"""A resolution schedule (train.resolution_schedule): most optimiser steps at lower sizes, the last ones at
model.image_size (FixRes, progressive resizing), one lr schedule across them all.

The stages come from the recipe's [size, share] pairs and the run's steps (stages_of). When a stage starts, the model
moves to its size in place (loading.at_image_size: each position tensor resampled from the base's own, kept at load,
plus what the steps so far changed in it), the optimiser's moments of those tensors move with them, and the loaders
are built again for its size: training crops and evaluations during training at the stage's size. A stage that
starts mid-epoch restarts the epoch's reading the way a resume does (skip_first_batches), so a resume stays exact;
each checkpoint records its stage and size, and a resume moves the model to that size before the weights load.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable

from accelerate import Accelerator

from vit_finetune.core import progress
from vit_finetune.core.errors import RunError
from vit_finetune.model.loading import BaseTables, at_image_size

# (the base's own size, model.image_size) -> a schedule measured to keep the final size's accuracy at a lower cost, by
# scripts/resolution_study.py. Empty: every schedule that study measured lost accuracy to the whole run at the final size
# (docs/studies/resolution.md), so auto is off.
MEASURED_SCHEDULES: dict[tuple[int, int], list[list]] = {}


def counted(steps: int) -> str:
    return f"{steps} step" if steps == 1 else f"{steps} steps"


@dataclass(frozen=True)
class Stage:
    size: int  # px
    first_step: int  # optimiser steps done before it
    steps: int


def stages_of(schedule: list | None, total_steps: int) -> list[Stage]:
    """The stages of `total_steps` optimiser steps: each starts at its cumulative share of them, rounded half up;
    [] for no schedule (or no steps). A stage its share leaves without a step is refused."""
    if not schedule or not total_steps:
        return []
    starts, done = [], Fraction(0)
    for _size, share in schedule:
        starts.append(int(Fraction(total_steps) * done + Fraction(1, 2)))
        done += Fraction(share).limit_denominator(1_000_000)
    ends = starts[1:] + [total_steps]
    stages = [Stage(size, start, end - start) for (size, _share), start, end in zip(schedule, starts, ends)]
    empty = [stage.size for stage in stages if stage.steps <= 0]
    if empty:
        raise RunError(f"train.resolution_schedule leaves the stage(s) at {empty} px without an optimiser step of the "
                       f"run's {total_steps}; raise their shares, train longer, or set train.resolution_schedule=null")
    return stages


def stage_of_step(stages: list[Stage], steps_done: int) -> int:
    """The stage the next optimiser step (steps_done + 1) trains in; the last one once every step is done."""
    return next((i for i, stage in enumerate(stages) if steps_done < stage.first_step + stage.steps), len(stages) - 1)


def refusal(schedule: Any, processes: int, sharded: bool) -> str | None:
    """Why this run cannot follow a schedule it was given, if it cannot: its parameters change shape between stages,
    which the several processes' gradient buckets and the shards' flat parameters cannot follow."""
    if not isinstance(schedule, list):
        return None
    if sharded:
        return ("train.resolution_schedule changes the position tables' shapes between stages, which sharded weights "
                "(FSDP, DeepSpeed) cannot follow; set train.resolution_schedule=null, or train unsharded")
    if processes > 1:
        return (f"train.resolution_schedule changes the position tables' shapes between stages, which the gradient "
                f"buckets of {processes} processes cannot follow; set train.resolution_schedule=null, or launch one "
                "process")
    return None


def auto_schedule(base_size: int, final_size: int, processes: int, sharded: bool) -> tuple[list | None, str]:
    """train.resolution_schedule=auto: the measured schedule for this base's size and model.image_size, if any."""
    measured = MEASURED_SCHEDULES.get((base_size, final_size))
    if measured is None:
        why = ("every schedule measured lost accuracy to the whole run at the final size "
               "(docs/studies/resolution.md)" if not MEASURED_SCHEDULES else
               f"no schedule measured for a base of {base_size} px fine-tuned at {final_size} px")
        return None, why
    cannot = refusal(measured, processes, sharded)
    if cannot:
        return None, cannot.split(";")[0]
    return measured, f"measured for a base of {base_size} px fine-tuned at {final_size} px (scripts/resolution_study.py)"


class Schedule:
    """The run's stages and what moves at each: the model's position tensors, their optimiser moments, the loaders.
    Its record (each stage's size, steps, seconds, images/s) is run.state.resolution, saved in each checkpoint."""

    def __init__(self, stages: list[Stage], base: BaseTables, loaders_at: Callable[[int], tuple],
                 images_read: Callable[[int], int], final_size: int):
        self.stages, self.base, self.loaders_at, self.images_read = stages, base, loaders_at, images_read
        self.model_size = final_size  # what build_model built
        self.stage: int | None = None  # whose loaders are in use
        self.started = 0.0

    def size_of_checkpoint(self, model, saved_state: dict) -> None:
        """Before a checkpoint's weights load: the model at the size they were saved at (model.image_size for a
        checkpoint of a run without a schedule)."""
        size = (saved_state.get("resolution") or {}).get("image_size") or self.model_size
        self._move(model, None, size)

    def enter(self, run) -> None:
        """The stage of the next step, if it is not the one in use: the model moved, the loaders rebuilt, said."""
        index = stage_of_step(self.stages, run.state.step)
        if index == self.stage:
            return
        self.close(run)
        stage, accelerator, parts = self.stages[index], run.accelerator, run.parts
        self._move(accelerator.unwrap_model(parts.model, keep_torch_compile=False), parts.optimizer, stage.size)
        train, evaluation = self.loaders_at(stage.size)
        _retire(accelerator, parts.train_loader, parts.eval_loader)
        parts.train_loader, parts.eval_loader = accelerator.prepare(train, evaluation)
        record = run.state.resolution or {"stages": [{"image_size": s.size, "first_step": s.first_step,
                                                      "steps": s.steps, "seconds": 0.0} for s in self.stages]}
        run.state.resolution = {**record, "stage": index, "image_size": stage.size}
        self.stage, self.started = index, time.perf_counter()
        if accelerator.is_main_process:
            resumed = f", from step {run.state.step + 1}" if run.state.step > stage.first_step else ""
            progress.say(f"resolution stage {index + 1} of {len(self.stages)}: {stage.size} px, steps "
                         f"{stage.first_step + 1}-{stage.first_step + stage.steps} ({counted(stage.steps)}{resumed})")

    def changes_after(self, steps_done: int) -> bool:
        """Whether the next step trains in another stage than the one in use."""
        return steps_done < self.stages[-1].first_step + self.stages[-1].steps and (
            stage_of_step(self.stages, steps_done) != self.stage)

    def close(self, run) -> None:
        """The stage in use ends: its seconds recorded and its cost said."""
        if self.stage is None:
            return
        index = self.stage
        stage, entry = self.stages[index], run.state.resolution["stages"][index]
        entry["seconds"] = round(entry["seconds"] + time.perf_counter() - self.started, 3)
        images = self.images_read(stage.first_step + stage.steps) - self.images_read(stage.first_step)
        entry["images_per_s"] = round(images / entry["seconds"], 1) if entry["seconds"] else None
        self.stage = None
        if run.accelerator.is_main_process:
            progress.say(f"resolution stage {index + 1} of {len(self.stages)} ({stage.size} px): "
                         f"{counted(stage.steps)} in {entry['seconds']:.1f} s, {entry['images_per_s']} images/s")

    def _move(self, model, optimizer, size: int) -> None:
        if size == self.model_size:
            return
        movers = at_image_size(model, self.base, size)
        state = getattr(optimizer, "optimizer", optimizer).state if optimizer is not None else {}
        for parameter, move in movers.items():
            for key, value in list(state.get(parameter, {}).items()):
                if hasattr(value, "dim") and value.dim() and value.shape != parameter.shape:
                    moved = move(value.float())
                    # A second moment never goes below 0; bicubic resampling may undershoot it.
                    state[parameter][key] = (moved.clamp_min(0) if bool((value >= 0).all()) else moved).to(value.dtype)
        self.model_size = size


def _retire(accelerator: Accelerator, *loaders) -> None:
    """The loaders of the stage before, let go: Accelerate keeps each prepared loader (and its persistent workers)
    in a list of its own, which would hold them to the end of the run."""
    kept = getattr(accelerator, "_dataloaders", None)
    if isinstance(kept, list):
        kept[:] = [loader for loader in kept if all(loader is not old for old in loaders)]

