"""train.method: the linear probe, LP-FT, and the rule `auto` follows; train.eval_every_steps=auto.

Through the real CLI on the tests' tiny ViT and colour folders, and on the probe's own arithmetic.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from PIL import Image
from accelerate import Accelerator
from safetensors.torch import load_file
from transformers import pipeline

from runs import SimulatedKill, WarmLauncher, assert_bit_identical, history, kill_at, train
from vit_finetune.artifacts.callbacks import Callback
from vit_finetune.recipe import load_recipe, methods, to_yaml
from vit_finetune.tasks import Regression, SingleLabel, evaluation
from vit_finetune.training import optim, probe, wise_ft
from vit_finetune.training.plan import RunSize, plan_run

HEAD = ("classifier.weight", "classifier.bias")


def metrics_of(output: Path) -> dict:
    return json.loads((output / "metrics.json").read_text())


def backbone(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: tensor for key, tensor in weights.items() if not key.startswith("classifier.")}


@pytest.fixture(scope="module")
def probed(args, tmp_path_factory) -> Path:
    """A linear_probe run of the tiny ViT on 3 colours x 8 training images."""
    out = tmp_path_factory.mktemp("probe") / "out"
    assert train([*args, "train.method=linear_probe", f"output_dir={out}"]) == 0
    return out


def two_processes(warm: WarmLauncher, args: list[str], log: Path) -> None:
    """Two ranks forked by the session's warm launcher (conftest.warm_launcher): these tests are of what the ranks
    compute together, not of the launcher."""
    result = warm.run(args, {}, log)
    assert result.returncode == 0, result.stderr[-3000:]


# ---------------------------------------------------------------- the linear probe


def test_a_linear_probe_changes_only_the_head_and_saves_a_model_pipeline_runs(probed, base, images, capsys):
    saved, pretrained = load_file(str(probed / "model.safetensors")), load_file(str(base / "model.safetensors"))
    # The backbone is the base's, to the bit (4.x names on disk both ways; the base's own head is replaced).
    assert backbone(saved).keys() == backbone(pretrained).keys()
    assert all(torch.equal(saved[key], pretrained[key]) for key in backbone(saved))
    assert saved["classifier.weight"].abs().sum() > 0  # fitted, not the zero head a fine-tune starts from
    metrics = metrics_of(probed)
    assert metrics["method"] == "linear_probe" and metrics["steps"] == 0
    assert metrics["probe"]["images"] == 24 and metrics["probe"]["folds"] == 5 and metrics["probe"]["c"] in probe.STRENGTHS
    # Plain transformers runs the folder, and agrees with the metrics the run reported on the same eval images.
    classify = pipeline("image-classification", model=str(probed))
    files = sorted((images / "validation").glob("*/*.png"))
    correct = [classify(Image.open(f))[0]["label"] == f.parent.name for f in files]
    assert metrics["accuracy"] == pytest.approx(sum(correct) / len(files))


def test_the_probe_fit_is_the_regularised_optimum_folded_back_onto_the_raw_features():
    generator = torch.Generator().manual_seed(0)
    targets = torch.arange(60) % 3
    features = torch.randn(60, 8, generator=generator) * 3 + 5  # far from standard: the fold-back is exercised
    features[:, 0] += targets * 12.0
    weight, bias, c, cv_loss, folds = probe.fit_head(features, targets, 4, SingleLabel())  # one class never seen
    assert weight.shape == (4, 8) and folds == 5 and c in probe.STRENGTHS
    # The same head on standardised features: the objective's gradient there is ~0 (L-BFGS converged).
    mean, std = features.mean(0), features.std(0)
    standard = ((features - mean) / std).requires_grad_(False)
    w = (weight * std).clone().requires_grad_(True)
    b = (bias + weight @ mean).clone().requires_grad_(True)
    objective = (torch.nn.functional.cross_entropy(standard @ w.T + b, targets)
                 + w.pow(2).sum() / (2 * c * len(targets)))
    objective.backward()
    assert w.grad.abs().max() < 1e-3 and b.grad.abs().max() < 1e-3
    assert (features @ weight.T + bias).argmax(1).eq(targets).float().mean() > 0.9


def test_the_cross_validation_folds_are_stratified_and_drawn_from_no_shared_generator():
    targets = torch.tensor([0] * 10 + [1] * 7 + [2] * 3)
    state = torch.get_rng_state()
    fold = probe.fold_of_each_image(targets, 3)
    assert torch.equal(torch.get_rng_state(), state)
    for class_id, count in ((0, 10), (1, 7), (2, 3)):
        sizes = torch.bincount(fold[targets == class_id], minlength=3)
        assert sizes.max() - sizes.min() <= 1 and sizes.sum() == count
    assert torch.equal(fold, probe.fold_of_each_image(targets, 3))


def test_two_linear_probes_of_the_same_recipe_are_bit_identical(probed, args, tmp_path):
    assert train([*args, "train.method=linear_probe", "train.seed=7", f"output_dir={tmp_path}/again"]) == 0
    # The seed does not enter a probe: it draws nothing (the head's random start is replaced, no batch is shuffled).
    assert_bit_identical(tmp_path / "again" / "model.safetensors", probed / "model.safetensors")


@pytest.mark.slow
def test_two_processes_fit_the_head_one_process_fits(probed, args, warm_launcher, tmp_path):
    """Each process computes the features of every training image (while the model is built no process may wait for
    another) and fits the head one process fits; DDP then starts from it."""
    out = tmp_path / "two"
    two_processes(warm_launcher, [*args, "train.method=linear_probe", f"output_dir={out}"], tmp_path / "two.log")
    two_probe, one_probe = metrics_of(out)["probe"], metrics_of(probed)["probe"]
    assert two_probe["cv_loss"] == pytest.approx(one_probe["cv_loss"], rel=1e-4)  # other thread counts: last bits
    assert {**two_probe, "cv_loss": None} == {**one_probe, "cv_loss": None}
    two, one = load_file(str(out / "model.safetensors")), load_file(str(probed / "model.safetensors"))
    for key in HEAD:
        torch.testing.assert_close(two[key], one[key], rtol=1e-4, atol=1e-5)


def test_two_processes_average_lp_ft_with_the_probe_model_one_process_fits(probed, args, warm_launcher, tmp_path):
    """In a two-process LP-FT run the weights saved at alpha 0.5 are 0.5 x the same run's at alpha 1 + 0.5 x the probe's
    model (the base's backbone, the head one process fits), and the final evaluation, which both processes share,
    measured the average."""
    def launch(alpha: str) -> Path:
        out = tmp_path / f"alpha-{alpha}"
        # A tenth of 6 steps is no warm-up: at the tests' lr of 5e-3 the loss would reach 0.0 in float32 in both runs,
        # and the two final evaluations could not differ.
        two_processes(warm_launcher, [*args, "train.method=lp_ft", "train.lr=5e-4", f"train.wise_ft_alpha={alpha}",
                             f"output_dir={out}"], tmp_path / f"alpha-{alpha}.log")
        return out

    half, whole = launch("0.5"), launch("1")
    averaged, fine_tuned = load_file(str(half / "model.safetensors")), load_file(str(whole / "model.safetensors"))
    start = load_file(str(probed / "model.safetensors"))
    assert not torch.equal(fine_tuned["classifier.weight"], start["classifier.weight"])  # fine-tuning moved the head
    for key, tensor in averaged.items():
        torch.testing.assert_close(tensor, 0.5 * fine_tuned[key] + 0.5 * start[key], rtol=1e-4, atol=1e-5)
    assert metrics_of(half)["wise_ft_alpha"] == 0.5 and "wise_ft_alpha" not in metrics_of(whole)
    assert metrics_of(half)["eval_loss"] != metrics_of(whole)["eval_loss"]


# ---------------------------------------------------------------- LP-FT


def test_lp_ft_fine_tunes_from_the_probe_head(probed, args, tmp_path):
    # At an lr of 1e-12 nothing moves: the head the fine-tuning started from is the probe's.
    still = tmp_path / "still"
    assert train([*args, "train.method=lp_ft", "train.lr=1e-12", f"output_dir={still}"]) == 0
    probe_head, started_from = load_file(str(probed / "model.safetensors")), load_file(str(still / "model.safetensors"))
    for key in HEAD:
        torch.testing.assert_close(started_from[key], probe_head[key], rtol=0, atol=1e-6)
    metrics = metrics_of(still)
    assert metrics["method"] == "lp_ft" and metrics["steps"] == 12 and metrics["probe"]["images"] == 24
    # With a real lr the first steps start from a fitted head: far below the zero head's loss, ln 3.
    tuned, plain = tmp_path / "tuned", tmp_path / "plain"
    assert train([*args, "train.method=lp_ft", f"output_dir={tuned}"]) == 0
    assert train([*args, "train.method=finetune", f"output_dir={plain}"]) == 0
    first = {run: next(e["loss"] for e in history(run) if "loss" in e) for run in (tuned, plain)}
    assert first[plain] == pytest.approx(torch.log(torch.tensor(3.0)).item(), abs=0.05)
    assert first[tuned] < first[plain] - 0.1
    card = (tuned / "README.md").read_text()
    assert "a linear probe" in card and "then full fine-tuning from that head" in card


class StepLrs(Callback):
    """The lr each optimiser step trains at (train.lr's share), read as its batch arrives."""

    def __init__(self):
        self.lrs = []

    def on_batch(self, run, batch):
        group = run.parts.optimizer.param_groups[0]
        self.lrs.append(group["lr"] / group.get("lr_scale", 1.0))


def test_lp_ft_warms_up_over_a_tenth_of_its_steps_and_fine_tuning_from_a_new_head_does_not(args, tmp_path, capsys):
    # 2 epochs of 6 steps = 12 steps: auto warms LP-FT up for 1 step (12 // 10), so its first step runs at half the lr.
    lp_ft, plain = tmp_path / "lp_ft", tmp_path / "plain"
    seen = {run: StepLrs() for run in (lp_ft, plain)}
    assert train([*args, "train.method=lp_ft", f"output_dir={lp_ft}"], callbacks=[seen[lp_ft]]) == 0
    assert "train.warmup_steps=auto -> 1: a tenth of the 12 steps" in capsys.readouterr().out
    assert train([*args, "train.method=finetune", "train.log_every_steps=1", f"output_dir={plain}"],
                 callbacks=[seen[plain]]) == 0
    assert "train.warmup_steps=auto -> 0: the new head starts at zero" in capsys.readouterr().out
    lr = 0.005  # the tests' recipe
    assert seen[lp_ft].lrs[:2] == pytest.approx([lr / 2, lr])  # then the cosine from the peak
    assert seen[plain].lrs[:2] == pytest.approx([lr, lr * 0.5 * (1 + math.cos(math.pi / 12))])
    # The log gives each step the lr it trained at: the full lr at step 1, the cosine's last non-zero value at step 12.
    assert [entry["lr"] for entry in history(plain) if "loss" in entry] == pytest.approx(seen[plain].lrs)
    assert len(seen[plain].lrs) == 12 and seen[plain].lrs[-1] > 0
    # Written as run, so a reader of the folder sees the warm-up that ran.
    assert yaml.safe_load((lp_ft / "recipe.yaml").read_text())["train"]["warmup_steps"] == 1
    assert yaml.safe_load((plain / "recipe.yaml").read_text())["train"]["warmup_steps"] == 0


def test_auto_warm_up_is_a_tenth_of_the_steps_after_a_probe_or_from_random_weights_only():
    assert optim.auto_warmup_steps(True, 60)[0] == 6 and optim.auto_warmup_steps(True, 32)[0] == 3
    assert optim.auto_warmup_steps(True, 9)[0] == 0  # under ten steps, none: a warm-up must end before the run does
    assert optim.auto_warmup_steps(False, 600)[0] == 0
    assert optim.auto_warmup_steps(False, 600, pretrained=False)[0] == 60  # random weights warm up, head or not
    # A number given is kept; a negative one is refused when the recipe is read.
    assert load_recipe(None, ["train.warmup_steps=4"]).train.warmup_steps == 4
    with pytest.raises(Exception, match="train.warmup_steps"):
        load_recipe(None, ["train.warmup_steps=-1"])


def test_lp_ft_killed_after_a_checkpoint_and_resumed_equals_the_uninterrupted_run(args, tmp_path):
    run = [*args, "train.method=lp_ft", "train.checkpoint_every_steps=4"]
    reference = tmp_path / "reference"
    assert train([*run, f"output_dir={reference}"]) == 0
    out = tmp_path / "out"
    with pytest.raises(SimulatedKill):
        train([*run, f"output_dir={out}"], callbacks=[kill_at(7)])
    # The probe runs again on resume, for WiSE-FT's average (train.wise_ft_alpha=auto): the same head, deterministic.
    assert train([*run, f"output_dir={out}", "train.resume=auto"]) == 0
    assert history(out) == history(reference)
    assert_bit_identical(out / "model.safetensors", reference / "model.safetensors")
    assert metrics_of(out)["probe"] == metrics_of(reference)["probe"]
    assert metrics_of(out)["wise_ft_alpha"] == metrics_of(reference)["wise_ft_alpha"] == wise_ft.AUTO_ALPHA


def test_lp_ft_with_lora_saves_the_probe_head_beside_the_adapter(probed, args, tmp_path):
    out = tmp_path / "lora"
    assert train([*args, "train.method=lp_ft", "model.lora={r: 2}", "train.lr=1e-12", f"output_dir={out}"]) == 0
    merged, probe_head = load_file(str(out / "model.safetensors")), load_file(str(probed / "model.safetensors"))
    for key in HEAD:
        torch.testing.assert_close(merged[key], probe_head[key], rtol=0, atol=1e-6)


def test_lp_ft_distils_from_a_teacher_after_the_probe(probed, args, tmp_path):
    out = tmp_path / "student"
    assert train([*args, "train.method=lp_ft", f"train.distill={{teacher: {probed}, mode: soft}}",
                  f"output_dir={out}"]) == 0
    metrics = metrics_of(out)
    assert metrics["method"] == "lp_ft" and metrics["probe"]["images"] == 24 and metrics["steps"] == 12


def test_a_multi_label_linear_probe_chooses_thresholds(base, tmp_path):
    from runs import RECIPE
    from tiny import write_label_sets

    labels = write_label_sets(tmp_path / "sets", images=30, classes=3)
    out = tmp_path / "out"
    assert train([f"model.base={base}", f"data.dataset={labels}", *RECIPE, "train.method=linear_probe",
                  f"output_dir={out}"]) == 0
    metrics = metrics_of(out)
    assert metrics["multi_label"] and metrics["method"] == "linear_probe"
    assert set(metrics["thresholds"]) == set(json.loads((out / "config.json").read_text())["label2id"])


# ---------------------------------------------------------------- refusals and the auto rule


@pytest.mark.parametrize("override, says", [
    ("model.lora={r: 2}", "model.lora=null, or train.method=lp_ft"),
    ("data.horizontal_flip=true", "data.horizontal_flip=true would never be used"),
    ("augment.mixup=true", "augment.mixup=true would never be used"),
    ("train.distill={teacher: some/teacher}", "set train.distill=null, or train.method=lp_ft"),
    ("train.keep_best=eval_loss", "train.keep_best=eval_loss would never be used"),
    ("train.ema_decay=0.9", "train.ema_decay=0.9 would never be used"),
    ("model.pretrained=false", "model.pretrained=false makes them random: the probe would fit noise. Fix: "
                               "model.pretrained=true, or train.method=finetune"),
])
def test_a_linear_probe_refuses_what_it_would_never_use(args, tmp_path, capsys, override, says):
    assert train([*args, "train.method=linear_probe", override, f"output_dir={tmp_path}/out"]) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_lp_ft_refuses_to_probe_random_features():
    with pytest.raises(Exception, match="train.method=lp_ft fits the head on the frozen backbone's features, and "
                                        "model.pretrained=false makes them random"):
        load_recipe(None, ["train.method=lp_ft", "model.pretrained=false"])


@pytest.mark.parametrize("overrides, unused", [
    (["train.method=auto", "train.keep_best=eval_loss", "train.ema_decay=0.9"],
     "train.keep_best=eval_loss, train.ema_decay=0.9, train.max_steps=50 not used"),
    (["train.method=auto", "train.wise_ft_alpha=0.6"], "train.max_steps=50, train.wise_ft_alpha=0.6 not used"),
    (["train.method=auto", "train.lp_ft_head_scale=0.5"], "train.max_steps=50, train.lp_ft_head_scale=0.5 not used"),
    (["train.method=linear_probe"], "train.method=linear_probe\n  train.max_steps=50 not used"),
])
def test_what_the_probe_alone_leaves_unused_is_said_once(overrides, unused, capsys, tmp_path):
    """plan_run on 4,000 training images in 10 classes, 50 steps of 16 (800 images seen): auto takes the probe
    alone; a setting it cannot use, chosen for another method, is named once, and the recipe as run (saved with
    the model, read back by evaluate, predict and a resume) has it off and loads again."""
    recipe = load_recipe(None, ["data.eval_split=validation", "train.batch_size=16", "train.max_steps=50", *overrides])
    size = RunSize(images_seen=800, training_images=4000, classes=10, eval_images=300, steps_per_epoch=250,
                   total_steps=50, base_parameters=22_000_000)
    resolved = plan_run(recipe, size, Accelerator(cpu=True), SingleLabel())
    said = capsys.readouterr().out
    assert resolved.train.method == "linear_probe"
    assert unused in said and said.count("not used") == 1
    assert "takes no optimiser step" in said
    (tmp_path / "recipe.yaml").write_text(to_yaml(resolved))
    reloaded = load_recipe(str(tmp_path / "recipe.yaml"))
    t = reloaded.train
    assert (t.method, t.keep_best, t.ema_decay, t.wise_ft_alpha, t.lp_ft_head_scale) == \
        ("linear_probe", None, None, 1.0, 1.0)


@pytest.mark.parametrize("method", ["linear_probe", "lp_ft"])
def test_a_probe_refuses_a_stream(method):
    with pytest.raises(Exception, match=f"train.method={method} reads every training image once"):
        load_recipe(None, [f"train.method={method}", "data.streaming=true", "data.eval_split=validation"])


def test_auto_takes_lp_ft_for_a_regression_only_where_the_regression_study_measured_it():
    low, high = methods.REGRESSION_MEASURED_TRAINING_IMAGES
    shortest, longest = methods.REGRESSION_MEASURED_IMAGES_SEEN

    def auto(images: int, seen: int, **options) -> str:
        return methods.auto_method_for_regression(images, 2, seen,
                                                  **{"pretrained": True, "streaming": False, **options})[0]

    assert [auto(low, shortest), auto(high, longest), auto(800, 3200)] == ["lp_ft"] * 3
    # Outside the measured range on either axis, without pretrained features or without the whole split: fine-tuning.
    assert [auto(low - 1, shortest), auto(high + 1, longest), auto(low, shortest - 1), auto(high, longest + 1)] == \
        ["finetune"] * 4
    assert auto(800, 3200, pretrained=False) == "finetune" and auto(800, 3200, streaming=True) == "finetune"
    assert methods.AUTO_RULES[Regression.method_rule] is methods.auto_method_for_regression
    # Through the plan: two targets do not halve the images (800 images, 2 targets, 3,200 seen is inside the range).
    size = RunSize(images_seen=3200, training_images=800, classes=2, eval_images=200, steps_per_epoch=50,
                   total_steps=200, base_parameters=22_000_000)
    recipe = load_recipe(None, ["data.task=regression", "data.eval_split=validation", "train.batch_size=16"])
    assert plan_run(recipe, size, Accelerator(cpu=True), Regression([0.0, 0.0], [1.0, 1.0])).train.method == "lp_ft"
    # LP-FT's end keeps the probe's model where it scores no worse (alpha 0); a setting not measured keeps 1.
    assert wise_ft.auto_alpha("lp_ft", None, 2.0, Regression.wise_ft_auto_alpha)[0] == 0
    assert wise_ft.auto_alpha("lp_ft", "model.lora", 2.0, Regression.wise_ft_auto_alpha)[0] == 1


def test_auto_shrinks_a_regressions_probe_head_only_where_the_regression_study_measured_it():
    low, high = methods.REGRESSION_MEASURED_TRAINING_IMAGES
    shortest, longest = methods.REGRESSION_MEASURED_IMAGES_SEEN
    shrunk = methods.LP_FT_HEAD_SCALE[Regression.method_rule]
    assert 0 < shrunk < 1

    def auto(images: int, seen: int, method: str = "lp_ft", rule: str = "regressor", lora: bool = False) -> float:
        return methods.auto_lp_ft_head_scale(method, rule, lora, images, seen)[0]

    assert [auto(low, shortest), auto(high, longest), auto(low, longest), auto(high, shortest)] == [shrunk] * 4
    # Outside the measured range on either axis, for a classifier, with LoRA, or without a probe: the head as fitted.
    assert [auto(low - 1, shortest), auto(high + 1, longest), auto(low, shortest - 1), auto(high, longest + 1)] == [1] * 4
    assert "not here" in methods.auto_lp_ft_head_scale("lp_ft", "regressor", False, low - 1, shortest)[1]
    assert auto(800, 3200, rule=SingleLabel.method_rule) == 1 and auto(800, 3200, lora=True) == 1
    assert auto(800, 3200, method="finetune") == 1
    # Through the plan: the head's lr stays train.lr, as LP-FT's has been.
    size = RunSize(images_seen=3200, training_images=800, classes=1, eval_images=200, steps_per_epoch=50,
                   total_steps=200, base_parameters=22_000_000)
    recipe = load_recipe(None, ["data.task=regression", "data.eval_split=validation", "train.batch_size=16"])
    resolved = plan_run(recipe, size, Accelerator(cpu=True), Regression([0.0], [1.0])).train
    assert (resolved.method, resolved.lp_ft_head_scale) == ("lp_ft", shrunk)
    assert resolved.head_lr == resolved.lr


@pytest.mark.parametrize("method, says", [("finetune", "fits no probe"), ("linear_probe", "fine-tunes nothing")])
def test_a_probe_head_scale_without_lp_ft_is_refused_when_the_recipe_is_read(method, says):
    with pytest.raises(Exception, match=rf"train.lp_ft_head_scale=0.04 scales the probe's head before LP-FT fine-tunes "
                                        rf"from it, and train.method={method} {says}; use train.method=lp_ft"):
        load_recipe(None, [f"train.method={method}", "train.lp_ft_head_scale=0.04"])
    assert load_recipe(None, [f"train.method={method}", "train.lp_ft_head_scale=1"]).train.lp_ft_head_scale == 1


@pytest.mark.parametrize("value", ["0", "-0.1", "1.5", "true", "half", "nan"])
def test_a_probe_head_scale_outside_zero_to_one_is_refused_with_the_range(value):
    with pytest.raises(Exception, match=r"train.lp_ft_head_scale[\s\S]*must be a number in \(0, 1\] or auto"):
        load_recipe(None, [f"train.lp_ft_head_scale={value}"])
    assert load_recipe(None, ["train.lp_ft_head_scale=0.04"]).train.lp_ft_head_scale == 0.04


def test_a_probe_head_scale_with_a_method_auto_did_not_choose_lp_ft_for_is_refused_before_training(args, tmp_path,
                                                                                                   capsys):
    # model.pretrained=false: auto fine-tunes from a new head, so there is no probe's head to scale.
    out = tmp_path / "out"
    code = train([*args, "train.method=auto", "model.pretrained=false", "train.lp_ft_head_scale=0.04",
                  f"output_dir={out}"])
    captured = capsys.readouterr()
    assert code != 0 and "train.method=auto -> finetune" in captured.out
    assert ("train.lp_ft_head_scale=0.04 scales the probe's head before LP-FT fine-tunes from it, and train.method=auto "
            "chose finetune for this run") in captured.err
    assert not (out / "model.safetensors").exists() and "train step" not in captured.out


def test_auto_is_conservative_outside_what_was_measured():
    low, high = methods.MEASURED_IMAGES_PER_CLASS
    shortest, longest = methods.MEASURED_IMAGES_SEEN
    few_seen, few_epochs = methods.PROBE_ALONE_BELOW_IMAGES_SEEN, methods.SHORT_BELOW_EPOCHS

    def auto(per_class: float, seen: int, **options) -> tuple[str, str]:
        return methods.auto_method(per_class * 10, 10, seen, **{"pretrained": True, "streaming": False,
                                                                                  **options})

    # Inside the measured range: the probe alone while fine-tuning would be short, in steps or in epochs; LP-FT beyond.
    assert auto(low, shortest)[0] == "linear_probe" and auto(low, few_seen - 16)[0] == "linear_probe"
    assert auto(high, int(high * 10 * few_epochs) - 16)[0] == "linear_probe"
    assert auto(low, few_seen)[0] == "lp_ft" and auto(high, int(high * 10 * few_epochs))[0] == "lp_ft"
    assert auto(low, longest)[0] == "lp_ft"
    # The study's cells of 400 per class on either side of the epoch boundary: 0.4 epochs (100 steps of 16) and 0.48
    # (200 per class, 60 steps) the probe alone, unless LP-FT's weights are averaged with the probe's model; 0.6 and
    # 0.8 epochs LP-FT either way.
    assert [auto(400, 1600)[0], auto(200, 960)[0]] == ["linear_probe"] * 2
    assert [auto(400, 1600, averages=True)[0], auto(200, 960, averages=True)[0]] == ["lp_ft"] * 2
    assert [auto(400, 2400)[0], auto(400, 3200)[0]] == ["lp_ft"] * 2
    # Short in steps stays the probe alone, averaged or not: there no average came within noise of it on digits.
    assert auto(high, few_seen - 16, averages=True)[0] == "linear_probe"
    # A probe alone would leave LoRA's adapters or the teacher unused: LP-FT.
    assert auto(high, shortest, needs_steps="model.lora")[0] == "lp_ft"
    assert auto(400, 1600, needs_steps="model.lora")[0] == "lp_ft"
    # Beyond the images per class measured: fine-tuning, as at scale, saying why.
    for per_class, seen in ((high * 2, longest), (low - 1, longest)):
        method, why = auto(per_class, seen, averages=True)
        assert method == "finetune" and "not here" in why, (per_class, seen)
    # Past the longest schedule on data of a measured size: LP-FT on, no cliff at the range's end, said as beyond it;
    # shorter than the shortest: the probe alone, as just inside it.
    for seen in (longest + 16, longest * 4):
        method, why = auto(40, seen, averages=True)
        assert method == "lp_ft" and "past that, LP-FT, the conservative side" in why, seen
    assert auto(40, longest)[0] == auto(40, longest + 16)[0] == "lp_ft"
    assert auto(40, shortest // 2)[0] == "linear_probe"
    assert auto(40, 1000, pretrained=False)[0] == "finetune"
    assert auto(40, 1000, streaming=True)[0] == "finetune"


@pytest.mark.parametrize("overrides, method, alpha", [
    ([], "lp_ft", wise_ft.SHORT_SCHEDULE_ALPHA),  # 0.4 epochs: LP-FT, averaged halfway back to the probe's model
    (["train.max_steps=200"], "lp_ft", wise_ft.AUTO_ALPHA),  # 0.8 epochs: LP-FT, its usual average
    (["train.wise_ft_alpha=1"], "linear_probe", 1.0),  # no average asked for: the probe alone, as unaveraged
    (["train.keep_best=eval_loss"], "linear_probe", 1.0),  # the average was not measured with weight selection
    (["train.wise_ft_alpha=0.6"], "lp_ft", 0.6),  # an average asked for: LP-FT with it
    (["model.lora={r: 2}"], "lp_ft", 1.0),  # LoRA needs steps; its average was not measured
])
def test_auto_takes_lp_ft_under_an_epoch_of_many_images_only_where_it_averages_with_the_probe(overrides, method,
                                                                                              alpha, capsys):
    """plan_run on a run of 4,000 training images in 10 classes, 100 steps of 16 (0.4 epochs) unless overridden:
    the method and alpha auto choose together, and the lines that say why."""
    recipe = load_recipe(None, ["data.eval_split=validation", "train.batch_size=16", "train.max_steps=100",
                                *overrides])
    steps = recipe.train.max_steps
    size = RunSize(images_seen=steps * 16, training_images=4000, classes=10, eval_images=300, steps_per_epoch=250,
                   total_steps=steps, base_parameters=22_000_000)
    resolved = plan_run(recipe, size, Accelerator(cpu=True), SingleLabel())
    said = capsys.readouterr().out
    assert (resolved.train.method, resolved.train.wise_ft_alpha) == (method, alpha)
    assert f"train.method=auto -> {method}" in said
    if method == "lp_ft" and not any(o.startswith("train.wise_ft_alpha") for o in overrides):
        assert f"train.wise_ft_alpha=auto -> {alpha:g}" in said


def test_a_run_prints_the_method_auto_chose_and_saves_it_resolved(args, tmp_path, capsys):
    out = tmp_path / "out"
    assert train([*args, "train.method=auto", f"output_dir={out}"]) == 0
    chosen, why = methods.auto_method(24, 3, 48, pretrained=True, streaming=False)
    assert f"train.method=auto -> {chosen}: {why}" in capsys.readouterr().out
    assert metrics_of(out)["method"] == chosen


# ---------------------------------------------------------------- evaluations during training


def test_auto_spaces_evaluations_by_their_cost_and_keeps_every_epoch_when_they_choose_weights():
    # 300 eval images against 400 training images an epoch: each evaluation ~25 % of an epoch -> every 3 epochs.
    assert evaluation.auto_eval_every_steps(300, 400, 25, 200, None)[0] == 75
    assert evaluation.auto_eval_every_steps(300, 400, 25, 60, None)[0] == 75  # >= the run: only the final one
    assert evaluation.auto_eval_every_steps(30, 400, 25, 200, None)[0] is None  # cheap: every epoch
    assert evaluation.auto_eval_every_steps(300, 400, 25, 200, "train.keep_best=eval_loss")[0] is None


def test_a_run_with_eval_every_steps_auto_evaluates_as_the_rule_says(args, tmp_path):
    # 9 eval images cost about a third of an epoch of 24: the 2-epoch run is evaluated only at its end ...
    every, _ = evaluation.auto_eval_every_steps(9, 24, 6, 12, None)
    assert every == 12
    assert train([*args, "train.eval_every_steps=auto", f"output_dir={tmp_path}/auto"]) == 0
    assert [e["step"] for e in history(tmp_path / "auto") if "eval_accuracy" in e] == [12]
    # ... unless the evaluations choose the saved weights: then every epoch has one.
    assert train([*args, "train.eval_every_steps=auto", "train.keep_best=eval_accuracy",
                  f"output_dir={tmp_path}/best"]) == 0
    assert [e["step"] for e in history(tmp_path / "best") if "eval_accuracy" in e] == [6, 12]


@pytest.mark.parametrize("rows, overrides, seen", [
    (33, ["train.grad_accum=1"], 12 * 33),
    (33, ["train.grad_accum=4"], 12 * 33),
    (33, ["train.grad_accum=64"], 12 * 33),  # one step an epoch, reading the 33 images once
    (2, ["train.epochs=1"], 2),  # a batch of 32 on 2 images reads 2
    (33, ["train.max_steps=3"], 33 + 32),  # 2 steps an epoch: a whole epoch, then one step of 32
])
def test_images_seen_are_the_images_the_run_reads(rows, overrides, seen, capsys):
    """The demo recipe (12 epochs of batch 32) on `rows` images in 3 classes: an epoch reads each image once whatever
    the accumulation, so every `auto` that reads images seen, the method first, decides the same."""
    recipe = load_recipe("demo", ["train.method=auto", *overrides])
    size = RunSize.of(recipe, rows, classes=3, eval_images=3, processes=1, base_parameters=460_000)
    assert size.images_seen == seen
    if rows == 33 and "train.max_steps=3" not in overrides:
        resolved = plan_run(recipe, size, Accelerator(cpu=True), SingleLabel())
        chosen, _why = methods.auto_method(33, 3, 12 * 33, pretrained=True, streaming=False)
        assert resolved.train.method == chosen
        assert "396 seen (12.0 epochs)" in capsys.readouterr().out
