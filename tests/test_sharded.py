"""Sharded models: FSDP through Accelerate's own config files in recipes/accelerate/ (DeepSpeed's runs:
test_deepspeed.py; its refusals are here with FSDP's).

`accelerate launch --config_file recipes/accelerate/fsdp_full_shard.yaml --num_processes 2 -m vit_finetune ...`
must write sharded checkpoints (one file per rank), resume from them after a kill -9 to the same weights, bit for
bit, and end with one ordinary safetensors folder equal to the same run under DDP; LoRA too.

On a machine without GPUs, Accelerate 1.15 does not set up FSDP (it falls back to DDP, which the toolkit refuses:
tested here for real). PyTorch's FSDP2 and Accelerate's FSDP2 code paths do run on CPU over gloo once Accelerate's
state says FSDP, which tests/fsdp_on_cpu.py makes it say (standing in for the GPUs, and nothing else); with two
GPUs the same tests run on them for real.
The shared FSDP run is launched by `accelerate launch --config_file` itself; the others take the same config through
Accelerate's own parser with their ranks forked warm (tests/warm_launch.py), which spares each launch two imports.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fsdp_on_cpu
import recorder
from runs import FLOAT32, assert_bit_identical, completed, free_port, train
from tiny import REPO, make_tiny_vit, write_colour_folder

CONFIGS = sorted((REPO / "recipes" / "accelerate").glob("*.yaml"))
FSDP_CONFIG = REPO / "recipes" / "accelerate" / "fsdp_full_shard.yaml"
# 3 classes x 8 training images, 2 processes x batch 4: 3 optimiser steps an epoch, 6 in all; checkpoints at 2, 4, 6.
# Pictures only in the shared FSDP run, which checks them.
RUN = ["model.image_size=32", "train.batch_size=4", "train.epochs=2", "train.lr=0.005", "train.seed=1",
       "data.num_workers=0", "train.log_every_steps=1", "train.checkpoint_every_steps=2", "pictures=false",
       FLOAT32]
GPUS = torch.cuda.device_count()
# FSDP needs one device per process: two GPUs, or CPU processes (with Accelerate's state set as on GPUs).
needs_two_processes = pytest.mark.skipif(
    GPUS == 1, reason="FSDP with 2 processes needs 2 GPUs (NCCL refuses two ranks on one GPU); this machine has 1")


def launcher(config: Path) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes", "2",
            "--main_process_port", str(free_port())]


def accelerate_launch(config: Path, args: list[str]) -> list[str]:
    return [*launcher(config), "-m", "vit_finetune", *args]


def plain_env() -> dict:
    """The tests' site folder on the path, not the recorder (it would save each rank's shards as if whole)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (recorder.OBSERVED_SITE, REPO / "tests", REPO))),
            "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


# On CPU, Accelerate's state set to FSDP as on GPUs (tests/fsdp_on_cpu.py).
FSDP_ON_CPU = {} if GPUS else {fsdp_on_cpu.ENV: "1"}


def sharded_env() -> dict:
    """The launch's environment: plain_env() with FSDP_ON_CPU."""
    return {**plain_env(), **FSDP_ON_CPU}


def launch(command: list[str], env: dict) -> subprocess.CompletedProcess:
    return succeeded(subprocess.run(command, capture_output=True, text=True, timeout=400, cwd=REPO, env=env))


def succeeded(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, "\n".join(line for line in result.stderr.splitlines() if "Error" in line)[-3000:]
    return result


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("sharded")
    base = make_tiny_vit(root / "tiny-vit")
    images = write_colour_folder(root / "colours", classes=3, train=8, validation=3)
    return {"root": root, "args": [f"model.base={base}", f"data.dataset={images}", *RUN]}


@pytest.fixture(scope="module")
def fsdp_run(data) -> Path:
    out = data["root"] / "fsdp"
    launch(accelerate_launch(FSDP_CONFIG, [*data["args"], f"output_dir={out}", "pictures=true"]), sharded_env())
    return out


def test_the_warm_launcher_refuses_a_launch_that_changes_what_a_library_reads_at_import(data, warm_launcher):
    """huggingface_hub read HF_HOME when the warm launcher imported it: a launch asking for another would not get it."""
    with pytest.raises(ValueError, match=r"read at import.*'HF_HOME'"):
        warm_launcher.start([*data["args"], f"output_dir={data['root'] / 'never'}"],
                            {"HF_HOME": str(data["root"] / "another-home")}, data["root"] / "never.log")
    assert not (data["root"] / "never").exists()


# ------------------------------------------------------------------ the shipped config files


@pytest.mark.parametrize("config", CONFIGS, ids=[path.stem for path in CONFIGS])
def test_every_shipped_accelerate_config_loads_with_accelerates_own_loader(config):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    loaded = load_config_from_file(str(config))  # unknown top-level keys raise here
    # The sub-sections become `accelerate launch` arguments (fsdp_config's keys prefixed with fsdp_); a key the
    # launcher does not know is dropped without a word, so it must be one of its arguments.
    known = {action.dest for action in launch_command_parser()._actions}
    for section in ("fsdp_config", "deepspeed_config"):
        for key in getattr(loaded, section) or {}:
            name = key if section == "deepspeed_config" or key.startswith("fsdp_") else f"fsdp_{key}"
            assert name in known, f"{config.name}: {section}.{key} is not an accelerate launch option"
    wrapped = (loaded.fsdp_config or {}).get("fsdp_transformer_layer_cls_to_wrap")
    if wrapped:
        import transformers.models.vit.modeling_vit as vit

        assert hasattr(vit, wrapped), f"{config.name}: {wrapped} is not ViT's block class"
    assert config.read_text().startswith("#") and "accelerate launch --config_file" in config.read_text()[:800]


def test_the_accelerate_configs_are_not_taken_for_recipes():
    from vit_finetune.recipe import available_recipes

    assert CONFIGS and not [name for name in available_recipes() if name.startswith("accelerate")]
    result = subprocess.run([sys.executable, "-m", "vit_finetune", "--list-recipes"], capture_output=True, text=True,
                            cwd=REPO, timeout=120)
    assert result.returncode == 0 and "demo" in result.stdout and "fsdp" not in result.stdout


# ------------------------------------------------------------------ refused before any work


@pytest.mark.skipif(GPUS > 0, reason="tests Accelerate's fallback on a machine without GPUs")
@pytest.mark.parametrize("version", ["1", "2"])
def test_fsdp_on_a_machine_without_gpus_is_refused_not_run_as_ddp(data, tmp_path, monkeypatch, capsys, version):
    # What `accelerate launch` with an FSDP config exports to each process (accelerate/utils/launch.py).
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", version)
    out = tmp_path / "out"
    assert train([*data["args"], f"output_dir={out}"]) == 1
    error = capsys.readouterr().err
    assert "FSDP" in error and "GPUs only" in error and "torchrun --nproc_per_node" in error
    assert not (out / "model.safetensors").exists() and not (out / "checkpoints").exists()


@pytest.mark.skipif(GPUS > 0 or importlib.util.find_spec("deepspeed") is None,
                    reason="tests Accelerate's fallback on a machine without GPUs, with DeepSpeed installed")
def test_deepspeed_on_a_machine_without_gpus_is_refused_not_run_as_ddp(data, tmp_path, monkeypatch, capsys):
    # What `accelerate launch` with deepspeed_zero2.yaml exports to each process (accelerate/utils/launch.py).
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    monkeypatch.setenv("ACCELERATE_GRADIENT_CLIPPING", "1.0")
    out = tmp_path / "out"
    assert train([*data["args"], f"output_dir={out}"]) == 1
    error = capsys.readouterr().err
    assert "DeepSpeed" in error and "GPUs only" in error and "torchrun --nproc_per_node" in error
    assert not (out / "model.safetensors").exists() and not (out / "checkpoints").exists()


# The launch's ZeRO-3 variables (accelerate/utils/launch.py): zero3_init_flag true, or left out (ZeRO-3's default is
# true), partitions each model as it is built, where the toolkit builds it whole; zero3_save_16bit_model false would
# stop the run at its end, when the weights are gathered.
@pytest.mark.parametrize("flags, refused", [
    ({"ACCELERATE_DEEPSPEED_ZERO3_INIT": "true", "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "true"},
     "Fix: set zero3_init_flag: false"),
    ({"ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "true"}, "Fix: set zero3_init_flag: false"),
    ({"ACCELERATE_DEEPSPEED_ZERO3_INIT": "false", "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "false"},
     "Fix: set zero3_save_16bit_model: true")], ids=["init true", "init left out", "no 16-bit gather"])
def test_zero3_settings_the_toolkit_cannot_train_with_are_refused_before_any_work(data, tmp_path, monkeypatch,
                                                                                  capsys, flags, refused):
    for name, value in {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3", **flags}.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "out"
    assert train([*data["args"], f"output_dir={out}"]) == 1
    error = capsys.readouterr().err
    assert refused in error and "Traceback" not in error
    assert not out.exists()  # refused before output_dir was touched


@pytest.mark.parametrize("keys", [["train.ema_decay=0.9"], ["train.keep_best=eval_loss"],
                                  ["train.ema_decay=0.9", "train.keep_best=eval_accuracy"], ["model.compile=true"]])
def test_what_keeps_a_full_copy_of_the_weights_is_refused_under_sharding(data, tmp_path, monkeypatch, capsys, keys):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    out = tmp_path / "out"
    assert train([*data["args"], f"output_dir={out}", *keys]) == 1
    error = capsys.readouterr().err
    assert all(key.split("=")[0] in error for key in keys) and "Fix:" in error
    assert not out.exists()  # refused before output_dir was touched


# ------------------------------------------------------------------ real 2-process FSDP runs


@pytest.mark.slow
@needs_two_processes
@pytest.mark.timeout(600)
def test_fsdp_checkpoints_are_sharded_and_the_final_model_is_one_folder_equal_to_ddp(data, fsdp_run,
                                                                                      warm_launcher):
    from safetensors.torch import load_file
    from transformers import ViTForImageClassification

    for step in (4, 6):
        folder = fsdp_run / "checkpoints" / f"step-{step:08d}"
        for part in ("pytorch_model_fsdp_0", "optimizer_0"):  # torch.distributed.checkpoint: one file per rank
            assert sorted(p.name for p in (folder / part).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
        assert not (folder / "model.safetensors").exists() and not (folder / "optimizer.bin").exists()  # no whole copy
    model = ViTForImageClassification.from_pretrained(fsdp_run)  # one ordinary folder
    assert model.config.architectures == ["ViTForImageClassification"] and model.config.image_size == 32
    pictures = {"training_curves.png", "confusion_matrix.png", "misclassified.png"}
    assert pictures <= {path.name for path in fsdp_run.glob("*.png")}  # drawn from the gathered predictions

    ddp = data["root"] / "ddp"
    succeeded(warm_launcher.run([*data["args"], f"output_dir={ddp}"], {}, data["root"] / "ddp.log"))
    sharded, replicated = load_file(str(fsdp_run / "model.safetensors")), load_file(str(ddp / "model.safetensors"))
    assert sharded.keys() == replicated.keys()
    # Not bit-identical: FSDP reduce-scatters gradients and computes the clipping norm from shards, DDP all-reduces
    # whole gradients; the float sums differ in order. Measured: at most 1.6e-5 after 6 steps at lr 0.005.
    worst = max((sharded[k] - replicated[k]).abs().max().item() for k in sharded)
    assert worst < 1e-4
    fsdp_losses = [e["loss"] for e in json.loads((fsdp_run / "history.json").read_text()) if "loss" in e]
    ddp_losses = [e["loss"] for e in json.loads((ddp / "history.json").read_text()) if "loss" in e]
    assert len(fsdp_losses) == 6 and fsdp_losses == pytest.approx(ddp_losses, rel=1e-4)
    assert fsdp_losses[-1] < fsdp_losses[0]  # it trained


@pytest.mark.slow
@needs_two_processes
@pytest.mark.timeout(600)
def test_fsdp_run_killed_after_a_sharded_checkpoint_resumes_bit_identical(data, fsdp_run, warm_launcher):
    out = data["root"] / "killed"
    killed, _ranks = warm_launcher.run_and_kill([*data["args"], f"output_dir={out}"], FSDP_ON_CPU,
                                                data["root"] / "killed.log", lambda: completed(out, 2).exists(),
                                                FSDP_CONFIG)
    assert killed != 0 and not (out / "metrics.json").exists()  # it died before the end
    succeeded(warm_launcher.run([*data["args"], f"output_dir={out}", "train.resume=auto"], FSDP_ON_CPU,
                                data["root"] / "resumed.log", FSDP_CONFIG))
    assert_bit_identical(out / "model.safetensors", fsdp_run / "model.safetensors")
    resumed_from = json.loads((out / "run_info.json").read_text())["resumed_from"]
    assert resumed_from and Path(resumed_from).name.startswith("step-")  # it resumed rather than started over


@pytest.mark.slow
@needs_two_processes
@pytest.mark.timeout(600)
def test_lora_under_fsdp_writes_the_adapter_and_the_merged_model(data, warm_launcher, tmp_path):
    from safetensors.torch import load_file
    from transformers import ViTForImageClassification

    # No LoRA dropout: its random draws differ from process to process.
    lora = ["model.lora.r=4", "model.lora.dropout=0", "train.checkpoint_every_steps=null"]
    out = data["root"] / "lora"
    succeeded(warm_launcher.run([*data["args"], f"output_dir={out}", *lora], FSDP_ON_CPU, tmp_path / "lora.log",
                                FSDP_CONFIG))
    adapter = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    trained_b = [k for k in adapter if "lora_B" in k]
    assert trained_b and all(adapter[k].abs().sum() > 0 for k in trained_b)  # B starts at zero: it trained
    merged = ViTForImageClassification.from_pretrained(out).state_dict()
    assert not [k for k in merged if "lora" in k]
    # The same run on one process with the global batch (2 x 4): each step sees the same 8 images.
    single = tmp_path / "single"
    assert train([*data["args"], f"output_dir={single}", *lora, "train.batch_size=8"]) == 0
    reference = ViTForImageClassification.from_pretrained(single).state_dict()
    # Measured: at most 9.7e-8 apart (6 of 40 tensors differ at all): float sums over shards, in another order.
    assert max((merged[k] - reference[k]).abs().max().item() for k in merged) < 1e-6


@pytest.mark.slow
@needs_two_processes
@pytest.mark.timeout(600)
def test_fsdp_with_bf16_computes_in_bf16_and_keeps_float32_weights(data, fsdp_run, warm_launcher):
    """FSDP2 with train.mixed_precision=bf16: Accelerate's bf16 policy (and autocast) on the sharded model."""
    from safetensors.torch import load_file

    out = data["root"] / "fsdp-bf16"
    # One epoch, no checkpoints: three steps are enough to compare with the float32 FSDP run's first three.
    succeeded(warm_launcher.run([*data["args"], f"output_dir={out}", "train.mixed_precision=bf16", "train.epochs=1",
                                 "train.checkpoint_every_steps=null"], FSDP_ON_CPU, data["root"] / "bf16.log",
                                FSDP_CONFIG))
    bf16 = [e["loss"] for e in json.loads((out / "history.json").read_text()) if "loss" in e]
    fp32 = [e["loss"] for e in json.loads((fsdp_run / "history.json").read_text()) if "loss" in e][:3]
    assert len(bf16) == 3 and all(map(math.isfinite, bf16))
    assert bf16 != fp32 and bf16 == pytest.approx(fp32, rel=0.05)  # bf16 rounding: near, never equal
    assert json.loads((out / "run_info.json").read_text())["mixed_precision"] == "bf16"
    assert {tensor.dtype for tensor in load_file(str(out / "model.safetensors")).values()} == {torch.float32}
