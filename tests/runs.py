"""Shared pieces of the reliability tests: one small recipe, in-process and killed runs, and readers."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file

import recorder
from vit_finetune.core.processes import reset_accelerate_state

# 3 classes x 8 training images, batch 4: 6 optimiser steps an epoch, 12 in all; 9 validation images. No pictures:
# drawing them is most of a tiny run's time; the tests that look at them say pictures=true. The loop's tests need its
# steps and its evaluation after each epoch: fine-tuning and eval_every_steps=null say so whatever `auto` would choose.
# float32 on every host: auto would choose bf16 on a CPU with native bfloat16 and change the last bits. No flip: the
# mirror test that data.horizontal_flip=auto runs is tested on its own (test_probe_checks.py); here it would only
# cost each run its cross-validated fits and make the pixels depend on what it decides.
FLOAT32 = "train.mixed_precision=no"
NO_FLIP = "data.horizontal_flip=false"
RECIPE = ["model.image_size=32", "train.batch_size=4", "train.epochs=2", "train.lr=0.005", "train.seed=1",
          "train.log_every_steps=1", "data.num_workers=0", "pictures=false", "train.method=finetune",
          "train.eval_every_steps=null", FLOAT32, NO_FLIP]
STEPS_PER_EPOCH, TRAIN_IMAGES = 6, 24
WARM_LAUNCH = Path(__file__).resolve().parent / "warm_launch.py"


def free_port() -> int:
    """A port nothing listens on now: tests run side by side (pytest-xdist), so no launch may count on torchrun's
    default 29500 being free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(processes: int = 2) -> list[str]:
    """`torchrun --nproc_per_node N` on a port of its own, as a command prefix (`-m vit_finetune ...` follows)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
            "--master_port", str(free_port())]


def warm_launch_command(processes: int = 2, config_file: Path | None = None) -> list[str]:
    """Like torchrun_command() (with a config file: like `accelerate launch --config_file C --num_processes N`), with
    the ranks forked from one interpreter that imported the libraries once (tests/warm_launch.py): for the tests of
    what the ranks do together, not of the launcher. `-m vit_finetune ...` follows."""
    config = ["--config_file", str(config_file)] if config_file else []
    return [sys.executable, str(WARM_LAUNCH), "--nproc_per_node", str(processes), "--master_port", str(free_port()),
            *config]


class WarmLauncher:
    """Launch after launch of `-m vit_finetune ARGS` on 2 processes, as warm_launch_command() launches them, from one
    warm interpreter (tests/warm_launch.py --serve): the launches import the libraries once in all.
    `env` is the environment the launcher starts with, and each launch's; a launch's `changes` to it may change only
    what is read at run time. Kept from the start: the tests' own environment changes as libraries are imported."""

    def __init__(self, env: dict[str, str], cwd: Path):
        self.env, self.cwd = dict(env), cwd
        self.server = subprocess.Popen([sys.executable, str(WARM_LAUNCH), "--serve"], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, env=env, cwd=cwd)
        self.pending = b""  # what the launcher has answered and no call has read yet
        self.logs = tempfile.mkdtemp(prefix="warm-launcher-")  # the output of cli()'s runs, removed at close()

    def start(self, args: list[str], changes: dict[str, str], log: Path, config_file: Path | None = None,
              cwd: Path | None = None, module: str = "vit_finetune", plain: bool = False) -> list[int]:
        """Fork the ranks of one launch of `-m module ARGS` (the launcher's environment with `changes`, its output in
        `log` and `log`.err, in `cwd` or the launcher's); returns their pids, rank 0's first. `plain`: one process
        with no launcher, as `python -m module ARGS` runs (its exit code is its own, minus a signal that ended it)."""
        log.parent.mkdir(parents=True, exist_ok=True)
        for output in (log, log.with_suffix(".err")):  # there to read as soon as this returns
            output.touch()
        request = {"processes": 2, "plain": plain, "config_file": str(config_file) if config_file else None,
                   "module_and_args": [module, *args], "env": {**self.env, **changes},
                   "cwd": str(cwd or self.cwd), "stdout": str(log), "stderr": str(log.with_suffix(".err"))}
        self.server.stdin.write(json.dumps(request).encode() + b"\n")
        self.server.stdin.flush()
        answer = self._answer(timeout=120)
        if "refused" in answer:
            raise ValueError(answer["refused"])
        return answer["pids"]

    def wait(self, timeout: float = 400) -> int:
        """The launch's exit code, once all its ranks have ended."""
        return self._answer(timeout)["exit_code"]

    def finished(self) -> int | None:
        """The launch's exit code if all its ranks have ended, else None (without waiting)."""
        return self._answer(timeout=0)["exit_code"] if self._answered() else None

    def run(self, args: list[str], changes: dict[str, str], log: Path, config_file: Path | None = None,
            cwd: Path | None = None, module: str = "vit_finetune", plain: bool = False,
            timeout: float = 400) -> subprocess.CompletedProcess:
        self.start(args, changes, log, config_file, cwd, module, plain)
        code = self.wait(timeout)
        return subprocess.CompletedProcess(args, code, log.read_text(), log.with_suffix(".err").read_text())

    def cli(self, *args: str, changes: dict[str, str] | None = None, cwd: Path | None = None,
            timeout: float = 400) -> subprocess.CompletedProcess:
        """`python -m vit_finetune ARGS` in a process of its own, as tiny.run_cli runs it, but forked warm: for the
        tests of what a run does and says, not of what a fresh interpreter imports or warns of as it loads."""
        log = Path(tempfile.mkdtemp(prefix="cli-", dir=self.logs)) / "out.log"
        return self.run(list(args), changes or {}, log, cwd=cwd, plain=True, timeout=timeout)

    def run_and_kill(self, args: list[str], changes: dict[str, str], log: Path,
                     when: Callable[[], bool], config_file: Path | None = None,
                     timeout: float = 300, only_rank: int | None = None) -> tuple[int, list[int]]:
        """A launch whose ranks (or rank `only_rank` alone: the launcher then stops the others) are sent SIGKILL as
        soon as `when()` holds; returns its exit code and the ranks' pids."""
        ranks = self.start(args, changes, log, config_file)
        deadline = time.monotonic() + timeout
        while not when() and time.monotonic() < deadline:
            time.sleep(0.005)
        for pid in ranks if only_rank is None else [ranks[only_rank]]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended on its own first
                pass
        return self.wait(), ranks

    def _answered(self) -> bool:
        """Whether a whole answer line has arrived, reading what the launcher has written without waiting."""
        import select

        while b"\n" not in self.pending and select.select([self.server.stdout], [], [], 0)[0]:
            chunk = os.read(self.server.stdout.fileno(), 65536)
            assert chunk, f"the warm launcher ended (exit code {self.server.poll()})"
            self.pending += chunk
        return b"\n" in self.pending

    def _answer(self, timeout: float) -> dict:
        """The launcher's next answer line (read from the pipe's descriptor: a buffered reader could hold a second
        answer where select() does not see it)."""
        import select

        deadline = time.monotonic() + timeout
        while b"\n" not in self.pending:
            ready, _, _ = select.select([self.server.stdout], [], [], max(deadline - time.monotonic(), 0))
            chunk = os.read(self.server.stdout.fileno(), 65536) if ready else b""
            assert chunk, f"the warm launcher did not answer within {timeout} s (exit code {self.server.poll()})"
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        shutil.rmtree(self.logs, ignore_errors=True)
        self.server.stdin.close()
        try:
            self.server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.server.kill()
            self.server.wait()


def train(args: list[str], record: Path | None = None, patches: list[tuple] = (), callbacks: list = ()) -> int:
    """`python -m vit_finetune ARGS` in this process (cheaper than a subprocess); returns the exit code.

    `record` observes it with tests/recorder.py; `callbacks` (vit_finetune.artifacts.callbacks.Callback) observe it
    through the package's hook; `patches` are (object, name, value) applied for the run only.
    """
    from vit_finetune.artifacts.callbacks import REGISTERED, register
    from vit_finetune.cli import main

    observers = [*([recorder.recorder(record)] if record is not None else []), *callbacks]
    with pytest.MonkeyPatch.context() as patch:
        for target, name, value in patches:
            patch.setattr(target, name, value)
        for observer in observers:
            register(observer)
        try:
            return main(list(args))
        finally:
            for observer in observers:
                REGISTERED.remove(observer)
            reset_accelerate_state()


class SimulatedKill(BaseException):
    """Stands for SIGKILL in an in-process run: no handler of the package catches a BaseException."""


def before_batch(action: Callable[[int], None]):
    """A callback that calls `action(n)` before the n-th batch of a run (n from 1) is trained on."""
    from vit_finetune.artifacts.callbacks import Callback

    class BeforeBatch(Callback):
        batches = 0

        def on_batch(self, run, batch):
            self.batches += 1
            action(self.batches)

    return BeforeBatch()


def kill_at(step: int):
    """A callback that 'kills' the run as optimiser step `step` starts (one batch per step in these runs)."""

    def kill(batch: int) -> None:
        if batch == step:
            raise SimulatedKill(f"simulated kill at step {step}")

    return before_batch(kill)


def launch_and_kill(launcher: WarmLauncher, args: list[str], record: Path | None, when: Callable[[str], bool],
                    log: Path, sig: int = signal.SIGKILL, timeout: float = 180) -> subprocess.CompletedProcess:
    """`python -m vit_finetune ARGS` as a process of its own (forked from the warm `launcher`, conftest.warm_launcher),
    observed by tests/recorder.py into `record` (unless None), sent `sig` as soon as `when(stdout so far)` holds."""
    [pid] = launcher.start(args, {recorder.ENV: str(record)} if record else {}, log, plain=True)
    deadline = time.monotonic() + timeout
    code = launcher.finished()
    while code is None and time.monotonic() < deadline and not when(log.read_text()):
        time.sleep(0.005)
        code = launcher.finished()
    if code is None:
        try:
            os.kill(pid, sig if time.monotonic() < deadline else signal.SIGKILL)
        except ProcessLookupError:  # it ended on its own first
            pass
        code = launcher.wait()
    return subprocess.CompletedProcess(args, code, log.read_text(), log.with_suffix(".err").read_text())


def exists(path: Path) -> Callable[[str], bool]:
    return lambda _stdout: path.exists()


def completed(output: Path, step: int) -> Path:
    return output / "checkpoints" / f"step-{step:08d}" / "COMPLETE"


def killed_after_a_checkpoint(args: list[str], out: Path) -> Path:
    """`out` of a run 'killed' as step 3 starts, whose last checkpoint is step 2."""
    import pytest

    with pytest.raises(SimulatedKill):
        train([*args, f"output_dir={out}", "train.checkpoint_every_steps=2"], callbacks=[kill_at(3)])
    assert completed(out, 2).exists()
    return out


def history(output: Path) -> list[dict]:
    """history.json without the wall-clock throughput, which no two runs share."""
    entries = json.loads((output / "history.json").read_text())
    return [{k: v for k, v in entry.items() if k != "images_per_s"} for entry in entries]


def losses(output: Path) -> list[tuple[int, float]]:
    return [(entry["step"], entry["loss"]) for entry in history(output) if "loss" in entry]


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def assert_bit_identical(left: Path, right: Path) -> None:
    a, b = weights(left), weights(right)
    assert a.keys() == b.keys()
    different = [key for key in a if not torch.equal(a[key], b[key])]
    assert not different, f"tensors differ: {different[:5]}"


def assert_each_sample_once_per_epoch(steps: dict[int, dict]) -> None:
    assert sorted(steps) == list(range(1, 2 * STEPS_PER_EPOCH + 1))
    for epoch in (0, 1):
        seen = [s for entry in steps.values() if entry["epoch"] == epoch for s in entry["samples"]]
        assert len(seen) == TRAIN_IMAGES and len(set(seen)) == TRAIN_IMAGES, f"epoch {epoch}"
