"""DeepSpeed ZeRO-2 and ZeRO-3 through the shipped recipes/accelerate/deepspeed_zero{2,3}.yaml on two processes.

Each must write DeepSpeed's own checkpoints (one optimizer partition file per rank), resume from them after a kill -9
to the same weights, bit for bit, and end with one ordinary safetensors folder holding the weights the ranks trained;
LoRA too. On a machine without GPUs Accelerate 1.15 does not set up DeepSpeed (the toolkit refuses that:
test_sharded.py); DeepSpeed's ZeRO stages and Accelerate's DeepSpeed code paths do run on CPU over gloo once
Accelerate's state says DEEPSPEED, which tests/deepspeed_on_cpu.py makes it say, standing in for the GPUs. With two
GPUs the same tests run on them for real. The launches take the config through Accelerate's own parser with their
ranks forked warm (tests/warm_launch.py); test_warm_launch.py checks that the ranks get what `accelerate launch` gives.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

import deepspeed_on_cpu
from runs import FLOAT32, assert_bit_identical, completed
from tiny import REPO, make_tiny_vit, write_colour_folder

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                 reason="needs `pip install deepspeed` (the dev extra has it)"),
              pytest.mark.skipif(torch.cuda.device_count() == 1,
                                 reason="2 processes need 2 GPUs (NCCL refuses two ranks on one GPU); this has 1")]

CONFIGS = {stage: REPO / "recipes" / "accelerate" / f"deepspeed_zero{stage}.yaml" for stage in (2, 3)}
# As test_sharded.py's runs: 3 classes x 8 training images, 2 processes x batch 4: 3 optimiser steps an epoch, 6 in
# all; checkpoints at 2, 4 and 6 (the last two kept). train.max_grad_norm is left at 1.0, the configs' clipping.
RUN = ["model.image_size=32", "train.batch_size=4", "train.epochs=2", "train.lr=0.005", "train.seed=1",
       "data.num_workers=0", "train.log_every_steps=1", "train.checkpoint_every_steps=2", "pictures=false",
       FLOAT32]
LORA = ["model.lora.r=4", "model.lora.dropout=0"]
# On CPU, Accelerate's state set to DeepSpeed as on GPUs.
ON_CPU = {} if torch.cuda.device_count() else {deepspeed_on_cpu.ENV: "1"}


def succeeded(result):
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def losses(output: Path) -> list[float]:
    return [entry["loss"] for entry in json.loads((output / "history.json").read_text()) if "loss" in entry]


def saved_weights(output: Path) -> dict[str, torch.Tensor]:
    """The final folder as `from_pretrained` reads it (in-memory key names)."""
    from transformers import ViTForImageClassification

    return ViTForImageClassification.from_pretrained(output).state_dict()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("deepspeed")
    base = make_tiny_vit(root / "tiny-vit")
    images = write_colour_folder(root / "colours", classes=3, train=8, validation=3)
    return {"root": root, "base": base, "args": [f"model.base={base}", f"data.dataset={images}", *RUN]}


@pytest.fixture(scope="module")
def ddp_runs(data, warm_launcher) -> dict[str, Path]:
    """The same training under DDP (each rank sees the same batches as under ZeRO), without checkpoints: "full"
    fine-tunes every weight, "lora" trains LoRA (no dropout: its random draws differ from process to process)."""
    runs = {}
    for name, extra in (("full", []), ("lora", LORA)):
        runs[name] = data["root"] / f"ddp-{name}"
        succeeded(warm_launcher.run([*data["args"], f"output_dir={runs[name]}", *extra,
                                     "train.checkpoint_every_steps=null"], {}, data["root"] / f"ddp-{name}.log"))
    return runs


@pytest.fixture(scope="module")
def zero_runs(data, warm_launcher) -> dict[int, Path]:
    """stage -> the output of one uninterrupted run under that config, launched at the first test that asks."""
    runs = {}

    def run(stage: int) -> Path:
        if stage not in runs:
            out = data["root"] / f"zero{stage}"
            succeeded(warm_launcher.run([*data["args"], f"output_dir={out}"], ON_CPU, data["root"] / f"zero{stage}.log",
                                        CONFIGS[stage]))
            runs[stage] = out
        return runs[stage]

    return run


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_checkpoints_are_per_rank_and_the_final_folder_holds_the_weights_the_ranks_trained(zero_runs,
                                                                                               ddp_runs, stage):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    out = zero_runs(stage)
    last = out / "checkpoints" / "step-00000006"
    # Each rank writes its partition of the optimizer state; ZeRO-2 keeps the weights whole on every rank (one file),
    # ZeRO-3 partitions them too (a file per rank).
    weights = (["mp_rank_00_model_states.pt"] if stage == 2 else
               ["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"])
    for step in (4, 6):
        engine = out / "checkpoints" / f"step-{step:08d}" / "pytorch_model"  # the engine's own save_checkpoint
        assert sorted(path.name for path in engine.iterdir()) == sorted(
            [*weights, "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"])
        assert not (engine.parent / "model.safetensors").exists()
    final = saved_weights(out)  # one ordinary folder
    # The ranks' own state: DeepSpeed's fp32 master weights, one partition per rank, put together by its own tool.
    partitions = get_fp32_state_dict_from_zero_checkpoint(str(last), tag="pytorch_model")
    assert final.keys() == partitions.keys()
    assert not [key for key in final if not torch.equal(final[key], partitions[key])]

    # The same training under DDP. Not always bit-identical: ZeRO-2 reduces the gradients over the ranks in buckets
    # and computes the clipping norm from partitions, in another order of float sums. Measured: ZeRO-2 2.4e-7 to
    # 7.8e-6 apart from one run to another (most tensors differ at all), ZeRO-3 bit-identical; float32 sums in another
    # order, not another training: a wrong gather or a skipped step moves the weights by orders of magnitude more.
    ddp = ddp_runs["full"]
    reference = saved_weights(ddp)
    assert max((final[key] - reference[key]).abs().max().item() for key in final) < 5e-5
    assert len(losses(out)) == 6 and losses(out) == pytest.approx(losses(ddp), rel=1e-5)
    assert losses(out)[-1] < losses(out)[0]  # it trained
    info = json.loads((out / "run_info.json").read_text())
    assert info["processes"] == 2 and info["resumed_from"] is None
    # Counted whole, although under ZeRO-3 each process holds an empty placeholder for every parameter.
    total = sum(tensor.numel() for tensor in final.values())
    said = out.with_suffix(".log").read_text()
    assert f"trainable {total:,} of {total:,} parameters; 6 steps on 2 process(es)" in said


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_run_with_a_rank_killed_after_a_checkpoint_resumes_bit_identical(data, zero_runs, warm_launcher, stage):
    out = data["root"] / f"killed{stage}"
    killed, _ranks = warm_launcher.run_and_kill([*data["args"], f"output_dir={out}"], ON_CPU,
                                                data["root"] / f"killed{stage}.log", lambda: completed(out, 2).exists(),
                                                CONFIGS[stage], only_rank=1)
    assert killed != 0 and not (out / "metrics.json").exists()  # the launch died before the end
    succeeded(warm_launcher.run([*data["args"], f"output_dir={out}", "train.resume=auto"], ON_CPU,
                                data["root"] / f"resumed{stage}.log", CONFIGS[stage]))
    resumed_from = json.loads((out / "run_info.json").read_text())["resumed_from"]
    assert resumed_from and Path(resumed_from).name.startswith("step-")  # it resumed rather than started over
    assert_bit_identical(out / "model.safetensors", zero_runs(stage) / "model.safetensors")


@pytest.mark.parametrize("stage", [2, 3])
def test_lora_under_zero_writes_an_adapter_that_loads_and_the_merged_model(data, warm_launcher, ddp_runs,
                                                                           tmp_path, stage):
    from peft import PeftModel
    from transformers import ViTForImageClassification

    from vit_finetune.model.loading import build_model
    from vit_finetune.recipe import ModelSettings

    out = tmp_path / "lora"
    succeeded(warm_launcher.run([*data["args"], f"output_dir={out}", *LORA, "train.checkpoint_every_steps=null"],
                                ON_CPU, tmp_path / "lora.log", CONFIGS[stage]))
    merged = saved_weights(out)
    assert not [key for key in merged if "lora" in key]
    # The adapter loads onto the base it was trained from, given the run's head, and merged it is the saved model.
    config = ViTForImageClassification.from_pretrained(out).config
    labels = [config.id2label[i] for i in range(config.num_labels)]
    adapted = PeftModel.from_pretrained(build_model(ModelSettings(base=str(data["base"]), image_size=32), labels),
                                        out / "adapter")
    lora_b = [param for name, param in adapted.named_parameters() if "lora_B" in name]
    assert lora_b and all(param.abs().sum() > 0 for param in lora_b)  # B starts at zero: it trained
    remerged = adapted.merge_and_unload().state_dict()
    assert max((merged[key] - remerged[key]).abs().max().item() for key in merged) < 1e-6
    # The same training under DDP. Measured: at most 3.7e-9 (ZeRO-2) and 7.5e-9 (ZeRO-3) apart, 6 of 40 tensors.
    reference = saved_weights(ddp_runs["lora"])
    assert max((merged[key] - reference[key]).abs().max().item() for key in merged) < 1e-7
