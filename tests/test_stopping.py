"""A run stops when it is asked to, and soon: a killed launcher takes its workers with it, and SIGTERM stops a run
with gradient accumulation between two forward passes, not only after the optimiser step, keeping exact resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from runs import completed, train
from tiny import REPO

pytestmark = pytest.mark.slow

# The shipped demo, made small: 12 steps an epoch at batch 32, for 100 epochs (far longer than any test waits); no
# pictures, which these tests do not look at.
DEMO = ["--recipe", "demo", "model.image_size=32", "train.epochs=100", "data.num_workers=0", "pictures=false"]
LAUNCHERS = {
    "accelerate launch --cpu (one process)": ["--cpu"],
    "accelerate launch --multi_gpu (torchrun, two processes)": ["--multi_gpu", "--num_processes", "2"],
}


def command_line(process: psutil.Process) -> str:
    """The process's command line, or "" for one that ended while it was being listed (the launcher's short-lived
    helpers can be zombies between the listing and this read)."""
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def workers_of(launcher: psutil.Process, count: int, log: Path, timeout: float = 200) -> list[psutil.Process]:
    """The launcher's `count` vit_finetune processes, once the training loop has logged a step."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        workers = [p for p in launcher.children(recursive=True) if "vit_finetune" in command_line(p)]
        if len(workers) == count and "train step" in log.read_text():
            return workers
        time.sleep(0.2)
    raise AssertionError(f"training did not start: {log.read_text()[-2000:]}")


def test_a_signal_that_reaches_this_process_after_the_others_agreed_to_stop_is_not_a_second_one():
    """Ctrl-C or a killed launcher reach each process at its own instant: when another process heard it first, the
    step's agreement sets `raised` here before this process's own signal arrives. That signal must not be taken
    for an impatient second Ctrl-C, or this process drops the checkpoint the others are writing with it."""
    from vit_finetune.training.interrupts import InterruptFlag

    flag = InterruptFlag()
    try:
        flag.raised = True  # what the step's agreement (_interrupted) sets when another process heard the signal
        os.kill(os.getpid(), signal.SIGTERM)  # this process's own first signal: noted, no exception
        assert flag.heard and flag.raised
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)  # a second one heard here: stop now
    finally:
        flag.restore()


# One C call of minutes that leaves the GIL to other threads, as a long forward pass or a collective does: Python
# runs no signal handler of the main thread until it returns.
IN_A_LONG_PASS = """
import hashlib
from vit_finetune.training.interrupts import InterruptFlag
flag = InterruptFlag()
print("ready", flush=True)
hashlib.pbkdf2_hmac("sha256", b"password", b"salt", 2 ** 31 - 1)
print("the pass ended", flush=True)
"""


@pytest.mark.timeout(120)
def test_a_second_signal_ends_the_process_soon_even_in_the_middle_of_a_long_pass():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen([sys.executable, "-c", IN_A_LONG_PASS], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert process.stdout.readline() == "ready\n"
        time.sleep(0.5)  # in the pass
        process.send_signal(signal.SIGTERM)  # the first: heard, to stop at the pass's end
        time.sleep(0.5)
        started = time.monotonic()
        process.send_signal(signal.SIGINT)  # the second: now
        code = process.wait(timeout=30)
        assert time.monotonic() - started < 10
    finally:
        process.kill()
    said = process.stderr.read()
    assert code == 128 + signal.SIGINT, said
    assert "a second SIGINT: stopped at once" in said and "Traceback" not in said
    assert "the pass ended" not in process.stdout.read()


@pytest.fixture(scope="module")
def demo_cache(tmp_path_factory) -> Path:
    """One cache for both launches: the first generates the demo's images, the second reads them."""
    return tmp_path_factory.mktemp("cache")


@pytest.mark.timeout(500)
@pytest.mark.parametrize("launch", LAUNCHERS.values(), ids=LAUNCHERS.keys())
def test_workers_stop_soon_after_their_launcher_is_killed(launch, demo_cache, tmp_path):
    out, log = tmp_path / "out", tmp_path / "log.txt"
    command = [sys.executable, "-m", "accelerate.commands.launch", *launch, "--quiet", "-m", "vit_finetune", *DEMO,
               "train.log_every_steps=1",
               "train.checkpoint_every_steps=1000", f"output_dir={out}"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "VIT_FINETUNE_CACHE": str(demo_cache)}
    with open(log, "w") as handle:
        process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    workers = []
    try:
        workers = workers_of(psutil.Process(process.pid), 2 if "--multi_gpu" in launch else 1, log)
        process.send_signal(signal.SIGKILL)  # the launcher alone, as the OOM killer or a cluster's hard kill does
        process.wait()
        # Without a watch on the launcher, the workers train on to step 1,200; with it they stop within seconds.
        _, alive = psutil.wait_procs(workers, timeout=120)
        assert not alive, f"workers {[p.pid for p in alive]} still run after their launcher was killed"
    finally:
        for worker in workers:
            try:
                worker.kill()
            except psutil.NoSuchProcess:
                pass
    said = log.read_text()
    assert "Traceback" not in said, said[-3000:]
    assert f"the launcher (pid {process.pid}) that started this process is gone" in said
    assert "interrupted at step" in said  # stopped as SIGTERM stops it: with a checkpoint, to resume from
    assert list((out / "checkpoints").glob("step-*/COMPLETE"))
    assert not (out / "metrics.json").exists()


# Gradient accumulation: 3 forward passes of 4 images per optimiser step, 4 steps an epoch (48 images), 6 steps in all;
# LoRA's dropout draws from the global random generators, so a resume that did not restore them would differ.
ACCUMULATING = ["--recipe", "demo", "model.image_size=32", "train.batch_size=4", "train.grad_accum=3",
                "train.max_steps=6", "train.warmup_steps=0", "data.max_train_samples=48", "data.max_eval_samples=12",
                "data.num_workers=0", "model.lora={r: 4, dropout: 0.5}", "train.checkpoint_every_steps=100",
                "pictures=false"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("uninterrupted")
    assert train([*ACCUMULATING, f"output_dir={root / 'out'}"], record=root / "record") == 0
    return root / "record"


@pytest.mark.parametrize("stop_at_pass", [8, 14], ids=["step 3's second pass", "the next epoch's second pass"])
def test_sigterm_stops_between_forward_passes_and_the_checkpoint_resumes_bit_identically(
        stop_at_pass, uninterrupted, tmp_path, capsys):
    from runs import assert_bit_identical, before_batch

    out = tmp_path / "out"
    passes = []

    def sigterm(n: int) -> None:
        passes.append(n)
        if n == stop_at_pass:
            os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler's preemption sends it

    assert train([*ACCUMULATING, f"output_dir={out}"], callbacks=[before_batch(sigterm)]) == 130
    assert passes[-1] == stop_at_pass  # no forward pass after the one running when SIGTERM came
    done = (stop_at_pass - 1) // 3  # the optimiser steps finished before it
    assert completed(out, done).exists() and not completed(out, done + 1).exists()
    assert f"interrupted at step {done}" in capsys.readouterr().err
    assert train([*ACCUMULATING, f"output_dir={out}", "train.resume=auto"], record=tmp_path / "record") == 0
    assert json.loads((out / "metrics.json").read_text())["steps"] == 6
    assert_bit_identical(uninterrupted / "weights-0.safetensors", tmp_path / "record" / "weights-0.safetensors")
