"""Launching beyond one process: the `accelerate launch --cpu --num_processes 2` trap, two "machines" over loopback,
one output folder for all machines, and the Slurm scripts.

Accelerate 1.x's launcher for --cpu (its "simple" launcher) starts ONE process whatever --num_processes says; the
process finds no RANK/WORLD_SIZE and trains alone. vit_finetune.core.processes reads the launch's own command line (the
parent process's) with Accelerate's own parser and refuses, naming the command that works: the same launch with
--multi_gpu, Accelerate's torchrun launcher, which on a machine with no GPU runs its processes on the CPU.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import recorder
from runs import assert_bit_identical, free_port
from tiny import REPO, make_tiny_vit, write_colour_folder
from vit_finetune.core import processes
from vit_finetune.core.layout import PARTIAL_PREFIX, SHARED_CHECK

LAUNCH = ["--cpu", "--num_processes", "2", "-m", "vit_finetune", "train.epochs=1"]
SIMPLE_LAUNCHER_ENV = {"ACCELERATE_USE_CPU": "True"}  # what the --cpu launcher puts in its process's environment


def accelerate_parser_reads(arguments: list[str]):
    """`accelerate launch ARGUMENTS` as Accelerate's own parser reads them."""
    from accelerate.commands.launch import launch_command_parser

    return launch_command_parser().parse_args(arguments)


# ---------------------------------------------------------------- reading the launch from its command line


@pytest.mark.parametrize("command_line", [
    ["/usr/bin/python3", "/venv/bin/accelerate", "launch", *LAUNCH],  # /proc/<ppid>/cmdline of `accelerate launch`
    ["/venv/bin/python", "/venv/bin/accelerate-launch", *LAUNCH],
    ["python3", "-m", "accelerate.commands.launch", *LAUNCH],
    ["python3", "-m", "accelerate.commands.accelerate_cli", "launch", *LAUNCH],
])
def test_the_launch_arguments_are_found_however_accelerate_was_called(command_line):
    assert processes.accelerate_launch_arguments(command_line) == LAUNCH


@pytest.mark.parametrize("command_line", [
    [], ["python3", "-m", "vit_finetune", "train.epochs=1"], ["/venv/bin/accelerate", "env"],
    ["/usr/bin/python3", "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "vit_finetune"],
    ["bash", "train.sh", "--num_processes", "2"],
])
def test_other_command_lines_are_no_accelerate_launch(command_line):
    assert processes.accelerate_launch_arguments(command_line) is None


def test_a_cpu_launch_of_two_processes_is_refused_with_the_command_that_works():
    parent = ["/usr/bin/python3", "/venv/bin/accelerate", "launch", "--cpu", "--num_processes", "2", "-m",
              "vit_finetune", "--recipe", "demo", "output_dir=/tmp/my run"]
    message = processes.lone_process_refusal(SIMPLE_LAUNCHER_ENV, parent)
    assert message.startswith("`accelerate launch --cpu --num_processes 2 -m vit_finetune` asked for 2 process(es) "
                              "on 1 machine(s)")
    instead = message.split("Run instead: ")[1].split("  (")[0]
    assert instead == ("accelerate launch --multi_gpu --num_processes 2 -m vit_finetune --recipe demo "
                       "'output_dir=/tmp/my run'")
    args = accelerate_parser_reads(shlex.split(instead)[2:])  # what the user pastes, as Accelerate reads it
    assert (args.multi_gpu, args.cpu, args.num_processes, args.module, args.training_script) == \
        (True, False, 2, True, "vit_finetune")
    assert args.training_script_args == ["--recipe", "demo", "output_dir=/tmp/my run"]


def test_a_cpu_launch_on_two_machines_is_refused_too():
    parent = ["accelerate", "launch", "--cpu", "--num_machines", "2", "--machine_rank", "1", "--num_processes", "2",
              "--main_process_ip", "10.0.0.1", "--main_process_port", "29500", "-m", "vit_finetune"]
    message = processes.lone_process_refusal(SIMPLE_LAUNCHER_ENV, parent)
    assert "asked for 2 process(es) on 2 machine(s)" in message
    assert ("Run instead: accelerate launch --multi_gpu --num_machines 2 --machine_rank 1 --num_processes 2 "
            "--main_process_ip 10.0.0.1 --main_process_port 29500 -m vit_finetune") in message


def test_several_processes_without_cpu_on_a_machine_without_gpus_are_refused_too():
    # Without --cpu and with fewer than 2 GPUs, Accelerate also picks its simple launcher (ACCELERATE_USE_CPU=False).
    parent = ["accelerate", "launch", "--num_processes", "2", "-m", "vit_finetune"]
    message = processes.lone_process_refusal({"ACCELERATE_USE_CPU": "False"}, parent)
    assert "asked for 2 process(es) on 1 machine(s)" in message
    assert "Run instead: accelerate launch --multi_gpu --num_processes 2 -m vit_finetune" in message


def test_a_config_file_asking_for_several_cpu_processes_is_read_as_accelerate_reads_it(tmp_path):
    config = tmp_path / "multi_cpu.yaml"  # what `accelerate config` writes for multi-CPU without mpirun
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_machines: 1\n"
                      "num_processes: 4\nmachine_rank: 0\nmixed_precision: 'no'\nuse_cpu: true\n")
    parent = ["accelerate", "launch", "--config_file", str(config), "-m", "vit_finetune"]
    message = processes.lone_process_refusal(SIMPLE_LAUNCHER_ENV, parent)
    assert "asked for 4 process(es) on 1 machine(s)" in message
    assert f"Run instead: accelerate launch --multi_gpu --config_file {config} -m vit_finetune" in message


@pytest.mark.parametrize("env, parent", [
    ({}, ["accelerate", "launch", *LAUNCH]),  # not started by the simple launcher (torchrun under it, say)
    (SIMPLE_LAUNCHER_ENV, ["accelerate", "launch", "--cpu", "-m", "vit_finetune"]),  # one process asked
    (SIMPLE_LAUNCHER_ENV, ["accelerate", "launch", "--num_processes", "1", "-m", "vit_finetune"]),
    ({**SIMPLE_LAUNCHER_ENV, "PMI_SIZE": "2"}, ["mpirun", "-n", "2", "python", "-m", "vit_finetune"]),  # mpirun's
    ({**SIMPLE_LAUNCHER_ENV, "WORLD_SIZE": "2"}, ["accelerate", "launch", *LAUNCH]),  # started as one of two
    (SIMPLE_LAUNCHER_ENV, ["bash", "my_wrapper.sh"]),  # a wrapper between: nothing can be told, nothing is said
    (SIMPLE_LAUNCHER_ENV, None),  # the parent's command line could not be read
    (SIMPLE_LAUNCHER_ENV, ["accelerate", "launch", "--num_processes", "two", "-m", "vit_finetune"]),  # unparsable
])
def test_no_false_alarm(env, parent):
    assert processes.lone_process_refusal(env, parent) is None


def test_the_parent_command_line_is_read_from_the_running_system():
    import psutil

    assert processes.parent_command_line() == psutil.Process(os.getppid()).cmdline()
    assert processes.parent_command_line()  # this process has a parent whose command line the system gives


# ---------------------------------------------------------------- real launches


@pytest.fixture(scope="module")
def tiny_run_inputs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("launch")
    base = make_tiny_vit(root / "tiny-vit")
    images = write_colour_folder(root / "colours", classes=3, train=8, validation=3)
    return {"root": root, "recipe": [f"model.base={base}", f"data.dataset={images}", "model.image_size=32",
                                     "train.batch_size=4", "train.lr=0.005", "train.seed=1", "data.num_workers=0",
                                     "pictures=false"]}


def accelerate(*arguments: str, **extra_env: str) -> subprocess.CompletedProcess:
    """`accelerate launch ARGUMENTS` from the repository root, this checkout's package first."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false", **extra_env}
    return subprocess.run([sys.executable, "-m", "accelerate.commands.launch", *arguments], capture_output=True,
                          text=True, timeout=240, env=env, cwd=REPO)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_accelerate_launch_cpu_with_two_processes_stops_before_loading_anything(tiny_run_inputs):
    out = tiny_run_inputs["root"] / "refused"
    # Python lists every module each process imports (on stderr): the refusal comes before the training stack loads.
    result = accelerate("--cpu", "--num_processes", "2", "--quiet", "-m", "vit_finetune", *tiny_run_inputs["recipe"],
                        f"output_dir={out}", PYTHONPROFILEIMPORTTIME="1")
    assert result.returncode != 0
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert "vit_finetune.cli" in imported and not imported & {"transformers", "datasets", "evaluate"}
    error = next(line for line in result.stderr.splitlines() if line.startswith("error: "))
    assert "`accelerate launch --cpu --num_processes 2 --quiet -m vit_finetune` asked for 2 process(es)" in error
    instead = shlex.split(error.split("Run instead: ")[1].split("  (")[0])
    assert instead == ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--quiet", "-m", "vit_finetune",
                       *tiny_run_inputs["recipe"], f"output_dir={out}"]
    assert not out.exists()  # refused before anything was written


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_accelerate_launch_of_one_cpu_process_still_trains(tiny_run_inputs):
    out = tiny_run_inputs["root"] / "one"
    result = accelerate("--cpu", "--quiet", "-m", "vit_finetune", *tiny_run_inputs["recipe"], "train.max_steps=2",
                        f"output_dir={out}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((out / "metrics.json").read_text())["steps"] == 2


def start(command: list[str], env: dict, log: Path) -> subprocess.Popen:
    """A launcher in its own session, so that the test can stop it and everything it started."""
    with open(log, "w") as handle:
        return subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)


def wait_all(launched: list[subprocess.Popen], timeout: float) -> list[int]:
    try:
        return [process.wait(timeout=timeout) for process in launched]
    finally:
        for process in launched:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


@pytest.fixture(scope="module")
def two_machine_run(tiny_run_inputs) -> dict:
    """Two "machines" on this one over loopback, one process each: machine 0 launched by hand as the README shows,
    machine 1 by scripts/slurm_node.sh as a Slurm node would run it (with the job's variables set by hand)."""
    root = tiny_run_inputs["root"]
    out, record, port = root / "two-machines", root / "record", free_port()
    arguments = [*tiny_run_inputs["recipe"], "train.epochs=2", "train.checkpoint_every_steps=3", f"output_dir={out}"]
    machine_0 = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "2",
                 "--machine_rank", "0", "--num_processes", "2", "--main_process_ip", "127.0.0.1",
                 "--main_process_port", str(port), "-m", "vit_finetune", *arguments]
    # The script calls `accelerate` from PATH: the one installed beside this interpreter.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    slurm_node_1 = {"SLURM_NNODES": "2", "SLURM_NODEID": "1", "PROCESSES_PER_NODE": "1",
                    "MAIN_PROCESS_IP": "127.0.0.1", "MAIN_PROCESS_PORT": str(port), "PATH": path}
    launched = [start(machine_0, recorder.subprocess_env(record), root / "machine-0.log"),
                start(["bash", "scripts/slurm_node.sh", *arguments], recorder.subprocess_env(record, **slurm_node_1),
                      root / "machine-1.log")]
    codes = wait_all(launched, timeout=240)
    logs = [(root / f"machine-{rank}.log").read_text() for rank in (0, 1)]
    assert codes == [0, 0], "\n".join(log[-3000:] for log in logs)
    return {"out": out, "record": record, "logs": logs}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_machines_train_as_one_run_of_two_processes(two_machine_run):
    from safetensors.torch import load_file
    from transformers import ViTForImageClassification

    out, record = two_machine_run["out"], two_machine_run["record"]
    assert "6 steps on 2 process(es)" in two_machine_run["logs"][0]
    steps = recorder.read_samples(record)
    assert {entry["rank"] for entry in steps} == {0, 1} and len(steps) == 2 * 6
    for epoch in (0, 1):  # each rank its own part of the epoch, together all 24 training images once
        seen = {rank: [s for entry in steps if entry["epoch"] == epoch and entry["rank"] == rank
                       for s in entry["samples"]] for rank in (0, 1)}
        assert len(seen[0]) == len(seen[1]) == 12 and len(set(seen[0] + seen[1])) == 24
    assert_bit_identical(record / "weights-0.safetensors", record / "weights-1.safetensors")
    saved = ViTForImageClassification.from_pretrained(out).state_dict()
    rank0 = load_file(str(record / "weights-0.safetensors"))
    assert saved.keys() == rank0.keys() and all(torch.equal(saved[k], rank0[k]) for k in saved)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_machines_write_each_output_once_from_the_main_process(two_machine_run):
    out, record = two_machine_run["out"], two_machine_run["record"]
    writers = recorder.writers_by_path(record, out)
    assert {"model.safetensors", "metrics.json", SHARED_CHECK} <= set(writers)
    assert all(len(ranks) == 1 for ranks in writers.values()), {p: r for p, r in writers.items() if len(r) > 1}
    # Machine 1 writes only its own RNG state into each checkpoint (Accelerate's save_state, on every rank): on
    # machines without a shared output_dir that part would be on its disk alone, hence the check the run makes.
    assert {Path(path).name for path, ranks in writers.items() if "1" in ranks} == {"random_states_1.pkl"}
    assert sorted(path for path in writers if path.endswith("random_states_1.pkl")) == \
        [f"checkpoints/{PARTIAL_PREFIX}step-{step:08d}/random_states_1.pkl" for step in (3, 6)]
    assert (out / "checkpoints" / "step-00000006" / "random_states_1.pkl").is_file()  # the main process renamed it


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_processes_that_do_not_share_the_output_folder_are_told_so(warm_launcher, tmp_path):
    """Two ranks as torchrun starts them, forked by the session's warm launcher (conftest.warm_launcher): the subject
    is what the processes tell each other, not the launcher (tests/shared_folder_probe.py)."""
    for folder in ("shared", "rank-0", "rank-1"):
        (tmp_path / folder).mkdir()
    result = warm_launcher.run([str(tmp_path)], {}, tmp_path / "probe.log", module="shared_folder_probe")
    assert result.returncode == 0, result.stdout + result.stderr
    answers = {rank: json.loads((tmp_path / f"answer-{rank}.json").read_text()) for rank in (0, 1)}
    assert [answers[rank]["rank"] for rank in (0, 1)] == [0, 1] and answers[0]["shared"] is None and answers[1]["shared"] is None
    assert "is not one folder shared by every machine" in answers[0]["own"]
    assert "process 1 on " in answers[1]["own"] and str(tmp_path / "rank-1") in answers[1]["own"]
    assert "filesystem every machine mounts at the same path" in answers[1]["own"]


# ---------------------------------------------------------------- the Slurm scripts


SLURM_SCRIPTS = [REPO / "scripts" / "slurm_train.sbatch", REPO / "scripts" / "slurm_node.sh"]


@pytest.mark.parametrize("script", SLURM_SCRIPTS, ids=lambda path: path.name)
def test_the_slurm_scripts_are_valid_bash(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_sbatch_script_runs_one_node_script_per_node():
    text = SLURM_SCRIPTS[0].read_text()
    directives = [line.split()[1] for line in text.splitlines() if line.startswith("#SBATCH")]
    assert "--ntasks-per-node=1" in directives  # one launcher per node: it starts that node's processes
    assert 'srun --kill-on-bad-exit=1 bash scripts/slurm_node.sh "$@"' in text
    code = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
    assert code.index('srun --kill-on-bad-exit=1 bash scripts/slurm_node.sh "$@"') > code.index("export MAIN_PROCESS_IP")


def test_a_slurm_node_builds_the_launch_accelerate_expects():
    from accelerate.commands.launch import _validate_launch_command
    from accelerate.utils.launch import prepare_multi_gpu_env

    job = {"SLURM_NNODES": "4", "SLURM_NODEID": "2", "SLURM_GPUS_ON_NODE": "8", "MAIN_PROCESS_IP": "10.1.0.7",
           "PRINT_ONLY": "1"}
    result = subprocess.run(["bash", str(SLURM_SCRIPTS[1]), "--recipe", "food101_384", "output_dir=/shared/run"],
                            capture_output=True, text=True, env={**os.environ, **job})
    assert result.returncode == 0, result.stderr
    command = result.stdout.splitlines()
    assert command[:2] == ["accelerate", "launch"]
    # As `accelerate launch` would: its parser, its checks, then the torchrun arguments it hands to each node.
    args, _config, _ = _validate_launch_command(accelerate_parser_reads(command[2:]))
    assert (args.num_machines, args.machine_rank, args.num_processes, args.multi_gpu) == (4, 2, 32, True)
    assert (args.main_process_ip, args.main_process_port) == ("10.1.0.7", 29500)
    assert (args.module, args.training_script, args.training_script_args) == \
        (True, "vit_finetune", ["--recipe", "food101_384", "output_dir=/shared/run"])
    prepare_multi_gpu_env(args)
    assert (args.nproc_per_node, args.nnodes, args.node_rank, args.rdzv_endpoint) == ("8", "4", 2, "10.1.0.7:29500")


def test_a_slurm_node_script_outside_slurm_says_what_is_missing():
    env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}
    result = subprocess.run(["bash", str(SLURM_SCRIPTS[1])], capture_output=True, text=True, env=env)
    assert result.returncode != 0 and "SLURM_NNODES: is not set: submit scripts/slurm_train.sbatch" in result.stderr
