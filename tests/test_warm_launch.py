"""The tests' warm launcher (tests/warm_launch.py) gives each rank what torchrun and `accelerate launch` give it, and
ends a run as torchrun does when a rank fails: the tests that use it to save two imports a launch rest on this."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from runs import free_port, torchrun_command, warm_launch_command
from tiny import REPO

FSDP_CONFIG = REPO / "recipes" / "accelerate" / "fsdp_full_shard.yaml"
ZERO3_CONFIG = REPO / "recipes" / "accelerate" / "deepspeed_zero3.yaml"
NEEDS_DEEPSPEED = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="`accelerate launch` runs a DeepSpeed config only with deepspeed installed")
# Differ by design: the rendezvous address, and what only torchrun's agent uses (its store and error file) or only
# NCCL reads; here rank 0 hosts the store, and the ranks run on the CPU.
PER_LAUNCH = {"MASTER_PORT", "MASTER_ADDR", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE",
              "TORCH_NCCL_ASYNC_ERROR_HANDLING"}


def report_env(folder: Path, **extra: str) -> dict[str, str]:
    folder.mkdir()
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)]),
            "RANK_REPORT_DIR": str(folder), **extra}


def reports(prefix: list[str], folder: Path) -> dict[str, dict]:
    """rank -> its report, each report's environment reduced to what the launch added or changed (less what differs
    by design)."""
    env = report_env(folder)
    result = subprocess.run([*prefix, "-m", "rank_report", "--flag", "value"], capture_output=True, text=True,
                            timeout=120, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    found = {path.stem: json.loads(path.read_text()) for path in folder.glob("rank-*.json")}
    for report in found.values():
        report["environ"] = {name: value for name, value in report["environ"].items()
                             if env.get(name) != value and name not in PER_LAUNCH}
    return found


@pytest.mark.parametrize("config", [None, FSDP_CONFIG, pytest.param(ZERO3_CONFIG, marks=NEEDS_DEEPSPEED)],
                         ids=["torchrun", "accelerate launch --config_file fsdp", "accelerate launch ... zero3"])
def test_each_rank_gets_the_variables_and_the_command_its_real_launcher_gives_it(config, tmp_path):
    if config is None:
        real_launcher = torchrun_command()
    else:
        real_launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                         "--num_processes", "2", "--main_process_port", str(free_port())]
    real, warm = reports(real_launcher, tmp_path / "real"), reports(warm_launch_command(config_file=config),
                                                                     tmp_path / "warm")
    assert sorted(real) == sorted(warm) == ["rank-0", "rank-1"]
    for rank in real:
        assert warm[rank]["environ"] == real[rank]["environ"]
        assert warm[rank]["argv"] == real[rank]["argv"] == ["--flag", "value"]
        assert warm[rank]["session"] == warm[rank]["pid"]  # a session of its own, as torchrun's workers
    if config == FSDP_CONFIG:  # the config reached the ranks: Accelerate's FSDP variables
        assert warm["rank-0"]["environ"]["ACCELERATE_USE_FSDP"] == "true"
    if config == ZERO3_CONFIG:  # and its DeepSpeed ones
        assert warm["rank-0"]["environ"]["ACCELERATE_USE_DEEPSPEED"] == "true"
        assert warm["rank-0"]["environ"]["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "3"
    assert warm["rank-0"]["pid"] != warm["rank-1"]["pid"]


def test_a_failing_rank_ends_the_launch_with_an_error_and_the_other_rank_stopped(tmp_path):
    folder = tmp_path / "reports"
    env = report_env(folder, RANK_REPORT_FAIL="1")
    started = time.monotonic()
    result = subprocess.run([*warm_launch_command(), "-m", "rank_report"], capture_output=True, text=True,
                            timeout=120, env=env, cwd=REPO)
    assert result.returncode == 1 and "rank 1" in result.stderr and "exited with 3" in result.stderr
    assert time.monotonic() - started < 60  # not the other rank's 600 s sleep
    survivor = json.loads((folder / "rank-0.json").read_text())["pid"]
    assert not psutil.pid_exists(survivor) or psutil.Process(survivor).status() == psutil.STATUS_ZOMBIE
