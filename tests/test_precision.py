"""train.mixed_precision=auto: bf16 autocast where the device computes bfloat16 natively, fp16 on a CUDA GPU without
it, float32 elsewhere; a value the recipe sets is kept. Which CPU runs the suite cannot be chosen, so the one check of it
(precision.native_bf16_cpu) is replaced for a run; the training, its autocast and its files are real."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
import yaml

from runs import train
from vit_finetune.artifacts.callbacks import Callback
from vit_finetune.model import precision
from vit_finetune.training import probe

ONE_EPOCH = ["train.epochs=1"]


class ForwardDtypes(Callback):
    """The dtypes a Linear layer computes in during training forwards (autocast shows there)."""

    def __init__(self):
        self.dtypes: set[torch.dtype] = set()

    def on_train_start(self, run):
        layer = next(module for module in run.parts.model.modules() if isinstance(module, torch.nn.Linear))
        layer.register_forward_hook(lambda _module, _inputs, output: self.dtypes.add(output.dtype)
                                    if torch.is_grad_enabled() else None)


@pytest.mark.parametrize("native, expected, dtype", [(True, "bf16", torch.bfloat16), (False, "no", torch.float32)])
def test_auto_trains_in_bf16_only_on_a_cpu_with_native_bfloat16(args, tmp_path, capsys, native, expected, dtype):
    out, seen = tmp_path / "out", ForwardDtypes()
    code = train([*args, *ONE_EPOCH, "train.mixed_precision=auto", f"output_dir={out}"], callbacks=[seen],
                 patches=[(precision, "native_bf16_cpu", lambda: native)])
    assert code == 0
    assert seen.dtypes == {dtype}
    assert yaml.safe_load((out / "recipe.yaml").read_text())["train"]["mixed_precision"] == expected
    assert json.loads((out / "run_info.json").read_text())["mixed_precision"] == expected
    said = capsys.readouterr()
    line = next(line for line in (said.out + said.err).splitlines() if line.startswith("train.mixed_precision=auto"))
    assert line.startswith(f"train.mixed_precision=auto -> {expected}: ")
    assert ("in hardware" in line) == native


def test_a_precision_the_recipe_sets_is_kept_on_a_cpu_with_native_bfloat16(args, tmp_path, capsys):
    out, seen = tmp_path / "out", ForwardDtypes()
    code = train([*args, *ONE_EPOCH, "train.mixed_precision=no", f"output_dir={out}"], callbacks=[seen],
                 patches=[(precision, "native_bf16_cpu", lambda: True)])
    assert code == 0
    assert seen.dtypes == {torch.float32}
    assert yaml.safe_load((out / "recipe.yaml").read_text())["train"]["mixed_precision"] == "no"
    said = capsys.readouterr()
    assert "train.mixed_precision=auto" not in said.out + said.err


class ProbeForwardDtypes:
    """The dtypes a Linear layer computes in during the probe's pass over the training images: the pass is wrapped
    (head_inputs, as the run calls it), so training and evaluation forwards are not counted. The checks that decide
    data.horizontal_flip and data.alpha_background read features through the same function; their dtypes are kept
    apart, in checks_dtypes."""

    def __init__(self):
        self.dtypes: set[torch.dtype] = set()
        self.checks_dtypes: set[torch.dtype] = set()

    def patch(self) -> tuple:
        original = probe.head_inputs

        def observed(model, loader, accelerator, mixed_precision):
            caller = Path(inspect.stack()[1].filename).stem
            seen = self.checks_dtypes if caller == "probe_checks" else self.dtypes
            layer = next(module for module in model.modules() if isinstance(module, torch.nn.Linear))
            hook = layer.register_forward_hook(lambda _module, _inputs, output: seen.add(output.dtype))
            try:
                return original(model, loader, accelerator, mixed_precision)
            finally:
                hook.remove()

        return probe, "head_inputs", observed


@pytest.mark.parametrize("method, dtype, said", [("linear_probe", torch.float32, "float32"),
                                                 ("lp_ft", torch.bfloat16, "bf16")])
def test_the_probe_reads_float32_features_for_a_final_head_and_the_runs_precision_before_fine_tuning(
        args, tmp_path, capsys, method, dtype, said):
    seen = ProbeForwardDtypes()
    code = train([*args, *ONE_EPOCH, f"train.method={method}", "train.mixed_precision=bf16",
                  f"output_dir={tmp_path / 'out'}"], patches=[seen.patch()])
    assert code == 0
    assert seen.dtypes == {dtype}
    assert seen.checks_dtypes == {torch.float32}  # the data checks decide on float32 features whatever the run's precision
    assert f"(32 each, {said}) in" in capsys.readouterr().out


def test_auto_is_the_default_and_resolves_per_device():
    from vit_finetune.recipe import load_recipe

    assert load_recipe(None, []).train.mixed_precision == "auto"
    assert precision.auto_mixed_precision("mps")[0] == "no"  # not measured there: float32


@pytest.mark.parametrize("gpu, capability, expected", [("A100", (8, 0), "bf16"), ("T4", (7, 5), "fp16"),
                                                      ("V100", (7, 0), "fp16"), ("P100", (6, 0), "no")])
def test_auto_on_a_cuda_gpu_picks_bf16_where_native_else_fp16_on_tensor_cores(monkeypatch, gpu, capability, expected):
    """No GPU here: torch's answers are given as they are on each card. Before Ampere (8.0) torch says yes to bfloat16
    unless emulation is left out (it emulates it there, slowly): only native bfloat16 counts."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: capability >= (8, 0) or including_emulation)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    chosen, why = precision.auto_mixed_precision("cuda")
    assert chosen == expected, gpu
    assert ("loss scaler" in why) == (expected == "fp16")
