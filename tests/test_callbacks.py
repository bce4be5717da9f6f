"""The training loop's documented hook (vit_finetune.artifacts.callbacks): each event, its order and what it carries."""

from __future__ import annotations

import json

import torch
from transformers import ViTForImageClassification

from vit_finetune.artifacts.callbacks import Callback
from vit_finetune.recipe import load_recipe
from vit_finetune.training import run as training


class Events(Callback):
    """Writes down every event with the step it saw."""

    def __init__(self):
        self.seen: list[tuple] = []

    def on_train_start(self, run):
        self.seen.append(("train_start", run.state.step))

    def on_batch(self, run, batch):
        self.seen.append(("batch", run.state.step, len(batch["labels"])))

    def on_step_end(self, run):
        self.seen.append(("step_end", run.state.step))

    def on_log(self, run, entry):
        self.seen.append(("log", run.state.step, entry))

    def on_evaluate(self, run, metrics):
        self.seen.append(("evaluate", run.state.step, metrics["accuracy"]))

    def on_checkpoint(self, run, path):
        self.seen.append(("checkpoint", run.state.step, path))

    def on_train_end(self, run, model):
        self.seen.append(("train_end", run.state.step, {k: v.clone() for k, v in model.state_dict().items()}))


def test_callbacks_see_every_step_log_evaluation_checkpoint_and_the_trained_model(args, tmp_path):
    out = tmp_path / "out"
    recipe = load_recipe(None, [*args, "train.max_steps=4", "train.log_every_steps=2", "train.eval_every_steps=2",
                                "train.checkpoint_every_steps=2", f"output_dir={out}"])
    events = Events()
    metrics = training.run(recipe, callbacks=[events])

    kinds = [event[0] for event in events.seen]
    assert kinds == ["train_start", "batch", "step_end", "batch", "step_end", "log", "evaluate", "checkpoint",
                     "batch", "step_end", "batch", "step_end", "log", "checkpoint", "evaluate", "train_end"]
    assert [event[1] for event in events.seen if event[0] == "batch"] == [0, 1, 2, 3]  # before its step counts
    assert all(event[2] == 4 for event in events.seen if event[0] == "batch")  # train.batch_size=4
    history = json.loads((out / "history.json").read_text())
    assert [event[2] for event in events.seen if event[0] == "log"] == [h for h in history if "loss" in h]
    assert [(e[1], e[2]) for e in events.seen if e[0] == "evaluate"] == [
        (h["step"], h["eval_accuracy"]) for h in history if "eval_accuracy" in h]
    assert events.seen[-2][2] == metrics["accuracy"]  # the final evaluation is the reported one
    checkpoints = [event[2] for event in events.seen if event[0] == "checkpoint"]
    assert [p.name for p in checkpoints] == ["step-00000002", "step-00000004"]
    assert all((p / "COMPLETE").is_file() for p in checkpoints)
    trained, saved = events.seen[-1][2], ViTForImageClassification.from_pretrained(out).state_dict()
    assert trained.keys() == saved.keys() and all(torch.equal(trained[k], saved[k]) for k in saved)
