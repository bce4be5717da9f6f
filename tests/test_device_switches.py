"""The switches a GPU run turns on, each run here in its CPU form through the real CLI: bf16 autocast (and an exact
resume under it after a kill -9), fp16 autocast, torch.compile (inductor's CPU backend) and the AdamW
implementation chosen per device. FSDP with bf16 is in test_sharded.py, beside the other FSDP runs.

Runs are tiny (32 px, a 2-block ViT, a few steps): these tests check that each path runs and does what it says,
not how fast it is.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

from runs import assert_bit_identical, completed, exists, history, launch_and_kill, losses, train
from vit_finetune.callbacks import Callback

pytestmark = pytest.mark.slow

ONE_EPOCH = ["train.epochs=1"]  # 6 optimiser steps (runs.RECIPE: 24 images, batch 4)


class Observe(Callback):
    """What the loop really ran with: the optimiser it steps, the model it calls, and the dtype a Linear layer
    computes in during the training forwards (Accelerate's autocast shows there: the model's own output is
    converted back to float32)."""

    def __init__(self):
        self.optimizer = self.model = None
        self.linear_dtypes: set[torch.dtype] = set()

    def on_train_start(self, run):
        self.optimizer, self.model = run.parts.optimizer.optimizer, run.parts.model
        layer = next(module for module in run.parts.model.modules() if isinstance(module, torch.nn.Linear))
        layer.register_forward_hook(lambda _module, _inputs, output: self.linear_dtypes.add(output.dtype)
                                    if torch.is_grad_enabled() else None)


# ---------------------------------------------------------------- mixed precision


def test_bf16_autocast_trains_and_a_run_killed_under_it_resumes_bit_identical(args, tmp_path):
    reference, seen = tmp_path / "reference", Observe()
    run = [*args, *ONE_EPOCH, "train.mixed_precision=bf16", "train.checkpoint_every_steps=2"]
    assert train([*run, f"output_dir={reference}"], callbacks=[seen]) == 0
    assert seen.linear_dtypes == {torch.bfloat16}  # every training forward ran under bf16 autocast
    assert json.loads((reference / "run_info.json").read_text())["mixed_precision"] == "bf16"
    from safetensors.torch import load_file

    # autocast computes in bf16; the weights, the optimiser and the saved model stay float32
    assert {tensor.dtype for tensor in load_file(str(reference / "model.safetensors")).values()} == {torch.float32}

    out = tmp_path / "out"
    killed = launch_and_kill([*run, f"output_dir={out}"], tmp_path / "r1", exists(completed(out, 2)), tmp_path / "1.log")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert not (out / "metrics.json").exists()
    assert train([*run, f"output_dir={out}", "train.resume=auto"]) == 0
    assert Path(json.loads((out / "run_info.json").read_text())["resumed_from"]).name.startswith("step-")
    assert history(out) == history(reference)
    assert_bit_identical(out / "model.safetensors", reference / "model.safetensors")


def test_fp16_on_cpu_is_refused_before_the_output_dir_is_touched(args, tmp_path, capsys):
    # Accelerate 1.15 turns fp16 autocast off on CPU without a word: the run would claim fp16 and compute in float32.
    out = tmp_path / "out"
    assert train([*args, "train.mixed_precision=fp16", f"output_dir={out}"]) == 1
    error = capsys.readouterr().err
    assert "train.mixed_precision=fp16" in error and "Fix: train.mixed_precision=bf16" in error
    assert not out.exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp16 autocast needs CUDA: Accelerate 1.15 has none on CPU "
                    "(the CPU refusal is tested above; bf16 is the CPU form of mixed precision)")
def test_fp16_autocast_trains_in_float16_with_a_loss_scaler(args, tmp_path):
    seen = Observe()
    out = tmp_path / "out"
    assert train([*args, *ONE_EPOCH, "train.mixed_precision=fp16", f"output_dir={out}"], callbacks=[seen]) == 0
    assert seen.linear_dtypes == {torch.float16}
    trained = losses(out)
    assert len(trained) == 6 and all(map(torch.isfinite, torch.tensor([loss for _step, loss in trained])))


# ---------------------------------------------------------------- torch.compile


@pytest.mark.timeout(900)
def test_model_compile_true_runs_compiled_on_cpu_and_trains_like_eager(args, tmp_path, monkeypatch):
    import torch._dynamo
    import torch._inductor.config

    # Compile in this process: a pool of compile workers would each import torch first, costing more than it saves.
    monkeypatch.setattr(torch._inductor.config, "compile_threads", 1)

    # Batch 3: every train and eval batch has one shape (8 x 3 train, 3 x 3 eval), so nothing recompiles.
    run = [*args, "train.batch_size=3", "train.max_steps=2"]
    eager, compiled, seen = tmp_path / "eager", tmp_path / "compiled", Observe()
    assert train([*run, f"output_dir={eager}", "model.compile=false"]) == 0
    torch._dynamo.reset()
    try:
        assert train([*run, f"output_dir={compiled}", "model.compile=true"], callbacks=[seen]) == 0
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()  # later in-process runs of this session start from no compiled code
    assert isinstance(seen.model, torch._dynamo.eval_frame.OptimizedModule) and graphs > 0
    # Inductor fuses and reorders float operations: close to eager, not bit-equal.
    assert [step for step, _ in losses(compiled)] == [1, 2]
    assert [loss for _, loss in losses(compiled)] == pytest.approx([loss for _, loss in losses(eager)], rel=1e-4)
    from transformers import ViTForImageClassification

    saved = ViTForImageClassification.from_pretrained(compiled).state_dict()  # no "_orig_mod." names on disk
    reference = ViTForImageClassification.from_pretrained(eager).state_dict()
    assert saved.keys() == reference.keys()
    assert max((saved[key] - reference[key]).abs().max().item() for key in saved) < 1e-4


# ---------------------------------------------------------------- the optimiser per device


def test_adamw_is_fused_on_cpu_and_cuda_and_steps_as_the_per_tensor_loop_does(base, tmp_path):
    """Both devices ask for PyTorch's fused AdamW. On the same groups (lr scales, no decay on norms) its update must
    be the one the per-tensor loop (PyTorch's CPU default) computes, to float32 rounding."""
    from vit_finetune.model import build_model
    from vit_finetune.recipe import load_recipe
    from vit_finetune.train import build_optimizer

    recipe = load_recipe("demo", [f"model.base={base}", "model.image_size=32", "train.layer_decay=0.5", "train.lr=2e-3",
                                  "train.head_lr=2e-3", "train.weight_decay=0.05", "train.warmup_steps=0"])
    steps = {}
    for device in ("cpu", "cuda", "per-tensor loop"):
        torch.manual_seed(0)
        model = build_model(recipe.model, ["a", "b", "c"])
        optimizer = build_optimizer(model, recipe, "cpu" if device == "per-tensor loop" else device)
        assert optimizer.defaults["fused"] and not optimizer.defaults["foreach"]
        if device == "per-tensor loop":
            groups = [{key: value for key, value in group.items() if key not in ("fused", "foreach")}
                      for group in optimizer.param_groups]  # each group carries the kernel choice too
            optimizer = torch.optim.AdamW(groups, foreach=False)
        for _ in range(3):
            model(pixel_values=torch.randn(2, 3, 32, 32), labels=torch.tensor([0, 2])).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        steps[device] = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    assert steps["cpu"].keys() == steps["per-tensor loop"].keys()
    worst = max((steps["cpu"][name] - steps["per-tensor loop"][name]).abs().max().item() for name in steps["cpu"])
    assert 0 < worst < 1e-6  # not the same code path (0 would mean fused was not used), the same update


def test_a_cpu_run_steps_the_fused_adamw(args, tmp_path):
    seen = Observe()
    assert train([*args, "train.max_steps=1", f"output_dir={tmp_path / 'out'}"], callbacks=[seen]) == 0
    assert isinstance(seen.optimizer, torch.optim.AdamW) and seen.optimizer.defaults["fused"]
    assert seen.linear_dtypes == {torch.float32}  # train.mixed_precision=no: no autocast


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the fused AdamW is checked on CPU above (same "
                    "groups); here it runs on the device the recipe trains on")
def test_a_cuda_run_steps_the_fused_adamw(args, tmp_path):
    seen = Observe()
    assert train([*args, "train.max_steps=1", f"output_dir={tmp_path / 'out'}"], callbacks=[seen]) == 0
    assert seen.optimizer.defaults["fused"] and next(seen.model.parameters()).is_cuda
