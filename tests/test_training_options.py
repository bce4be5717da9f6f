"""Training options for small data, piece by piece: layer-wise lr decay, EMA of the weights, class balance,
per-class recall and stochastic depth. Whole runs with them are in tests/test_keep_best.py."""

from __future__ import annotations

import re
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import Dinov2Config, Dinov2ForImageClassification, ViTConfig, ViTForImageClassification

from vit_finetune.data import balance
from vit_finetune.model import loading as vit
from vit_finetune.model.families import FAMILIES
from vit_finetune.model.lora import apply_lora
from vit_finetune.recipe import LoraSettings, ModelSettings, RecipeError, load_recipe
from vit_finetune.tasks import SingleLabel
from vit_finetune.training import ema, loop, optim, train_step

LAYERS = 3


def tiny_vit() -> ViTForImageClassification:
    torch.manual_seed(0)
    return ViTForImageClassification(ViTConfig(hidden_size=16, num_hidden_layers=LAYERS, num_attention_heads=2,
                                               intermediate_size=32, image_size=16, patch_size=4, num_labels=3))


def expected_depth(name: str) -> int:
    """The BEiT/MAE convention, written out for the ViT names: embeddings 0, block i i+1, the rest L+1."""
    block = re.search(r"\.layers\.(\d+)\.", name)
    if block:
        return int(block.group(1)) + 1
    return 0 if ".embeddings." in name else LAYERS + 1


def lr_of_each_parameter(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> dict[str, float]:
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    return {name: group_of[id(p)]["lr"] for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("lora", [False, True])
def test_layer_decay_gives_each_parameter_base_lr_times_decay_to_its_distance_from_the_head(lora):
    model = tiny_vit()
    if lora:
        model = apply_lora(model, LoraSettings(r=2, target_modules=["query", "value", "mlp_in"]))
    recipe = load_recipe(None, ["train.lr=0.1", "train.head_lr=0.1", "train.layer_decay=0.5", "train.weight_decay=0.05",
                                "train.warmup_steps=2", "train.scheduler=cosine"])
    optimizer = optim.build_optimizer(model, recipe, "cpu")
    lrs = lr_of_each_parameter(optimizer, model)
    assert {name: lr for name, lr in lrs.items()} == pytest.approx(
        {name: 0.1 * 0.5 ** (LAYERS + 1 - expected_depth(name)) for name in lrs}, rel=1e-12)
    depths = {expected_depth(name) for name in lrs}
    assert depths == ({1, 2, 3, 4} if lora else {0, 1, 2, 3, 4})  # LoRA: adapters in blocks, head; no embeddings
    if lora:
        assert all(expected_depth(n) in (1, 2, 3) for n in lrs if "lora_" in n)
        assert any("lora_" in n for n in lrs)

    # The schedule scales every group by the same factor, each from its own base lr.
    scheduler = optim.build_scheduler(optimizer, recipe, total_steps=10)
    for step in range(1, 6):
        optimizer.step()
        scheduler.step()
        factor = scheduler.lr_lambdas[0](step)
        assert lr_of_each_parameter(optimizer, model) == pytest.approx(
            {name: 0.1 * 0.5 ** (LAYERS + 1 - expected_depth(name)) * factor for name in lrs}, rel=1e-12)


def test_a_resume_that_accepts_a_new_lr_reapplies_it_to_every_depth():
    model = tiny_vit()
    before = load_recipe(None, ["train.lr=0.1", "train.head_lr=0.1", "train.layer_decay=0.5", "train.weight_decay=0.05",
                                "train.warmup_steps=0"])
    optimizer = optim.build_optimizer(model, before, "cpu")
    scheduler = optim.build_scheduler(optimizer, before, total_steps=10)
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    # What a resume loads: the checkpoint's optimizer and scheduler states, into fresh ones.
    after = load_recipe(None, ["train.lr=0.3", "train.head_lr=0.3", "train.layer_decay=0.5", "train.weight_decay=0.01",
                               "train.warmup_steps=0"])
    resumed = optim.build_optimizer(model, after, "cpu")
    resumed.load_state_dict(optimizer.state_dict())
    resumed_scheduler = optim.build_scheduler(resumed, after, total_steps=10)
    resumed_scheduler.load_state_dict(scheduler.state_dict())
    optim.reapply_hyperparameters(resumed, resumed_scheduler, after)
    factor = resumed_scheduler.lr_lambdas[0](3)
    lrs = lr_of_each_parameter(resumed, model)
    assert lrs == pytest.approx({n: 0.3 * 0.5 ** (LAYERS + 1 - expected_depth(n)) * factor for n in lrs}, rel=1e-12)
    assert {g["weight_decay"] for g in resumed.param_groups} == {0.01, 0.0}


def test_layer_decay_keeps_the_weight_decay_split():
    model = tiny_vit()
    recipe = load_recipe(None, ["train.layer_decay=0.8", "train.weight_decay=0.05", "train.lr=2e-5",
                                "train.head_lr=2e-3"])
    optimizer = optim.build_optimizer(model, recipe, "cpu")
    decay_of = {id(p): group["weight_decay"] for group in optimizer.param_groups for p in group["params"]}
    for name, parameter in model.named_parameters():
        matrix = parameter.ndim >= 2 and not name.endswith(("cls_token", "position_embeddings"))
        assert decay_of[id(parameter)] == (0.05 if matrix else 0.0), name
    # The head's group leads; the lr the log reports is still train.lr, not the head's own.
    assert optimizer.param_groups[0]["lr"] == 2e-3
    run = SimpleNamespace(parts=SimpleNamespace(optimizer=optimizer))
    assert loop._scheduled_lr(run) == pytest.approx(2e-5, rel=1e-12)


def test_without_layer_decay_there_are_two_groups_at_the_base_lr():
    model = tiny_vit()
    optimizer = optim.build_optimizer(model, load_recipe(None, ["train.lr=0.01", "train.head_lr=0.01",
                                                                "train.weight_decay=0.1"]), "cpu")
    assert [(g["weight_decay"], g["lr"]) for g in optimizer.param_groups] == [(0.1, 0.01), (0.0, 0.01)]
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(model.parameters()))


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("layer_decay", [None, 0.5])
def test_the_new_head_trains_at_head_lr_over_lr_times_the_lr_of_its_depth(lora, layer_decay):
    model = tiny_vit()
    if lora:  # peft renames the head base_model.model.classifier.modules_to_save.default.*
        model = apply_lora(model, LoraSettings(r=2, target_modules=["query", "value"]))
    overrides = ["train.lr=0.1", "train.head_lr=3", "train.weight_decay=0.05", "train.warmup_steps=2"]
    recipe = load_recipe(None, overrides + ([f"train.layer_decay={layer_decay}"] if layer_decay else []))
    optimizer = optim.build_optimizer(model, recipe, "cpu")
    lrs = lr_of_each_parameter(optimizer, model)

    def expected(name: str) -> float:
        depth_scale = layer_decay ** (LAYERS + 1 - expected_depth(name)) if layer_decay else 1.0
        return 0.1 * depth_scale * (30 if re.search(r"(^|\.)classifier\.", name) else 1)
    assert sum("classifier." in name for name in lrs) == 2  # the head's weight and bias, both found
    assert lrs == pytest.approx({name: expected(name) for name in lrs}, rel=1e-12)

    # The schedule keeps the ratio, and what the log reports as the run's lr is train.lr times the schedule.
    scheduler = optim.build_scheduler(optimizer, recipe, total_steps=10)
    optimizer.step()
    scheduler.step()
    factor = scheduler.lr_lambdas[0](1)
    assert lr_of_each_parameter(optimizer, model) == pytest.approx({n: expected(n) * factor for n in lrs}, rel=1e-12)
    run = SimpleNamespace(parts=SimpleNamespace(optimizer=optimizer))
    assert loop._scheduled_lr(run) == pytest.approx(0.1 * factor, rel=1e-12)


def test_a_head_lr_equal_to_the_lr_leaves_the_two_groups_of_a_plain_run():
    model = tiny_vit()
    recipe = load_recipe(None, ["train.lr=0.01", "train.weight_decay=0.1", "train.head_lr=0.01"])
    optimizer = optim.build_optimizer(model, recipe, "cpu")
    assert [(g["weight_decay"], g["lr"]) for g in optimizer.param_groups] == [(0.1, 0.01), (0.0, 0.01)]


def test_auto_head_lr_raises_an_adamw_head_to_its_floor_and_leaves_sgd_and_high_lrs_alone():
    floor = optim.AUTO_HEAD_LR_ADAMW
    assert optim.auto_head_lr("adamw", 2e-5)[0] == floor
    assert optim.auto_head_lr("adamw", floor * 5)[0] == floor * 5  # raised, never lowered
    lr, why = optim.auto_head_lr("sgd", 0.01)
    assert lr == 0.01 and "AdamW only" in why


def test_auto_lr_follows_the_base_size_is_larger_for_lora_and_refused_for_sgd():
    assert optim.auto_lr(False, 22_000_000)[0] == 2e-5  # measured on a 22M-parameter DINOv2-S
    assert optim.auto_lr(False, 86_000_000)[0] == 2e-5  # larger bases: the smaller lr, not extrapolated
    assert optim.auto_lr(False, 460_000)[0] == 2e-3  # measured on the demo's 0.46M-parameter ViT
    assert optim.auto_lr(True, 22_000_000)[0] == optim.auto_lr(True, 460_000)[0] == 1e-3
    assert "22M parameters" in optim.auto_lr(False, 22_000_000)[1]
    with pytest.raises(RecipeError, match=r"train.lr=auto is measured for AdamW only; set train.lr .*e.g. train.lr=0.01"):
        load_recipe(None, ["train.optimizer=sgd"])
    assert load_recipe(None, ["train.optimizer=sgd", "train.lr=0.01"]).train.lr == 0.01


def test_a_run_prints_the_head_lr_it_chose_and_saves_it_resolved(args, tmp_path, capsys):
    from runs import train as run
    from vit_finetune.recipe import read_yaml

    assert run([*args, "train.lr=1e-4", "train.checkpoint_every_steps=1", f"output_dir={tmp_path / 'auto'}"]) == 0
    floor = optim.AUTO_HEAD_LR_ADAMW
    assert f"train.head_lr=auto -> {floor:g}: " in capsys.readouterr().out
    assert read_yaml(tmp_path / "auto" / "recipe.yaml")["train"]["head_lr"] == floor
    # The optimizer that trained: its saved groups carry the head's scale (and the checkpoint resumes with it).
    saved = torch.load(next((tmp_path / "auto" / "checkpoints").glob("*/optimizer.bin")), weights_only=True)
    assert max(group["lr_scale"] for group in saved["param_groups"]) == pytest.approx(floor / 1e-4)
    assert run([*args, "train.lr=1e-4", "train.head_lr=1e-4", f"output_dir={tmp_path / 'set'}"]) == 0
    assert "train.head_lr=auto" not in capsys.readouterr().out
    assert read_yaml(tmp_path / "set" / "recipe.yaml")["train"]["head_lr"] == 1e-4
    # lr=auto too, with LoRA: both printed, both saved resolved.
    assert run([*args, "train.lr=auto", "model.lora={r: 2}", f"output_dir={tmp_path / 'lora'}"]) == 0
    said = capsys.readouterr().out
    assert f"train.lr=auto -> {optim.AUTO_LR_ADAMW['lora']:g}: LoRA" in said and "train.head_lr=auto -> " in said
    assert read_yaml(tmp_path / "lora" / "recipe.yaml")["train"]["lr"] == optim.AUTO_LR_ADAMW["lora"]


def test_a_pinned_lr_far_from_the_one_measured_for_the_bases_size_gets_one_warning(args, tmp_path, capsys):
    """A recipe's lr chosen for another model (the demo's 2e-3 on the real 22M-parameter base scored far below a linear
    probe: docs/training.md) is said once, naming the fix; within ten times of the measured lr nothing is said."""
    from runs import train as run

    # The tests' tiny ViT has fewer than a million parameters: auto measured 2e-3 for a base of its size.
    assert run([*args, "train.lr=1e-5", f"output_dir={tmp_path / 'far'}"]) == 0
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: train.lr=1e-05 is 1/200 of the lr measured for full fine-tuning of a pretrained base "
                        "of 21k parameters (0.002); a recipe's lr chosen for another model can ruin this one. Set "
                        "train.lr=auto to use the measured value"]
    assert run([*args, "train.lr=5e-4", f"output_dir={tmp_path / 'near'}"]) == 0
    assert "warning:" not in capsys.readouterr().out
    # The user's case: the demo's pinned 2e-3 on the real 22M-parameter base, a hundred times the measured lr.
    assert optim.pinned_lr_warning(2e-3, False, 22_056_192).startswith(
        "warning: train.lr=0.002 is 100x the lr measured for full fine-tuning of a pretrained base of 22M parameters")
    assert optim.pinned_lr_warning(5e-3, True, 22_056_192) is None  # LoRA: within ten times of its 1e-3


def test_depth_reads_transformers_4_block_names_too():
    family, config = FAMILIES["vit"], ViTConfig(num_hidden_layers=12)

    def depth(name: str) -> int:
        return optim.layer_depth(name, lambda n: family.block_index(n, config), 12)

    assert depth("vit.encoder.layer.7.attention.attention.query.weight") == 8
    assert depth("base_model.model.vit.layers.0.mlp.fc1.lora_A.default.weight") == 1
    assert depth("vit.embeddings.patch_embeddings.projection.weight") == 0
    assert depth("vit.layernorm.weight") == 13
    assert depth("base_model.model.classifier.modules_to_save.default.bias") == 13


# ---------------------------------------------------------------- EMA


def test_ema_equals_the_formula_over_recorded_raw_weights_after_k_steps():
    model = tiny_vit()
    model.vit.embeddings.patch_embeddings.requires_grad_(False)  # frozen parameters are not averaged
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    average = ema.WeightEMA(model, decay=0.9)
    recorded = [{n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}]
    pixels, labels = torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 1])
    for _ in range(5):
        torch.nn.functional.cross_entropy(model(pixel_values=pixels).logits, labels).backward()
        optimizer.step()
        optimizer.zero_grad()
        average.update()
        recorded.append({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})

    assert not any(n.startswith("vit.embeddings.patch_embeddings") for n in average.state_dict())
    for name in recorded[0]:
        expected = recorded[0][name].double()  # the average starts from the weights before the first step
        for weights in recorded[1:]:
            expected = 0.9 * expected + 0.1 * weights[name].double()
        torch.testing.assert_close(average.state_dict()[name].double(), expected, rtol=1e-6, atol=1e-7)
    assert not torch.equal(average.state_dict()["classifier.weight"], model.classifier.weight)


def test_ema_applied_for_evaluation_then_the_raw_weights_come_back_bit_for_bit():
    model = tiny_vit()
    average = ema.WeightEMA(model, decay=0.5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    raw = {n: p.detach().clone() for n, p in model.named_parameters()}
    average.update()
    with average.applied():
        assert torch.equal(model.classifier.weight, average.state_dict()["classifier.weight"])
        assert not torch.equal(model.classifier.weight, raw["classifier.weight"])
    assert all(torch.equal(p, raw[n]) for n, p in model.named_parameters())


def test_ema_of_a_lora_model_averages_the_adapter_and_the_head_only():
    model = apply_lora(tiny_vit(), LoraSettings(r=2))
    names = set(ema.WeightEMA(model, 0.99).state_dict())
    assert names == {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("lora_A" in n for n in names) and any("classifier" in n for n in names)
    assert not any("q_proj.base_layer" in n for n in names)


# ---------------------------------------------------------------- class balance and per-class recall

SKEWED = [0] * 80 + [1] * 15 + [2] * 5


def test_class_weights_are_inverse_frequency_normalised_to_mean_one_per_image():
    weights = balance.class_weights(SKEWED, 4)  # class 3 has no training image
    assert weights.tolist() == pytest.approx([100 / (4 * 80), 100 / (4 * 15), 100 / (4 * 5), 0.0])
    assert balance.class_weights(SKEWED, 3)[torch.tensor(SKEWED)].mean().item() == pytest.approx(1.0)


def test_class_weights_weight_each_images_loss_by_its_class():
    model = tiny_vit().eval()
    weights = balance.class_weights(SKEWED, 3)
    parts = SimpleNamespace(model=model, normalize=SimpleNamespace(rescale=lambda p: p, standardize=lambda p: p),
                            augment=lambda pixels, labels, epoch, batch: (pixels, None), class_weights=weights, teacher=None,
                            task=SingleLabel())
    pixels, labels = torch.randn(4, 3, 16, 16), torch.tensor([0, 0, 1, 2])
    loss = train_step.batch_loss(parts, {"pixel_values": pixels, "labels": labels, "position": (0, 0)}, load_recipe(None))
    with torch.no_grad():
        per_image = torch.nn.functional.cross_entropy(model(pixel_values=pixels).logits, labels, reduction="none")
    expected = (weights[labels] * per_image).sum() / weights[labels].sum()
    torch.testing.assert_close(loss.detach(), expected)
    assert not torch.allclose(expected, per_image.mean())  # the weights do change the loss


def test_balanced_sampler_draws_each_class_about_equally_often_and_is_fixed_by_seed_and_epoch():
    sampler = balance.BalancedEpochSampler(SKEWED, 3, seed=7)
    counts = Counter()
    orders = []
    for epoch in range(20):
        sampler.set_epoch(epoch)
        keys = list(sampler)
        assert len(keys) == len(SKEWED) and all(e == epoch for _, e in keys)
        orders.append([i for i, _ in keys])
        counts.update(SKEWED[i] for i, _ in keys)
    shares = np.array([counts[c] for c in range(3)]) / sum(counts.values())
    assert np.abs(shares - 1 / 3).max() < 0.05, shares  # from 0.80 / 0.15 / 0.05
    again = balance.BalancedEpochSampler(SKEWED, 3, seed=7)
    again.set_epoch(3)
    assert [i for i, _ in again] == orders[3]  # a resumed run draws the same images
    assert orders[3] != orders[4]


# ---------------------------------------------------------------- stochastic depth


def test_drop_path_rate_on_a_vit_is_refused_naming_the_families_that_have_one():
    with pytest.raises(vit.ModelError, match=r"drop_path_rate=0.1.*'vit'.*beit.*dinov2.*drop_path_rate=null"):
        vit.set_drop_path_rate(ViTConfig(), ModelSettings(drop_path_rate=0.1))


def test_drop_path_rate_makes_training_outputs_stochastic_and_leaves_eval_outputs_deterministic():
    config = Dinov2Config(hidden_size=16, num_hidden_layers=4, num_attention_heads=2, intermediate_size=32,
                          image_size=16, patch_size=4, num_labels=3)
    assert config.drop_path_rate == 0.0
    vit.set_drop_path_rate(config, ModelSettings(drop_path_rate=0.5))
    assert config.drop_path_rate == 0.5
    torch.manual_seed(0)
    model = Dinov2ForImageClassification(config)
    pixels = torch.randn(2, 3, 16, 16)
    model.train()
    assert not torch.equal(model(pixel_values=pixels).logits, model(pixel_values=pixels).logits)
    model.eval()
    assert torch.equal(model(pixel_values=pixels).logits, model(pixel_values=pixels).logits)
    vit.set_drop_path_rate(config, ModelSettings(drop_path_rate=None))  # null keeps the config's
    assert config.drop_path_rate == 0.5


def test_a_run_asking_stochastic_depth_of_a_vit_is_refused_before_anything_is_written(args, tmp_path, capsys):
    from runs import train as run_cli_in_process

    out = tmp_path / "out"
    assert run_cli_in_process([*args, "model.drop_path_rate=0.1", f"output_dir={out}"]) == 1
    assert "model.drop_path_rate=0.1" in capsys.readouterr().err
    assert not out.exists()
