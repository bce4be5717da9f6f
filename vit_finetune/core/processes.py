"""The processes of one run: agreeing on a flag, summing a count, Accelerate's process-wide state, and two checks
before training that the processes are the ones the user launched: as many as asked (`accelerate launch --cpu`
starts one, silently), and, across machines, one shared output folder.

Each function that reduces is a collective: every process must call it at the same point, or the others
wait for it forever.
"""

from __future__ import annotations

import contextlib
import io
import os
import select
import shlex
import signal
import socket
import stat
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, TypeVar

import torch

from vit_finetune.core.errors import StoppedByAnotherProcess, VitFinetuneError

T = TypeVar("T")


def any_process(accelerator, flag: bool | torch.Tensor) -> bool:
    """True on every process if `flag` is true on at least one of them (a collective with several processes)."""
    if accelerator.num_processes == 1:
        return bool(flag)
    raised = torch.as_tensor(flag, device=accelerator.device).float()
    return accelerator.reduce(raised, reduction="sum").item() > 0


def local_main_first(accelerator, work: Callable[[], T]) -> T:
    """`work()` on each machine's first process, then on the others (which then read its downloads).

    Accelerate's local_main_process_first would leave the others waiting at a barrier when the first process
    stops on a user's error, to fail there on a closed connection with a traceback each. Here every process
    learns of it (a collective) and stops with the error's exit code, the first one alone saying why.
    """
    first = accelerator.is_local_main_process
    failure: VitFinetuneError | None = None
    result = None
    if first:
        try:
            result = work()
        except VitFinetuneError as error:
            failure = error
    if any_process(accelerator, failure is not None):
        raise failure or StoppedByAnotherProcess("another process stopped the run: its message is above")
    return result if first else work()


def sum_over_processes(accelerator, count: int) -> int:
    """The sum of each process's `count` (a collective)."""
    return int(accelerator.reduce(torch.as_tensor(count, device=accelerator.device), reduction="sum").item())


# How long the processes of a run leave torch's Gloo worker threads, after the last collective, to drop the work they
# just finished. Dropping it frees tensors, which needs the GIL; the DDP wrapper's destructor, when the run's model is
# freed, joins those threads while holding the GIL, and a thread caught mid-drop then waits for it forever. A
# two-process CPU run hung so, after saving its outputs, once in 12 runs of a stress test (torch 2.13).
GLOO_SETTLE_S = 0.2


def let_gloo_threads_settle(accelerator) -> None:
    """Called once the last collective is done, before the model is freed: sleeping lets the threads take the GIL."""
    if accelerator.num_processes > 1 and accelerator.device.type == "cpu":
        time.sleep(GLOO_SETTLE_S)


def reset_accelerate_state() -> None:
    """Accelerate keeps process-wide singletons; a second run in the same process (a test, a benchmark
    configuration) must start from none."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


# ------------------------------------------------------------------ a launch that started fewer processes than asked

# Where torchrun and MPI tell a process the size of its world (Accelerate reads the same variables).
WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_SIZE")
# Set by `accelerate launch`'s simple launcher only. It is the one chosen for --cpu, for a config file whose
# distributed_type is MULTI_CPU, and when fewer than 2 GPUs are found without --multi_gpu: it starts ONE process,
# whatever --num_processes says, and leaves the others to mpirun (--mpirun_hostfile). Its torchrun launcher
# (--multi_gpu) never sets it.
SIMPLE_LAUNCHER_VARIABLE = "ACCELERATE_USE_CPU"


def world_size(env: Mapping[str, str]) -> int:
    """The number of processes the launcher says this process's world has (1 when none says)."""
    sizes = [int(env[name]) for name in WORLD_SIZE_VARIABLES if env.get(name, "").strip().isdigit()]
    return max(sizes, default=1)


def accelerate_launch_arguments(command_line: list[str]) -> list[str] | None:
    """What follows `accelerate launch` in a command line (`accelerate-launch`, `python -m accelerate.commands.launch`
    too); None if the command is not an Accelerate launch."""
    for index, word in enumerate(command_line):
        name = os.path.basename(word)
        if name == "accelerate-launch" or word == "accelerate.commands.launch":
            return command_line[index + 1:]
        if name == "accelerate" or word == "accelerate.commands.accelerate_cli":
            rest = command_line[index + 1:]
            return rest[1:] if rest[:1] == ["launch"] else None
    return None


@dataclass(frozen=True)
class LaunchRequest:
    """What an `accelerate launch` command asked for, read as Accelerate reads it (flags first, then its config)."""

    processes: int
    machines: int
    launcher_flags: list[str]  # the arguments before the training script
    script: list[str]  # the training script (or `-m`'s module) and its arguments


def read_launch_request(arguments: list[str]) -> LaunchRequest | None:
    """The request in `accelerate launch ARGUMENTS`; None if Accelerate's own parser would refuse them."""
    from accelerate.commands.config.config_args import default_config_file, load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    try:
        with contextlib.redirect_stderr(io.StringIO()):  # a refusal is not ours to print
            args = launch_command_parser().parse_args(arguments)
    except SystemExit:
        return None
    config = None
    # The condition of accelerate/commands/launch.py: with --cpu the default config file is not read.
    if args.config_file is not None or (os.path.isfile(default_config_file) and not args.cpu):
        try:
            config = load_config_from_file(args.config_file)
        except (OSError, ValueError):
            return None
    processes = args.num_processes if args.num_processes is not None else getattr(config, "num_processes", None)
    machines = args.num_machines if args.num_machines is not None else getattr(config, "num_machines", None)
    script_start = len(arguments) - len(args.training_script_args) - 1
    return LaunchRequest(processes or 1, machines or 1, arguments[:script_start], arguments[script_start:])


def command_that_launches(request: LaunchRequest) -> str:
    """The same launch through Accelerate's torchrun launcher (--multi_gpu; with no GPU, the run uses the CPU)."""
    flags = [flag for flag in request.launcher_flags if flag != "--cpu"]
    return shlex.join(["accelerate", "launch", "--multi_gpu", *flags, *request.script])


def lone_process_refusal(env: Mapping[str, str], parent_command_line: list[str] | None) -> str | None:
    """Why this process must not train: `accelerate launch` (the parent) was asked for several processes, but its
    simple launcher started this one alone, which would train as a 1-process run without a word. None otherwise."""
    if SIMPLE_LAUNCHER_VARIABLE not in env or world_size(env) > 1:
        return None
    arguments = accelerate_launch_arguments(parent_command_line or [])
    request = read_launch_request(arguments) if arguments is not None else None
    if request is None or (request.processes <= 1 and request.machines <= 1):
        return None
    asked = shlex.join(["accelerate", "launch", *request.launcher_flags, *request.script[:1]])
    return (f"`{asked}` asked for {request.processes} process(es) on {request.machines} machine(s), but Accelerate's "
            "simple launcher (its choice for --cpu, a config file's MULTI_CPU, or fewer than 2 GPUs) starts one "
            "process and leaves the others to mpirun (--mpirun_hostfile): this one would train alone. Run instead: "
            f"{command_that_launches(request)}  (where there are GPUs this uses them; prefix CUDA_VISIBLE_DEVICES= "
            "to stay on the CPU)")


def parent_command_line() -> list[str] | None:
    """The command line of the process that started this one (None where the system will not tell)."""
    import psutil

    try:
        return psutil.Process(os.getppid()).cmdline()
    except (psutil.Error, OSError):
        return None


class LaunchError(VitFinetuneError):
    """A launch that started this process alone where several were asked for."""


def refuse_a_lone_process() -> None:
    """Raise LaunchError with lone_process_refusal's reason, if any (cheap: reads the environment, and the parent's
    command line only under Accelerate's simple launcher)."""
    if SIMPLE_LAUNCHER_VARIABLE not in os.environ:
        return
    lone = lone_process_refusal(os.environ, parent_command_line())
    if lone:
        raise LaunchError(lone)


# ------------------------------------------------------------------ a launcher that died

# Set in a worker by the launchers that start one: torchrun (and Accelerate's --multi_gpu, which is torchrun), and
# Accelerate's simple launcher. A process run straight from a shell has none, and is never watched: a shell's
# `nohup ... &` must outlive the shell.
LAUNCHER_VARIABLES = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", SIMPLE_LAUNCHER_VARIABLE)
LAUNCHER_POLL_S = 1.0
_watching: list[threading.Thread] = []


def watch_launcher(grace_s: float, poll_s: float = LAUNCHER_POLL_S) -> None:
    """Under a launcher: once the launcher is gone (SIGKILL, the OOM killer), stop this process as the launcher's own
    SIGTERM would (the training loop checkpoints, if checkpoints are on, and exits), and kill it if it has not
    ended `grace_s` seconds later. Without this, a killed launcher leaves its workers training to the end.

    A thread watches the parent pid (it changes when the parent dies: the orphan is re-parented).
    prctl(PR_SET_PDEATHSIG) would be cheaper but fires when the *thread* that started this process ends, which in
    a launcher may be a helper thread while the launcher lives on. Accelerate's own launcher (1.16 on) pipes stderr
    through itself: that pipe dies with it, and sys.stderr is made to outlive it (OutlivesItsReader)."""
    if _watching or not any(name in os.environ for name in LAUNCHER_VARIABLES):
        return
    launcher = os.getppid()
    if _has_no_reader(2) is not None:  # a pipe: Accelerate's launcher (1.16 on) reads this process's stderr itself
        sys.stderr = OutlivesItsReader(sys.stderr)
    watcher = threading.Thread(target=_stop_when_orphaned, args=(launcher, grace_s, poll_s),
                               name="launcher-watchdog", daemon=True)
    _watching.append(watcher)
    watcher.start()


def _has_no_reader(fd: int) -> bool | None:
    """None where `fd` is not a pipe; else whether the pipe's reader is gone (Linux's poll() says POLLERR then)."""
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return None
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(event & select.POLLERR for _, event in poller.poll(0))
    except OSError:
        return True


def _point_stderr_elsewhere() -> None:
    """The launcher that read this process's stderr is gone: what the run says from now on (its stop, its checkpoint)
    goes to its stdout, the launcher's own terminal or log that this process inherited, or nowhere if that is gone
    too, rather than failing the run with BrokenPipeError."""
    if not _has_no_reader(1):
        os.dup2(1, 2)
        return
    nowhere = os.open(os.devnull, os.O_WRONLY)
    os.dup2(nowhere, 2)
    os.close(nowhere)  # fd 2 holds it now


class OutlivesItsReader:
    """sys.stderr, whose write and flush outlive a killed launcher that piped it: a BrokenPipeError moves file
    descriptor 2 elsewhere (_point_stderr_elsewhere) and writes again there. A killed launcher is then a stop like
    its SIGTERM (watch_launcher), not a crash of the training loop on its next progress line."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            _point_stderr_elsewhere()
            return self._stream.write(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            _point_stderr_elsewhere()
            self._stream.flush()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _stop_when_orphaned(launcher: int, grace_s: float, poll_s: float) -> None:
    while os.getppid() == launcher:
        time.sleep(poll_s)
    if _has_no_reader(2):
        _point_stderr_elsewhere()
    print(f"error: the launcher (pid {launcher}) that started this process is gone; stopping this process "
          f"(pid {os.getpid()}) too", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    print(f"error: process {os.getpid()} did not stop within {grace_s:.0f} s (train.collective_timeout_s) of its "
          "launcher's end; killing it", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


# ------------------------------------------------------------------ one output folder for all machines

# A network filesystem may answer from its cache for a while (NFS keeps "no such file" up to ~30 s by default):
# a process that does not see the check file at once looks again until this many seconds have passed.
SHARED_FOLDER_PATIENCE_S = 30.0


def unshared_folder_refusal(accelerator, folder: Path, check_file: str,
                            patience_s: float = SHARED_FOLDER_PATIENCE_S) -> str | None:
    """With several processes: why `folder` is not one folder for all of them, or None (a collective).

    The main process writes a fresh token into folder/check_file; each process must read it back. On machines
    without a shared filesystem, each would otherwise write its own part of every checkpoint on its own disk.
    """
    if accelerator.num_processes == 1:
        return None
    from accelerate.utils import broadcast_object_list

    path = Path(folder) / check_file
    token = [uuid.uuid4().hex, socket.gethostname()] if accelerator.is_main_process else [None, None]
    if accelerator.is_main_process:
        path.write_text(token[0])
    broadcast_object_list(token)  # after the write: the others read a finished file
    blind = not _sees_token(path, token[0], patience_s)
    if not any_process(accelerator, blind):
        return None
    who = (f"process {accelerator.process_index} on {socket.gethostname()} cannot read it" if blind
           else "another process cannot read it")
    return (f"{folder} is not one folder shared by every machine: the main process (on {token[1]}) wrote {check_file} "
            f"there and {who}. Checkpoints would be split between the machines' disks and a resume would find only "
            "part of them. Fix: an output_dir on a filesystem every machine mounts at the same path (NFS, Lustre, ...)")


def _sees_token(path: Path, token: str, patience_s: float) -> bool:
    """Whether `path` holds `token`, looking again for up to `patience_s` seconds."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            if path.read_text() == token:
                return True
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)
