"""The benchmark: its FLOP count against the published ViT figures, and the real command on this device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny import REPO, python_path

from vit_finetune.bench import CONFIGS, MODELS, training_flops_per_image, vit_macs
from vit_finetune.recipe import LoraSettings

FIGURES = ("images_per_s", "mfu", "flops_per_image", "peak_memory_gib", "data_wait_share", "step_time_ms", "seconds")


def test_vit_b16_flops_match_the_published_figures():
    """timm's forward cost of ViT-B/16 (17.58 GMACs at 224, 55.54 at 384); training is 6 x GMACs per image."""
    at_384 = MODELS["vit-b16-384"].vit_config()
    assert sum(vit_macs(at_384).values()) / 1e9 == pytest.approx(55.54, rel=0.005)
    assert training_flops_per_image(at_384) / 1e9 == pytest.approx(333.2, rel=0.005)
    at_224 = MODELS["vit-b16-384"].vit_config()
    at_224.image_size, at_224.num_labels = 224, 1000
    assert sum(vit_macs(at_224).values()) / 1e9 == pytest.approx(17.58, rel=0.005)
    assert training_flops_per_image(at_224) / 1e9 == pytest.approx(105.5, rel=0.005)


def test_lora_flops_sit_between_forward_and_backward_costs():
    """Frozen weights need no weight gradients: LoRA trains for between 2x and 3x the forward cost."""
    config = MODELS["vit-b16-384"].vit_config()
    forward = 2 * sum(vit_macs(config).values())
    lora = training_flops_per_image(config, LoraSettings(r=16, target_modules=["query", "value"]))
    assert 2 * forward < lora < 3 * forward
    more_roles = training_flops_per_image(config, LoraSettings(r=16, target_modules=["query", "value", "mlp_in"]))
    assert more_roles > lora


BENCH_ARGS = ("--warmup", "1", "--steps", "3", "--batch-size", "8")


def run_bench(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": python_path(), "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(
        [sys.executable, "-m", "vit_finetune.bench", *BENCH_ARGS, "--cache", str(tmp_path / "cache"), "--out", str(out),
         *args],
        capture_output=True, text=True, timeout=600, env=env, cwd=REPO,
    )
    return result, json.loads(out.read_text()) if out.exists() else None


TRAINING = ("model_step", "end_to_end", "lora", "peer")
LOADERS_ALONE = ("data_ours", "data_peer")


def check_report(report: dict, device_type: str) -> None:
    assert list(report["configs"]) == list(CONFIGS) == [*TRAINING, *LOADERS_ALONE]
    for name, figures in report["configs"].items():
        assert "error" not in figures, f"{name}: {figures.get('error')}"
        assert figures["measured_steps"] == 3 and figures["measured_images"] == 3 * 8
    for name in TRAINING:
        figures = report["configs"][name]
        for key in FIGURES:
            assert figures[key] > 0, f"{name}.{key} = {figures[key]}"
        assert figures["data_wait_share"] < 1
    for name in LOADERS_ALONE:  # no model runs: no FLOPs, no MFU, and the whole window is spent in next()
        figures = report["configs"][name]
        assert figures["mfu"] is None and figures["flops_per_image"] is None
        for key in ("images_per_s", "peak_memory_gib", "step_time_ms", "seconds"):
            assert figures[key] > 0, f"{name}.{key} = {figures[key]}"
        assert 0.9 < figures["data_wait_share"] <= 1
    assert report["device"]["type"] == device_type
    assert report["peak"]["tflops"] > 0 and report["peak"]["source"]
    assert report["setup"]["jpegs"]["train_images"] >= 4 * 8  # one epoch covers warm-up + measured steps
    assert set(report["ratios"]) == {"end_to_end / model_step images/s", "end_to_end / peer images/s",
                                     "lora / end_to_end peak memory", "data_ours / model_step images/s",
                                     "data_ours / data_peer images/s"}
    assert report["configs"]["lora"]["flops_per_image"] < report["configs"]["end_to_end"]["flops_per_image"]


@pytest.mark.slow
def test_bench_command_on_cpu_reports_every_figure(tmp_path, monkeypatch, capsys):
    """The command's main in this process, as `python -m vit_finetune.bench` calls it: a fresh interpreter would add
    only the libraries' import."""
    from vit_finetune.bench import main

    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")  # main sets it for --device cpu; restored after the test
    out = tmp_path / "bench.json"
    code = main([*BENCH_ARGS, "--cache", str(tmp_path / "cache"), "--out", str(out), "--device", "cpu"])
    result = capsys.readouterr()
    assert code == 0, result.err[-4000:]
    report = json.loads(out.read_text())
    check_report(report, "cpu")
    assert report["setup"]["model"] == "tiny"
    assert "float32" in report["peak"]["source"] and "measured" in report["peak"]["source"]
    assert "RSS" in report["memory_measure"]
    assert report["configs"]["peer"]["settings"]["attention"] == "sdpa"
    assert "peer: transformers Trainer" in result.out  # the table is printed, not only written


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bench_command_on_cuda_turns_the_gpu_levers_on(tmp_path):
    result, report = run_bench(tmp_path, "--device", "cuda", "--model", "tiny", "--workers", "2")
    assert result.returncode == 0, result.stderr[-4000:]
    check_report(report, "cuda")
    assert report["memory_measure"] == "torch.cuda.max_memory_allocated"
    assert report["setup"]["precision"] == "bf16"
    for name in ("model_step", "end_to_end", "lora"):  # --compile auto: what a long CUDA run gets, compiled
        settings = report["configs"][name]["settings"]
        assert settings["torch_compile"] and settings["non_blocking_copies"] and settings["pin_memory"]
        assert "fused=True" in settings["optimizer"]
    loader = report["configs"]["data_ours"]["settings"]
    assert loader["pin_memory"] and loader["non_blocking_copies"] and loader["num_workers"] == 2
    assert report["configs"]["peer"]["settings"]["precision"] == "bf16"


@pytest.mark.slow
def test_each_lever_changes_one_setting_of_the_defaults_step(tmp_path, monkeypatch, capsys):
    """--levers: the defaults' model step, then one per lever, each differing from the defaults in the setting it
    names, read off the objects the step trained with. In this process, with a compile backend that skips inductor's
    code generation (its C++ build would be most of the test's time)."""
    from vit_finetune.model import compiling
    from vit_finetune.bench import main

    monkeypatch.setattr(compiling, "BACKEND", "aot_eager_decomp_partition")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")  # main sets it for --device cpu; restored after the test
    out = tmp_path / "bench.json"
    assert main(["--device", "cpu", "--configs", "model_step", "--levers", "all", "--warmup", "1", "--steps", "2",
                 "--batch-size", "4", "--cache", str(tmp_path / "cache"), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    levers = report["levers"]
    assert list(levers) == ["defaults", "compile", "regional_compile", "fused_qkv", "layernorm_cast",
                            "flash_attention", "fused_adamw", "host_sync", "batch"]
    assert levers["defaults"] == report["configs"]["model_step"]  # the same measurement, not a second one
    assert levers["flash_attention"] == {"change": levers["flash_attention"]["change"],
                                         "skipped": "flash_attention runs on cuda only"}  # CUDA only: not measured
    defaults = levers["defaults"]["settings"]
    changed = {name: {key for key, value in figures["settings"].items() if defaults[key] != value}
               for name, figures in levers.items() if name != "defaults" and "settings" in figures}
    compiled = {"torch_compile", "compile_mode", "attention"}
    assert changed == {"compile": compiled, "regional_compile": compiled, "fused_qkv": {"speedups"},
                       "layernorm_cast": {"speedups"}, "fused_adamw": {"optimizer"}, "host_sync": {"finite_check"},
                       "batch": {"batch_size"}}
    assert (defaults["torch_compile"], levers["compile"]["settings"]["attention"]) == (False, compiling.EAGER_SDPA)
    assert (levers["compile"]["settings"]["compile_mode"], levers["regional_compile"]["settings"]["compile_mode"]) == (
        "whole", "regional")
    tiny_blocks = 2
    assert levers["fused_qkv"]["settings"]["speedups"] == {"fused_qkv": tiny_blocks}
    assert levers["layernorm_cast"]["settings"]["speedups"] == {"layernorm_cast": 2 * tiny_blocks + 1}
    assert levers["batch"]["measured_images"] == 2 * defaults["batch_size"] * 2
    assert set(report["lever_ratios"]) == set(changed)
    assert all(ratio["images/s"] > 0 for ratio in report["lever_ratios"].values())
    table = capsys.readouterr().out
    assert all(f"lever: {title}" in table for title in ("model.compile flipped", "each block compiled", "fused qkv",
                                                       "layernorm cast", "AdamW not fused", "NaN check every step",
                                                       "twice the batch"))
    assert "lever: flash attention           skipped: flash_attention runs on cuda only" in table


def tiny_model(model_type: str):
    from tiny import tiny_family_config

    from vit_finetune.model.families import FAMILIES

    torch.manual_seed(0)
    return FAMILIES[model_type].model_class()(tiny_family_config(model_type))


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| over the whole tensor: rounding moves a gradient's small elements by more than their size."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def step_outputs(model, autocast: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The logits of one forward and the gradients of one backward on fixed pixels. Not the key's bias: its gradient
    is zero in exact arithmetic (a softmax does not change when every key moves by the same vector), so what is
    computed there is rounding alone."""
    torch.manual_seed(1)
    pixels = torch.randn(2, 3, model.config.image_size, model.config.image_size)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(pixel_values=pixels).logits
    logits.float().square().sum().backward()
    return logits.detach(), {name: parameter.grad for name, parameter in model.named_parameters()
                             if not name.endswith("k_proj.bias")}


@pytest.mark.parametrize("model_type", ["vit", "deit", "vit_msn", "dinov2", "dinov2_with_registers", "beit"])
def test_fused_qkv_computes_what_the_three_projections_compute(model_type):
    """Each family whose attention is ViT's (speedups.VIT_ATTENTION): one matrix product gives the logits and the
    gradients of the three, to float32 rounding, and under bf16 autocast to bfloat16's; the state dict is as it was."""
    import copy

    from vit_finetune.model import speedups

    for autocast, tolerance in ((False, 1e-5), (True, 2e-2)):
        model = tiny_model(model_type)
        fused = copy.deepcopy(model)
        assert speedups.apply(fused, ["fused_qkv"], "cpu") == {"fused_qkv": model.config.num_hidden_layers}
        assert list(fused.state_dict()) == list(model.state_dict())
        logits, grads = step_outputs(model, autocast)
        fused_logits, fused_grads = step_outputs(fused, autocast)
        assert relative_difference(fused_logits, logits) < tolerance
        differences = {name: relative_difference(fused_grads[name], grad) for name, grad in grads.items()
                       if grad is not None}
        assert max(differences.values()) < tolerance, differences


def test_fused_qkv_leaves_lora_wrapped_projections_alone():
    from vit_finetune.model import speedups
    from vit_finetune.model.lora import apply_lora
    from vit_finetune.recipe import LoraSettings

    model = apply_lora(tiny_model("vit"), LoraSettings(target_modules=["query", "value"]))
    assert speedups.apply(model, ["fused_qkv"], "cpu") == {"fused_qkv": 0}


def test_one_cast_per_layernorm_output_gives_the_same_forward_and_gradients_to_bfloat16_rounding():
    """Under bf16 autocast the projections would cast the LayerNorm's float32 output to bfloat16 themselves: cast
    once before, the forward is bit-identical; the three projections' gradients now add up in bfloat16. Without
    autocast nothing changes at all."""
    import copy

    from vit_finetune.model import speedups

    model = tiny_model("vit")
    cast = copy.deepcopy(model)
    assert speedups.apply(cast, ["layernorm_cast"], "cpu") == {"layernorm_cast": 2 * model.config.num_hidden_layers + 1}
    logits, grads = step_outputs(model, autocast=True)
    cast_logits, cast_grads = step_outputs(cast, autocast=True)
    assert torch.equal(cast_logits, logits)
    differences = {name: relative_difference(cast_grads[name], grad) for name, grad in grads.items()}
    assert 0 < max(differences.values()) < 2e-2, differences  # not bit-identical: the sum is in bfloat16 now
    model.zero_grad(), cast.zero_grad()
    logits, grads = step_outputs(model, autocast=False)
    cast_logits, cast_grads = step_outputs(cast, autocast=False)
    assert torch.equal(cast_logits, logits) and all(torch.equal(cast_grads[name], grads[name]) for name in grads)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the flash kernel is PyTorch's CUDA kernel (the "
                    "CPU refuses the lever: the test below)")
@pytest.mark.parametrize("compiled", [False, True])
def test_the_flash_attention_lever_runs_the_flash_kernel_forward_and_backward_on_cuda(compiled):
    """bf16 on the GPU, eager or each block compiled: the profiler sees PyTorch's flash attention op and its
    backward, no other attention kernel; the other two speed-ups on the same step still compute the same loss."""
    import torch._dynamo

    from vit_finetune.model import compiling, speedups

    def loss_of(model) -> torch.Tensor:
        torch.manual_seed(1)
        pixels = torch.randn(8, 3, model.config.image_size, model.config.image_size, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return model(pixel_values=pixels).logits.float().square().mean()

    reference = loss_of(tiny_model("vit").cuda()).item()
    model = tiny_model("vit").cuda()
    assert speedups.apply(model, list(speedups.SPEEDUPS), "cuda") == {
        "fused_qkv": 2, "layernorm_cast": 5, "flash_attention": 1}
    torch._dynamo.reset()
    try:
        if compiled:
            model, said = compiling.compile_for_training(model, "regional")
            assert "outside the compiled graph" in said
        loss_of(model).backward()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as profiler:
            loss = loss_of(model)
            loss.backward()
            torch.cuda.synchronize()
    finally:
        torch._dynamo.reset()
    ran = {event.name for event in profiler.events() if "attention" in event.name}
    assert {"aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_flash_attention_backward"} <= ran
    assert not {"aten::_scaled_dot_product_cudnn_attention", "aten::_scaled_dot_product_efficient_attention"} & ran
    assert loss.item() == pytest.approx(reference, rel=2e-2)


def test_a_speedup_for_another_device_is_refused_by_name():
    from vit_finetune.model import speedups

    with pytest.raises(ValueError, match="flash_attention runs on cuda only"):
        speedups.apply(tiny_model("vit"), ["flash_attention"], "cpu")


def forked(argv: list[str], env: dict[str, str], log: Path) -> int:
    """whole_job.fresh_process's stand-in: the side runs in a fork of this process, which has imported the libraries
    already (a fresh interpreter spends ~15 CPU-seconds importing them here). The side's code and its marks are the
    same; the GPU's measurement starts each side in a fresh interpreter."""
    import traceback

    from vit_finetune.bench import whole_job

    pid = os.fork()
    if pid == 0:  # the child: its output to the log, as a fresh process's would go
        code = 1
        try:
            with open(log, "w") as out:
                os.dup2(out.fileno(), 1), os.dup2(out.fileno(), 2)
                os.environ.update(env)
                code = whole_job.main(argv)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.mark.slow
def test_the_whole_job_times_both_sides_from_start_to_exit_and_splits_the_time_into_phases(tmp_path, monkeypatch,
                                                                                           capsys):
    """The main recipe's job against the Trainer's, on parquet shards in the Hub's layout: each side trains 2 epochs,
    evaluates after each, checkpoints and saves, and the phases it passed through add up to its wall time."""
    from vit_finetune.bench import whole_job

    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    out = tmp_path / "whole_job.json"
    code = whole_job.main(["--device", "cpu", "--images", "32", "--eval-images", "8", "--batch-size", "8",
                           "--cache", str(tmp_path / "cache"), "--work", str(tmp_path / "work"), "--out", str(out),
                           "--ours", "pictures=false"], launch=forked)
    printed = capsys.readouterr().out
    assert code == 0, printed[-3000:]
    report = json.loads(out.read_text())
    for side, result in report["sides"].items():
        assert result["exit_code"] == 0 and result["steps"] == 2 * 4, side  # 32 images / batch 8, 2 epochs
        assert sum(result["phases_s"].values()) == pytest.approx(result["wall_s"])
        assert sum(result["groups_s"].values()) == pytest.approx(result["wall_s"])
        assert all(seconds >= 0 for seconds in result["phases_s"].values())
        assert result["phases_s"]["evaluation"] > 0 and result["phases_s"]["checkpoints"] > 0
    ours, peer = report["sides"]["ours"], report["sides"]["peer"]
    assert (ours["evaluations"], peer["evaluations"]) == (2, 3)  # the example evaluates once more, at its end
    assert report["ours / peer wall time"] == pytest.approx(ours["wall_s"] / peer["wall_s"])
    work = tmp_path / "work"
    assert sorted(path.name for path in (work / "ours" / "checkpoints").iterdir()) == ["step-00000004", "step-00000008"]
    assert (work / "ours" / "model.safetensors").exists() and (work / "peer" / "model.safetensors").exists()
    assert sorted(path.name for path in (work / "peer").glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-8"]
    recipe = (work / "ours" / "recipe.yaml").read_text()
    assert "optimizer: sgd" in recipe and "grad_accum: 1" in recipe  # the main recipe, sized for the job
    assert "ours / peer wall time:" in printed and "start-up and compile" in printed
    from vit_finetune.bench import summary

    summarised = summary.summary(tmp_path)  # what `bash scripts/bench_gpu.sh all` prints last
    assert f"the whole job in {report['ours / peer wall time']:.3f}x the Trainer's wall time" in summarised
    assert "== compile_cost.json\nmissing" in summarised


@pytest.mark.slow
def test_the_inference_bench_times_evaluation_and_predict_against_the_trainer_and_pipeline(tmp_path, monkeypatch,
                                                                                          capsys):
    """Both evaluations read the same validation split of the shards and both predictions the same files, each timed
    twice; the ratios are those of the second passes."""
    from vit_finetune.bench import inference

    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    out = tmp_path / "inference.json"
    code = inference.main(["--device", "cpu", "--images", "16", "--eval-images", "12", "--predict-images", "10",
                           "--batch-size", "4", "--workers", "0", "--cache", str(tmp_path / "cache"),
                           "--out", str(out)])
    assert code == 0, capsys.readouterr().err[-3000:]
    report = json.loads(out.read_text())
    images = {name: report[name]["images"] for name in ("evaluation_ours", "evaluation_peer", "predict_ours",
                                                        "predict_pipeline")}
    assert images == {"evaluation_ours": 12, "evaluation_peer": 12, "predict_ours": 10, "predict_pipeline": 10}
    for name in images:
        assert len(report[name]["seconds"]) == 2 and all(rate > 0 for rate in report[name]["images_per_s"])
    second = {name: report[name]["images_per_s"][1] for name in images}
    assert report["ratios"] == {
        "evaluation: ours / Trainer.evaluate images/s": pytest.approx(second["evaluation_ours"] / second["evaluation_peer"]),
        "predict: ours / pipeline() images/s": pytest.approx(second["predict_ours"] / second["predict_pipeline"])}
    assert report["evaluation_ours"]["settings"]["compile"] is False  # auto, for a run this short
    from vit_finetune.bench import summary

    ratio = report["ratios"]["predict: ours / pipeline() images/s"]
    assert f"predict: ours / pipeline() images/s {ratio:.3f} (goal >= 2)" in summary.summary(tmp_path)


SCRIPT_MODULES = {"all": {"pytest", "vit_finetune.bench.compile_cost", "vit_finetune.bench.whole_job",
                          "vit_finetune.bench.inference", "vit_finetune.bench", "vit_finetune.bench.summary"},
                  "more": {"vit_finetune.bench", "vit_finetune"}}


@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("target", ["all", "more"])
def test_every_command_of_the_gpu_script_is_one_its_module_accepts(target, device, tmp_path):
    """scripts/bench_gpu.sh runs on a GPU machine only now and then: each command it would run there (and in its
    CPU dry run) is parsed here by the module it starts, so that a renamed option fails here, not on the card."""
    import importlib
    import shlex

    from vit_finetune.recipe import load_recipe

    printed = subprocess.run(["bash", "scripts/bench_gpu.sh", target], capture_output=True, text=True, cwd=REPO,
                             env={**os.environ, "PLAN": device, "OUT": str(tmp_path)}, timeout=60)
    assert printed.returncode == 0, printed.stderr
    commands = [shlex.split(line) for line in printed.stdout.splitlines()]
    assert {command[:2] == ["python3", "-m"] for command in commands} == {True}
    assert {command[2] for command in commands} == SCRIPT_MODULES[target]
    for _, _, module, *args in commands:
        if module == "pytest":
            assert all((REPO / arg).is_file() for arg in args if arg.startswith("tests/"))
        elif module == "vit_finetune":
            load_recipe(None, args)  # raises, naming the key, for an override the schema refuses
        else:  # exits, naming the option, for one the module does not know
            importlib.import_module("vit_finetune.bench.cli" if module == "vit_finetune.bench" else module).parse_args(args)
