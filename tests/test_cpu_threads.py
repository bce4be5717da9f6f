"""train.cpu_threads: a CPU run's figures depend in their last bits on torch's thread count (one per core by
default), so the demo fixes it and prints the same accuracy on every machine."""

from __future__ import annotations

import pytest
import torch

from runs import RECIPE, assert_bit_identical, train


def test_the_run_uses_the_recipes_thread_count(args, tmp_path):
    from vit_finetune.artifacts.callbacks import Callback

    class ThreadCount(Callback):
        seen: list[int] = []

        def on_step_end(self, run):
            self.seen.append(torch.get_num_threads())

    before = torch.get_num_threads()
    torch.set_num_threads(2)  # what torch picks on a 2-core machine
    try:
        observer = ThreadCount()
        assert train([*args, "train.cpu_threads=1", "train.max_steps=2", f"output_dir={tmp_path / 'run'}"],
                     callbacks=[observer]) == 0
        after_the_run = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    assert observer.seen == [1, 1]
    # the process goes on as it was: the next in-process run (a notebook's, a test's) keeps its own arithmetic
    assert after_the_run == 2


@pytest.mark.slow
def test_a_fixed_thread_count_gives_the_same_model_whatever_the_machines_default(base, images, tmp_path):
    """Two machines, one whose torch defaults to 1 thread and one to 2 (what torch picks on 2 cores), both in this
    process: the thread count torch starts a run with is all that tells the two apart."""
    run = [f"model.base={base}", f"data.dataset={images}", *RECIPE, "train.cpu_threads=1"]
    before = torch.get_num_threads()
    try:
        for default in (1, 2):
            torch.set_num_threads(default)
            assert train([*run, f"output_dir={tmp_path / f'threads-{default}'}"]) == 0
    finally:
        torch.set_num_threads(before)
    assert_bit_identical(tmp_path / "threads-1" / "model.safetensors", tmp_path / "threads-2" / "model.safetensors")


def test_the_demo_fixes_its_thread_count():
    from vit_finetune.recipe import load_recipe

    assert load_recipe("demo").train.cpu_threads == 1
