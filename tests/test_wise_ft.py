"""train.wise_ft_alpha: after LP-FT the saved weights are averaged with the probe's model (WiSE-FT).

Through the real CLI on the tests' tiny ViT and colour folders, and on the average's own arithmetic.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from torch import nn

from runs import train
from vit_finetune.artifacts.callbacks import Callback
from vit_finetune.recipe import load_recipe, methods
from vit_finetune.tasks import MultiLabel, Regression, SingleLabel
from vit_finetune.training import wise_ft


def metrics_of(output: Path) -> dict:
    return json.loads((output / "metrics.json").read_text())


@pytest.fixture(scope="module")
def probe_model(args, tmp_path_factory) -> dict[str, torch.Tensor]:
    """The probe's model: what a linear_probe run saves (the base's backbone, the fitted head) is where LP-FT starts."""
    out = tmp_path_factory.mktemp("probe") / "out"
    assert train([*args, "train.method=linear_probe", f"output_dir={out}"]) == 0
    return load_file(str(out / "model.safetensors"))


def test_the_saved_model_is_alpha_times_the_fine_tuned_one_plus_the_rest_of_the_probes(args, probe_model, tmp_path,
                                                                                          capsys):
    saved = {}
    for alpha in ("1", "0.5", "auto"):
        out = tmp_path / f"alpha-{alpha}"
        assert train([*args, "train.method=lp_ft", f"train.wise_ft_alpha={alpha}", f"output_dir={out}"]) == 0
        saved[alpha] = load_file(str(out / "model.safetensors"))
    said = capsys.readouterr().out
    assert f"train.wise_ft_alpha=auto -> {wise_ft.AUTO_ALPHA:g}: after LP-FT" in said
    fine_tuned = saved["1"]  # the same seed: the same fine-tuning, then averaged or not
    moved = [name for name in fine_tuned if not torch.equal(fine_tuned[name], probe_model[name])]
    assert "classifier.weight" in moved and len(moved) > len(fine_tuned) // 2  # the backbone moved too
    for alpha, key in ((0.5, "0.5"), (wise_ft.AUTO_ALPHA, "auto")):
        for name in fine_tuned:
            torch.testing.assert_close(saved[key][name], alpha * fine_tuned[name] + (1 - alpha) * probe_model[name])
    # Written as run, and said in metrics.json and the card; a run that keeps its weights says nothing of an average.
    out = tmp_path / "alpha-auto"
    assert yaml.safe_load((out / "recipe.yaml").read_text())["train"]["wise_ft_alpha"] == wise_ft.AUTO_ALPHA
    assert metrics_of(out)["wise_ft_alpha"] == wise_ft.AUTO_ALPHA
    assert "x the probe's model (WiSE-FT)" in (out / "README.md").read_text()
    assert "wise_ft_alpha" not in metrics_of(tmp_path / "alpha-1")
    assert "WiSE-FT" not in (tmp_path / "alpha-1" / "README.md").read_text()


def test_both_the_fine_tuned_weights_and_the_average_are_scored_and_shown(args, tmp_path, capsys):
    """The last step's fine-tuned weights are evaluated (the history's last entry, as with alpha 1), then the average;
    metrics.json and the console give both, and the saved model's metrics are the average's when it is no worse."""
    evaluations = {}
    for alpha in ("1", "0.5"):
        out = tmp_path / f"alpha-{alpha}"
        assert train([*args, "train.method=lp_ft", f"train.wise_ft_alpha={alpha}", f"output_dir={out}"]) == 0
        history = json.loads((out / "history.json").read_text())
        evaluations[alpha] = [entry["eval_loss"] for entry in history if "eval_loss" in entry]
    assert evaluations["1"] == evaluations["0.5"]  # the same fine-tuned weights, evaluated the same way
    chosen = metrics_of(tmp_path / "alpha-0.5")["wise_ft"]
    assert chosen["fine_tuned"]["eval_loss"] == evaluations["1"][-1]
    assert chosen["average"]["eval_loss"] != chosen["fine_tuned"]["eval_loss"]
    assert chosen["kept"] == "average"  # a tie in accuracy keeps the average; these colours are learnt either way
    assert chosen["average"]["eval_accuracy"] >= chosen["fine_tuned"]["eval_accuracy"]
    assert metrics_of(tmp_path / "alpha-0.5")["eval_loss"] == chosen["average"]["eval_loss"]
    said = capsys.readouterr().out
    assert (f"WiSE-FT: eval_accuracy on the eval split average {chosen['average']['eval_accuracy']:.4f}, fine-tuned "
            f"{chosen['fine_tuned']['eval_accuracy']:.4f}; saved: 0.5 x the fine-tuned weights") in said


class SpoilTheProbesModel(Callback):
    """A hook (vit_finetune.artifacts.callbacks) that swaps the rows of the head in the probe's model before the average: that
    model then names the wrong class for every image, so any average with it scores below the fine-tuned weights.
    It makes the case the run must catch, an average that hurts, certain on data where every arm is otherwise right."""

    def on_train_start(self, run):
        head = run.parts.wise_ft_start
        for name in ("classifier.weight", "classifier.bias"):
            head[name] = head[name].roll(1, dims=0)


def test_an_average_that_scores_lower_is_not_saved_and_both_scores_are_said(args, tmp_path, capsys):
    fine_tuned, spoiled = tmp_path / "alpha-1", tmp_path / "spoiled"
    assert train([*args, "train.method=lp_ft", "train.wise_ft_alpha=1", f"output_dir={fine_tuned}"]) == 0
    assert train([*args, "train.method=lp_ft", "train.wise_ft_alpha=0.25", f"output_dir={spoiled}"],
                 callbacks=[SpoilTheProbesModel()]) == 0
    said = capsys.readouterr().out
    chosen = metrics_of(spoiled)["wise_ft"]
    assert chosen["kept"] == "fine_tuned" and chosen["alpha"] == 0.25
    assert chosen["average"]["eval_accuracy"] < chosen["fine_tuned"]["eval_accuracy"]
    assert "saved: the fine-tuned weights, as the average scored lower" in said
    # The saved model is the fine-tuned one, bit for bit; its metrics are its own; the card names no average.
    saved, reference = load_file(str(spoiled / "model.safetensors")), load_file(str(fine_tuned / "model.safetensors"))
    assert all(torch.equal(saved[name], reference[name]) for name in reference)
    assert metrics_of(spoiled)["accuracy"] == chosen["fine_tuned"]["eval_accuracy"]
    assert "wise_ft_alpha" not in metrics_of(spoiled)
    assert "WiSE-FT" not in (spoiled / "README.md").read_text()


def test_auto_keeps_the_fine_tuned_weights_where_the_average_was_not_measured(args, tmp_path, capsys):
    out = tmp_path / "best"
    assert train([*args, "train.method=lp_ft", "train.keep_best=eval_accuracy", f"output_dir={out}"]) == 0
    assert ("train.wise_ft_alpha=auto -> 1: the average was measured on full fine-tuning of single-label classifiers "
            "and regressions, not with train.keep_best=eval_accuracy") in capsys.readouterr().out
    assert "wise_ft_alpha" not in metrics_of(out)
    assert wise_ft.auto_alpha("lp_ft", None, 2.0)[0] == wise_ft.AUTO_ALPHA
    assert wise_ft.auto_alpha("lp_ft", "model.lora", 2.0)[0] == 1.0
    assert wise_ft.auto_alpha("finetune", None, 2.0)[0] == 1.0  # a new head: no probe's model to go back to
    # Under 0.6 epochs fine-tuning is short: halfway back to the probe's model, where that was measured.
    short = methods.SHORT_BELOW_EPOCHS - 0.01
    assert wise_ft.auto_alpha("lp_ft", None, short)[0] == wise_ft.SHORT_SCHEDULE_ALPHA < wise_ft.AUTO_ALPHA
    assert wise_ft.auto_alpha("lp_ft", None, methods.SHORT_BELOW_EPOCHS)[0] == wise_ft.AUTO_ALPHA
    assert wise_ft.auto_alpha("lp_ft", "model.lora", short)[0] == 1.0
    # Measured on single-label classifiers and regressions only: label sets keep their fine-tuned weights under auto.
    assert [task.wise_ft_measured for task in (SingleLabel, MultiLabel, Regression)] == [True, False, True]
    # A sharded run splits the weights across its processes: refused when it asks for an average, known at launch.
    assert "launch without FSDP" in wise_ft.refusal("lp_ft", 0.5, sharded=True)
    assert wise_ft.refusal("lp_ft", 0.5, sharded=False) is None and wise_ft.refusal("lp_ft", 1.0, sharded=True) is None


@pytest.mark.parametrize("overrides, says", [
    (["train.method=finetune"], "train.method=finetune fits no probe"),
    (["train.method=linear_probe"], "train.method=linear_probe fine-tunes nothing"),
    (["train.method=lp_ft", "model.lora={r: 2}"], "not with model.lora"),
    (["train.method=lp_ft", "train.keep_best=eval_loss"], "not with train.keep_best"),
])
def test_an_average_the_run_cannot_make_is_refused_before_anything_is_written(args, tmp_path, capsys, overrides, says):
    assert train([*args, *overrides, "train.wise_ft_alpha=0.5", f"output_dir={tmp_path}/out"]) == 2
    error = capsys.readouterr().err
    assert "train.wise_ft_alpha=0.5 averages the fine-tuned weights with the probe's model" in error and says in error
    assert not (tmp_path / "out").exists()


def test_an_average_with_a_method_auto_did_not_choose_lp_ft_for_is_refused_before_training(args, tmp_path, capsys):
    # model.pretrained=false: auto fine-tunes (random features are not worth probing), so there is no probe's model.
    out = tmp_path / "out"
    code = train([*args, "train.method=auto", "model.pretrained=false", "train.wise_ft_alpha=0.5", f"output_dir={out}"])
    captured = capsys.readouterr()
    assert code != 0
    assert "train.method=auto -> finetune" in captured.out
    assert "train.warmup_steps=auto -> 1: a tenth of the 12 steps: from random weights" in captured.out
    assert "train.method=auto chose finetune for this run" in captured.err
    assert not (out / "model.safetensors").exists() and "train step" not in captured.out


@pytest.mark.parametrize("value", ["-0.1", "1.5", "true", "half"])
def test_an_alpha_outside_zero_to_one_is_refused_with_the_range(value):
    with pytest.raises(Exception, match=r"train.wise_ft_alpha[\s\S]*must be a number in \[0, 1\] or auto"):
        load_recipe(None, [f"train.wise_ft_alpha={value}"])
    assert load_recipe(None, ["train.wise_ft_alpha=0"]).train.wise_ft_alpha == 0  # the probe's model, where no worse


def test_interpolate_moves_each_floating_weight_and_only_those_the_start_holds():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    start = wise_ft.snapshot(model)
    assert "1.num_batches_tracked" not in start  # an integer count is no weight to average
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    fine_tuned = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    wise_ft.interpolate(model, start, 0.25)
    for name, tensor in model.state_dict().items():
        expected = 0.25 * fine_tuned[name] + 0.75 * start[name] if name in start else fine_tuned[name]
        torch.testing.assert_close(tensor, expected)
    assert torch.allclose(model[0].weight, start["0.weight"] + 0.25)  # the parameter itself moved, not a copy
    with pytest.raises(ValueError, match="the probe's model has weights the fine-tuned one lacks: extra"):
        wise_ft.interpolate(model, {**start, "extra": torch.zeros(1)}, 0.5)


def _four_level_targets_and_two_models() -> tuple[torch.Tensor, torch.Tensor, nn.Linear, dict, dict]:
    """ELPV-like targets (0, 1/3, 2/3, 1) and two linear models of them: one right on 80 % of the images and far off
    on the rest (fine-tuned), one that hedges every answer halfway toward the middle (the probe's model)."""
    true = torch.tensor([0.0, 1 / 3, 2 / 3, 1.0]).repeat(10).unsqueeze(1)
    seen = true.clone()
    seen[::5] += 0.9  # one image in five the fine-tuned model gets badly wrong
    model = nn.Linear(1, 1)
    with torch.no_grad():
        model.weight.fill_(0.5), model.bias.fill_(0.25)
        hedging = wise_ft.snapshot(model)
        model.weight.fill_(1.0), model.bias.fill_(0.0)
    return seen, true, model, hedging, wise_ft.snapshot(model)


@pytest.mark.parametrize("metric, keeps", [(Regression.selection_metric, "fine_tuned"), ("eval_rmse", "average")])
def test_a_regressions_end_chooses_by_its_headline_mae_where_rmse_would_keep_a_hedging_model(metric, keeps):
    from vit_finetune.training import selection
    from vit_finetune.tasks.regression import summarise

    seen, true, model, hedging, fine_tuned = _four_level_targets_and_two_models()

    def measure():
        with torch.no_grad():
            return summarise(model(seen).numpy(), true.numpy(), ["defect"]), None

    final = measure()
    kept, report = selection.average_if_no_worse(model, hedging, 0.0, metric, final, measure)
    # Hedging halves the worst errors (RMSE 0.27 against 0.40) but misses every image (MAE 0.22 against 0.18).
    assert report["average"]["eval_mae"] > report["fine_tuned"]["eval_mae"]
    assert report["average"]["eval_rmse"] < report["fine_tuned"]["eval_rmse"]
    assert Regression.selection_metric == "eval_mae" and report["chosen_by"].startswith(metric)
    assert report["kept"] == keeps and kept[0]["mae"] == report[keeps]["eval_mae"]
    saved = wise_ft.snapshot(model)
    assert all(torch.equal(saved[name], (fine_tuned if keeps == "fine_tuned" else hedging)[name]) for name in saved)
    assert list(report["fine_tuned"])[0] == metric  # the chooser's score first, as the console says it
