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
import torch._dynamo
import yaml

from runs import assert_bit_identical, completed, exists, history, launch_and_kill, losses, train
from tiny import TINY_FAMILIES, tiny_family_config
from vit_finetune.artifacts.callbacks import Callback

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


def test_bf16_autocast_trains_and_a_run_killed_under_it_resumes_bit_identical(args, warm_launcher, tmp_path):
    reference, seen = tmp_path / "reference", Observe()
    run = [*args, *ONE_EPOCH, "train.mixed_precision=bf16", "train.checkpoint_every_steps=2"]
    assert train([*run, f"output_dir={reference}"], callbacks=[seen]) == 0
    assert seen.linear_dtypes == {torch.bfloat16}  # every training forward ran under bf16 autocast
    assert json.loads((reference / "run_info.json").read_text())["mixed_precision"] == "bf16"
    from safetensors.torch import load_file

    # autocast computes in bf16; the weights, the optimiser and the saved model stay float32
    assert {tensor.dtype for tensor in load_file(str(reference / "model.safetensors")).values()} == {torch.float32}

    out = tmp_path / "out"
    killed = launch_and_kill(warm_launcher, [*run, f"output_dir={out}"], tmp_path / "r1", exists(completed(out, 2)),
                             tmp_path / "1.log")
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
                    "(the CPU refusal is tested above; the loss scaler's skipped steps in test_loss_scale.py)")
def test_fp16_autocast_trains_in_float16_with_a_loss_scaler(args, tmp_path):
    seen = Observe()
    out = tmp_path / "out"
    assert train([*args, *ONE_EPOCH, "train.mixed_precision=fp16", f"output_dir={out}"], callbacks=[seen]) == 0
    assert seen.linear_dtypes == {torch.float16}
    trained = losses(out)
    assert len(trained) == 6 and all(map(torch.isfinite, torch.tensor([loss for _step, loss in trained])))


# ---------------------------------------------------------------- torch.compile

# What PyTorch's math attention decomposes into (the graph the H200 ran at 0.57x eager): batched matrix products and
# a softmax; a ViT has neither outside its attention (its Linear layers are mm/addmm, its loss is outside the model).
DECOMPOSED_ATTENTION = {"aten.bmm.default", "aten._softmax.default", "aten._safe_softmax.default"}
FUSED_ATTENTION = {"aten::_scaled_dot_product_flash_attention_for_cpu",
                   "aten::_scaled_dot_product_flash_attention_for_cpu_backward"}


def recording_backend(graphs: list):
    """torch.compile's backend as inductor sees the model: AOT autograd's forward and backward graphs with inductor's
    decompositions, recorded, then run as they are (no code generated: the graphs are the subject, and cheap)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    def record(graph, _inputs):
        graphs.append(graph)
        return make_boxed_func(graph.forward)

    return aot_autograd(fw_compiler=record, bw_compiler=record, decompositions=select_decomp_table())


def test_the_compiled_training_graph_keeps_the_fused_attention(base):
    """On an H200 the compiled graph ran attention on PyTorch's float32 math path, a choice the compiler bakes into the
    graph while it traces. Here the trace happens under a math-only policy, standing in for whatever made that choice
    there; the steps after it run under PyTorch's default policy, as a run does. Attention must not be in the graphs,
    and must run the fused kernel, forward and backward."""
    import torch._dynamo
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import ViTForImageClassification

    from vit_finetune.model.compiling import compile_for_training

    model = ViTForImageClassification.from_pretrained(base)
    graphs: list = []
    torch._dynamo.reset()
    try:
        compiled, said = compile_for_training(model, backend=recording_backend(graphs))
        pixels = torch.randn(2, 3, 32, 32)

        def training_step():
            with torch.autocast("cpu", dtype=torch.bfloat16):  # as a bf16 run's forward
                logits = compiled(pixel_values=pixels).logits
            logits.float().sum().backward()

        with sdpa_kernel([SDPBackend.MATH]):
            training_step()  # traces and compiles
        with torch.profiler.profile() as profiler:
            training_step()
    finally:
        torch._dynamo.reset()
    in_graphs = {str(node.target) for graph in graphs for node in graph.graph.nodes if node.op == "call_function"}
    assert "aten.addmm.default" in in_graphs or "aten.mm.default" in in_graphs  # the blocks' layers were compiled
    assert not in_graphs & DECOMPOSED_ATTENTION
    ran = {event.name for event in profiler.events()}
    assert FUSED_ATTENTION <= ran
    assert not {"aten::bmm", "aten::_softmax", "aten::_safe_softmax"} & ran
    assert "outside the compiled graph" in said


def test_regional_compile_compiles_the_blocks_in_place_once_for_all_and_steps_as_eager(tmp_path, monkeypatch):
    """model.compile=regional: each block compiled in place (the model and its state dict unchanged: checkpoints and
    the saved model read as an eager one's), its attention kept out of the graphs, one compiled code for all blocks
    (as many graphs for 4 blocks as for 2), and a training step's loss and gradients those of eager, to float32
    rounding. AOT autograd's graphs with inductor's decompositions, run as they are (no code generated)."""
    import copy

    from transformers import ViTConfig, ViTForImageClassification

    from vit_finetune.model import compiling

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    graphs_for: dict[int, int] = {}
    for layers in (2, 4):
        torch.manual_seed(0)
        model = ViTForImageClassification(ViTConfig(hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                                                    intermediate_size=64, image_size=32, patch_size=8, num_labels=3))
        eager, keys = copy.deepcopy(model), list(model.state_dict())
        graphs: list = []
        torch._dynamo.reset()
        try:
            compiled, said = compiling.compile_for_training(model, "regional", backend=recording_backend(graphs))
            pixels, labels = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 0])
            losses = []
            for network in (compiled, eager):
                loss = network(pixel_values=pixels, labels=labels).loss
                loss.backward()
                losses.append(loss.item())
        finally:
            torch._dynamo.reset()
        assert compiled is model and list(model.state_dict()) == keys
        assert f"{layers} blocks compiled one by one (ViTLayer)" in said and "outside the compiled graph" in said
        assert str(tmp_path / "cache") in said  # the cache a user set is kept
        in_graphs = {str(node.target) for graph in graphs for node in graph.graph.nodes if node.op == "call_function"}
        assert "aten.mm.default" in in_graphs or "aten.addmm.default" in in_graphs
        assert not in_graphs & DECOMPOSED_ATTENTION
        graphs_for[layers] = len(graphs)
        assert losses[0] == pytest.approx(losses[1], rel=1e-6)
        for (name, compiled_parameter), eager_parameter in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(compiled_parameter.grad, eager_parameter.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert graphs_for[4] == graphs_for[2] > 0


def test_compiled_code_is_cached_under_the_toolkits_cache_unless_the_user_chose_a_folder(tmp_path, monkeypatch):
    from vit_finetune.model import compiling

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("VIT_FINETUNE_CACHE", str(tmp_path / "toolkit"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert compiling.use_compile_cache() == str(tmp_path / "toolkit" / compiling.COMPILE_CACHE)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # what torch writes there itself
    assert compiling.use_compile_cache() == str(tmp_path / "toolkit" / compiling.COMPILE_CACHE)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert compiling.use_compile_cache() == str(tmp_path / "mine")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the CPU form is the test above (on a CPU the "
                    "compiler never chose the math path)")
@pytest.mark.parametrize("mode", ["whole", "regional"])
def test_a_compiled_cuda_training_step_runs_the_fused_attention_kernels(base, mode):
    """The H200's failure itself: inductor's compiled step, bf16, on the GPU, the whole model or each block. The
    profiler must see one of PyTorch's fused attention ops, and none of the math path's batched products or softmax
    kernels."""
    import torch._dynamo
    from transformers import ViTForImageClassification

    from vit_finetune.model.compiling import compile_for_training

    model = ViTForImageClassification.from_pretrained(base).cuda()
    pixels = torch.randn(8, 3, 32, 32, device="cuda")
    torch._dynamo.reset()
    try:
        compiled, _ = compile_for_training(model, mode)

        def training_step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = compiled(pixel_values=pixels).logits
            logits.float().sum().backward()

        training_step()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as profiler:
            training_step()
            torch.cuda.synchronize()
    finally:
        torch._dynamo.reset()
    ran = {event.name for event in profiler.events()}
    fused = {"aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
             "aten::_scaled_dot_product_cudnn_attention"}
    assert ran & fused, sorted(name for name in ran if "attention" in name or "bmm" in name)
    assert "aten::bmm" not in ran and not any("softmax" in name for name in ran)


@pytest.mark.parametrize("model_type", sorted(TINY_FAMILIES))
def test_each_family_says_whether_its_attention_stays_out_of_the_compiled_graph(model_type, monkeypatch):
    """Families whose attention goes through transformers' attention interface run it outside the graph (each of
    their blocks calls the kept-out function once a forward); the others are compiled whole, and the run says why."""
    from transformers import AttentionInterface

    from vit_finetune.model import compiling
    from vit_finetune.model.families import FAMILIES

    family = FAMILIES[model_type]
    model = family.model_class()(tiny_family_config(model_type))
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return compiling.sdpa_outside_compile(*args, **kwargs)

    AttentionInterface.register(compiling.EAGER_SDPA, counted)
    try:
        _compiled, said = compiling.compile_for_training(model)
        model(pixel_values=torch.randn(1, 3, 32, 32))  # the model itself, eagerly: compiling it is not the subject
    finally:
        AttentionInterface.register(compiling.EAGER_SDPA, compiling.sdpa_outside_compile)
    kept_out = model_type not in ("data2vec-vision", "swinv2")  # calls PyTorch's SDPA itself; has no SDPA at all
    assert len(calls) == (family.num_blocks(model.config) if kept_out else 0)
    assert ("outside the compiled graph" in said) == kept_out


def test_model_compile_true_runs_compiled_on_cpu_and_trains_like_eager(args, tmp_path, monkeypatch):
    """The command's compile path: dynamo, AOT autograd and inductor's decompositions, with the graphs run as they
    are rather than through inductor's C++ code generation, which cost ~40 s of this test's CPU on a cold cache (the
    GPU's bench measures inductor's code: bash scripts/bench_gpu.sh all)."""
    import torch._dynamo

    from vit_finetune.model import compiling

    monkeypatch.setattr(compiling, "BACKEND", "aot_eager_decomp_partition")
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
    # The kept-out attention is a name of this process only: the saved model is an ordinary SDPA model.
    assert "attn_implementation" not in (compiled / "config.json").read_text()


# ---------------------------------------------------------------- no wait for the device inside a step


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: on a CPU nothing waits for a device; "
                    "test_faults.py counts the calls that would wait")
def test_cuda_steps_between_logs_never_wait_for_the_gpu(args, tmp_path, capsys):
    """PyTorch raises on any host-device synchronisation while its sync debug mode says so: on from the end of step 1
    to the end of step 4 (no log, evaluation or checkpoint falls there), the run must not notice it."""
    class SynchronisingIsAnError(Callback):
        def on_step_end(self, run):
            torch.cuda.set_sync_debug_mode("error" if run.state.step in (1, 2, 3) else "default")

    run = [*args, "train.max_steps=5", "train.log_every_steps=5", "train.mixed_precision=bf16",
           f"output_dir={tmp_path / 'out'}"]
    try:
        code = train(run, callbacks=[SynchronisingIsAnError()])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert code == 0, capsys.readouterr().err[-3000:]


# ---------------------------------------------------------------- the optimiser per device


def test_adamw_is_fused_on_cpu_and_cuda_and_steps_as_the_per_tensor_loop_does(base, tmp_path):
    """Both devices ask for PyTorch's fused AdamW. On the same groups (lr scales, no decay on norms) its update must
    be the one the per-tensor loop (PyTorch's CPU default) computes, to float32 rounding."""
    from vit_finetune.model.loading import build_model
    from vit_finetune.recipe import load_recipe
    from vit_finetune.training.optim import build_optimizer

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


def test_a_default_cpu_run_steps_the_fused_adamw_uncompiled_and_says_why(args, tmp_path, capsys):
    seen, out = Observe(), tmp_path / "out"
    assert train([*args, "train.max_steps=1", f"output_dir={out}"], callbacks=[seen]) == 0
    assert isinstance(seen.optimizer, torch.optim.AdamW) and seen.optimizer.defaults["fused"]
    assert seen.linear_dtypes == {torch.float32}  # train.mixed_precision=no: no autocast
    # model.compile=auto: off on a CPU, as measured; the reason printed, the choice saved as the run made it.
    assert not isinstance(seen.model, torch._dynamo.eval_frame.OptimizedModule)
    assert "model.compile=auto -> false: on a CPU the demo recipe trained" in capsys.readouterr().out
    assert yaml.safe_load((out / "recipe.yaml").read_text())["model"]["compile"] is False


def test_model_compile_auto_compiles_a_single_process_cuda_run_once_the_measured_compile_pays_back():
    """auto's rule from the measured costs (compiling.MEASURED): the H200's whole-model compile of ViT-B/16 at 384 px
    (17 s, 1.12x eager's 902 images/s) pays back after 17 / ((1 - 1/1.12) / 902) = 143,120 training images, and
    auto waits for twice that; a base with half the work per image runs eager twice as fast, so it waits for twice
    as many images. Off where nothing was measured, with the reason."""
    from vit_finetune.model.compiling import VIT_B16_384_WORK, CompileFacts, auto_compile

    vit_b = CompileFacts(work_per_image=VIT_B16_384_WORK)
    enough = 2 * 17 / ((1 - 1 / 1.12) / 902)
    assert auto_compile("cuda", False, int(enough) + 1, processes=1, facts=vit_b)[0] is True
    short, why = auto_compile("cuda", False, int(enough) - 1, processes=1, facts=vit_b)
    assert not short and f"this run sees {int(enough) - 1:,}" in why and "1.12x" in why
    assert "the 143,000 training images that pay it back" in why and "(286,000;" in why
    assert "regional compilation not measured on cuda" in why  # until the GPU measures it
    half = CompileFacts(work_per_image=VIT_B16_384_WORK / 2)
    assert not auto_compile("cuda", False, int(1.9 * enough), processes=1, facts=half)[0]
    assert auto_compile("cuda", False, int(2.1 * enough), processes=1, facts=half)[0] is True
    several, why = auto_compile("cuda", False, int(10 * enough), processes=2, facts=vit_b)
    assert not several and "2 processes were not measured compiled" in why
    own, why = auto_compile("cuda", False, int(10 * enough), processes=1,
                            facts=CompileFacts("X calls its own attention", VIT_B16_384_WORK))
    assert not own and why.startswith("X calls its own attention, so compiled, its attention would be traced")
    unestimated, why = auto_compile("cuda", False, int(10 * enough), processes=1, facts=CompileFacts())
    assert not unestimated and "work per image is not estimated" in why  # a Swin: its stages merge patches
    assert not auto_compile("cuda", True, int(10 * enough), processes=1, facts=vit_b)[0]  # sharded: Accelerate's
    assert not auto_compile("cpu", False, int(10 * enough), processes=1, facts=vit_b)[0]
    assert auto_compile("mps", False, 10**8, processes=1, facts=vit_b) == (False, "compiling was never measured on mps")


def test_auto_chooses_the_measured_mode_that_saves_the_run_the_most_time(monkeypatch):
    """With two modes measured, a short run takes the cheap compile and a long one the faster step."""
    from vit_finetune.model import compiling

    monkeypatch.setitem(compiling.MEASURED, ("cuda", "regional"), compiling.CompileCost(
        "a card", compile_seconds=2.0, speedup=1.05, eager_images_per_s=1000.0,
        work_per_image=compiling.VIT_B16_384_WORK, memory=0.9))
    vit_b = compiling.CompileFacts(work_per_image=compiling.VIT_B16_384_WORK)
    short, why = compiling.auto_compile("cuda", False, 100_000, processes=1, facts=vit_b)
    assert short == "regional" and "not measured" not in why and "estimated to save" in why
    assert compiling.auto_compile("cuda", False, 10_000_000, processes=1, facts=vit_b)[0] is True
    assert not compiling.auto_compile("cuda", False, 50_000, processes=1, facts=vit_b)[0]


@pytest.mark.parametrize("images_seen, processes, attention_compiled, compiled", [
    (3_000_000, 1, None, True), (200_000, 1, None, False), (3_000_000, 4, None, False),
    (3_000_000, 1, "Data2Vec-vision calls PyTorch's attention itself", False)])
def test_the_plan_gives_model_compile_auto_the_runs_size_and_processes(images_seen, processes, attention_compiled,
                                                                        compiled, capsys):
    """Through plan_run: the images the run sees, its processes and the base's attention reach the rule. No CUDA device exists here, so
    the accelerator is a stand-in with the five attributes the plan reads; the recipe and the plan are the real ones."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from vit_finetune.model.compiling import VIT_B16_384_WORK, CompileFacts
    from vit_finetune.training.plan import RunSize, plan_run
    from vit_finetune.recipe import load_recipe
    from vit_finetune.tasks import SingleLabel

    cuda = SimpleNamespace(device=torch.device("cuda"), num_processes=processes, mixed_precision="bf16",
                           is_main_process=True,
                           distributed_type=DistributedType.MULTI_GPU if processes > 1 else DistributedType.NO)
    size = RunSize(images_seen=images_seen, training_images=75_000, classes=101, eval_images=25_000,
                   steps_per_epoch=1_000, total_steps=images_seen // 75, base_parameters=86_000_000)
    recipe = load_recipe(None, ["train.method=finetune", "train.batch_size=75", "train.mixed_precision=bf16"])
    facts = CompileFacts(attention_compiled, VIT_B16_384_WORK)
    assert plan_run(recipe, size, cuda, SingleLabel(), compile_facts=facts).model.compile is compiled
    said = capsys.readouterr().out
    assert f"model.compile=auto -> {str(compiled).lower()}: {attention_compiled or 'on a GPU the whole model'}" in said


def test_a_base_whose_attention_cannot_be_kept_out_is_known_before_it_is_built(tmp_path):
    """The base built from its config on the meta device (what the plan reads before the run builds the model) tells
    whether its attention can be kept out: Data2Vec-vision calls PyTorch's attention itself, ViT goes through
    transformers' interface; the plan hands the answer to model.compile=auto (test above)."""
    from vit_finetune.model.compiling import why_attention_is_compiled
    from vit_finetune.model.loading import base_on_meta
    from vit_finetune.recipe import ModelSettings

    for model_type in ("data2vec-vision", "vit"):
        tiny_family_config(model_type).save_pretrained(tmp_path / model_type)
    assert "Data2Vec-vision calls PyTorch's attention itself" in why_attention_is_compiled(
        base_on_meta(ModelSettings(base=str(tmp_path / "data2vec-vision"))).model)
    assert why_attention_is_compiled(base_on_meta(ModelSettings(base=str(tmp_path / "vit"))).model) is None


def test_the_work_per_image_auto_scales_by_is_read_off_the_base_on_the_meta_device():
    """ViT-B/16 at 384 px is the measured model's own work; at 224 px a third of it (196 patches of 576); a Swin,
    whose stages merge patches, is not estimated."""
    from transformers import SwinConfig, SwinForImageClassification, ViTForImageClassification

    from vit_finetune.bench import MODELS
    from vit_finetune.model.compiling import VIT_B16_384_WORK, facts_of

    with torch.device("meta"):
        vit_b = ViTForImageClassification(MODELS["vit-b16-384"].vit_config())
        swin = SwinForImageClassification(SwinConfig(embed_dim=16, depths=[1, 1], num_heads=[1, 1]))
    assert facts_of(vit_b, 384).work_per_image == VIT_B16_384_WORK
    assert facts_of(vit_b, 224).work_per_image == VIT_B16_384_WORK * 196 / 576
    assert facts_of(swin, 224).work_per_image is None and facts_of(swin, 224).attention_compiled is None


def test_model_compile_null_reads_as_auto_as_earlier_versions_wrote_it():
    from vit_finetune.recipe import load_recipe

    assert load_recipe("demo", ["model.compile=null"]).model.compile == "auto"
    assert load_recipe("demo", []).model.compile == "auto"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the fused AdamW is checked on CPU above (same "
                    "groups); here it runs on the device the recipe trains on")
def test_a_cuda_run_steps_the_fused_adamw(args, tmp_path):
    seen = Observe()
    assert train([*args, "train.max_steps=1", f"output_dir={tmp_path / 'out'}"], callbacks=[seen]) == 0
    assert seen.optimizer.defaults["fused"] and next(seen.model.parameters()).is_cuda
