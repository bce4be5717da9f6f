"""The manual's commands run as written right after `make demo`: the front page's block of commands on the demo's
model runs for real, and no documented demo run writes into the folder `make demo` has just finished
(it would be refused: outputs/demo holds a finished run)."""

from __future__ import annotations

import os
import re
import shlex

import pytest

from test_docs import PAGES, command_lines
from tiny import REPO

INFO_FLAGS = {"--keys", "--print", "--list-recipes", "--help"}  # they print and run nothing
DEMO_OUTPUT = "outputs/demo"  # recipes/demo.yaml's output_dir, which `make demo` fills (overwrite=true)


def demo_runs() -> list[tuple[str, list[str]]]:
    """Every documented `python -m vit_finetune --recipe demo ...` training command: (page, its arguments)."""
    runs = []
    for page in PAGES:
        for line in command_lines(page):
            tokens = shlex.split(line, comments=True)
            arguments = tokens[tokens.index("vit_finetune") + 1:] if "vit_finetune" in tokens else []
            if arguments[:2] == ["--recipe", "demo"] and not INFO_FLAGS & set(arguments):
                runs.append((page.name, arguments))
    return runs


def test_no_documented_demo_run_is_refused_after_make_demo(capsys):
    """Each command's recipe, resolved by the CLI's own --print: a run into outputs/demo needs overwrite=true."""
    from vit_finetune.cli import main

    refused = []
    for page, arguments in demo_runs():
        assert main([*arguments, "--print"]) == 0, (page, arguments)
        printed = capsys.readouterr().out
        output_dir = re.search(r"^output_dir: (.*)$", printed, re.M).group(1).strip()
        overwrite = re.search(r"^overwrite: (.*)$", printed, re.M).group(1).strip() == "true"
        if os.path.normpath(output_dir) == DEMO_OUTPUT and not overwrite:
            refused.append(f"{page}: {shlex.join(arguments)}")
    assert demo_runs(), "the pages show no demo run: the parsing above is broken"
    assert refused == []


def after_make_demo_block() -> list[str]:
    """The commands of the front page's block that follows "Right after `make demo`"."""
    text = (REPO / "README.md").read_text()
    marker = text.index("Right after `make demo`")
    following = text[marker:].split("```")[1]
    commands = [line.split("#")[0].strip() for line in following.splitlines()[1:]]
    return [command for command in commands if command]


@pytest.mark.slow
def test_the_front_pages_commands_run_on_the_demos_model(tmp_path, monkeypatch, capsys):
    """A shortened `make demo` (same recipe, one epoch on a few images) in a fresh home, then the block as written:
    each line's arguments, `~` expanded as the shell expands it, to the CLI's main in this process (a fresh
    interpreter for each would spend seconds importing the libraries; the process is not what is tested here)."""
    from runs import train
    from vit_finetune.cli import main

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("VIT_FINETUNE_CACHE", raising=False)
    monkeypatch.chdir(tmp_path)
    assert train(["--recipe", "demo", "overwrite=true", "train.epochs=1", "train.warmup_steps=0",
                  "data.max_train_samples=64", "data.max_eval_samples=16", "data.num_workers=0"]) == 0, \
        capsys.readouterr().err[-2000:]
    assert (tmp_path / DEMO_OUTPUT / "model.safetensors").is_file()
    commands = after_make_demo_block()
    assert [command.split()[3] for command in commands] == ["evaluate", "predict", "explain"]
    capsys.readouterr()
    for command in commands:
        tokens = shlex.split(command)
        assert tokens[:3] == ["python", "-m", "vit_finetune"], command
        arguments = [os.path.expanduser(token) if token.startswith("~") else token for token in tokens[3:]]
        code = main(arguments)
        said = capsys.readouterr().err
        assert code == 0, (command, said[-2000:])
        assert "error" not in said.lower(), (command, said[-2000:])
    assert list((tmp_path / "explain").glob("*.png"))


FIRST_SCREEN = 40  # lines a reader sees before scrolling


def test_training_on_your_own_images_is_on_the_first_screen_and_leaves_your_images_unflipped(capsys):
    """The offline own-images command borrows the demo recipe, which flips its shapes: it must not flip a user's
    images (a mirrored digit is another symbol), which also keeps train.distill.cache_logits usable."""
    from vit_finetune.cli import main

    lines = (REPO / "README.md").read_text().splitlines()
    start = lines.index("## Train on your own images")
    assert start < FIRST_SCREEN
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("## "))
    commands = [shlex.split(line, comments=True) for line in lines[start:end] if "-m vit_finetune --recipe demo" in line]
    assert commands
    for tokens in commands:
        assert main([*tokens[tokens.index("vit_finetune") + 1:], "--print"]) == 0
        assert re.search(r"^  horizontal_flip: false$", capsys.readouterr().out, re.M), tokens


def readme_commands(heading: str) -> list[list[str]]:
    """The commands of the README's code blocks under `heading` (up to the next heading), as argument lists after
    `python -m vit_finetune`."""
    text = (REPO / "README.md").read_text()
    section = text[text.index(heading) + len(heading):].split("\n## ")[0]
    blocks = section.split("```")[1::2]
    tokens = [shlex.split(line, comments=True) for block in blocks for line in block.splitlines()[1:]]
    return [line[line.index("vit_finetune") + 1:] for line in tokens if "vit_finetune" in line]


@pytest.mark.slow
def test_the_student_commands_run_as_written_on_the_teacher_they_name(tmp_path, monkeypatch, capsys):
    """The student's block as written, on a small my_photos, after a shortened run of the own-images command that
    writes the teacher its model.base names (one epoch, no pictures, as the front page's test shortens `make demo`)."""
    from runs import train
    from tiny import write_colour_folder
    from vit_finetune.cli import main

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("VIT_FINETUNE_CACHE", raising=False)
    monkeypatch.chdir(tmp_path)
    write_colour_folder(tmp_path / "my_photos", classes=3, train=8, validation=3)
    student, export, predict = readme_commands("## Smaller and faster")
    teacher_folder = next(arg.split("=", 1)[1] for arg in student if arg.startswith("model.base="))
    teacher = next(command for command in readme_commands("## Train on your own images")
                   if f"output_dir={teacher_folder}" in command)
    shortened = [*teacher, "train.epochs=1", "train.warmup_steps=0", "pictures=false"]
    assert train(shortened) == 0, capsys.readouterr().err[-2000:]
    capsys.readouterr()
    assert train(student) == 0, capsys.readouterr().err[-2000:]
    printed = capsys.readouterr().out
    assert "its head kept" in printed and "new head" not in printed
    assert main(export) == 0 and main(predict) == 0, capsys.readouterr().err[-2000:]


def own_images_block() -> list[str]:
    """The commands of the front page's own-images section (the first block of commands after its heading)."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Train on your own images"):]
    blocks = section.split("```")[1::2]
    commands = next(block for block in blocks if "vit_finetune" in block)
    return [line.split("#")[0].strip() for line in commands.splitlines() if line.split("#")[0].strip()]


def write_stand_in_real_base(folder) -> None:
    """A random DINOv2 saved as scripts/make_real_base.py writes its folder (a Dinov2Model, DINOv2's processor), in
    place of the real one, whose 97 MB wheel cannot be fetched here. It has over a million parameters, so auto's
    choices take the branch they take for the real 22M-parameter base."""
    import torch
    from transformers import BitImageProcessorPil, Dinov2Config, Dinov2Model

    torch.manual_seed(0)
    config = Dinov2Config(hidden_size=192, num_hidden_layers=3, num_attention_heads=3, mlp_ratio=4, patch_size=14,
                          image_size=56, use_mask_token=False)
    Dinov2Model(config).save_pretrained(folder)
    BitImageProcessorPil(size={"shortest_edge": 256}, crop_size={"height": 224, "width": 224}, do_center_crop=True,
                         image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225]).save_pretrained(folder)


@pytest.mark.slow
def test_the_own_images_commands_with_a_real_base_run_as_written(tmp_path, monkeypatch, capsys):
    """make the base (a stand-in: see above), train the demo recipe on my_photos with it, predict: as the front page
    says, from the folder a user stands in. The learning rate is the one measured for a base of its size, not the
    tiny demo ViT's."""
    from runs import train
    from tiny import write_colour_folder
    from vit_finetune.cli import main

    make_base, fine_tune, predict, _ = own_images_block()
    assert "scripts/make_real_base.py" in make_base
    base = re.search(r"model\.base=(\S+)", fine_tune).group(1)
    monkeypatch.chdir(tmp_path)
    write_stand_in_real_base(tmp_path / base)
    write_colour_folder(tmp_path / "my_photos", classes=2, train=12, splits=False, seed=1)
    (tmp_path / "my_photos" / "cat").symlink_to(tmp_path / "my_photos" / "red")  # the command predicts my_photos/cat
    arguments = shlex.split(fine_tune)[3:]
    # Shortened to two epochs, the run would see too few images for auto to fine-tune at all (the probe alone): the
    # method is named, so the learning rate auto takes for this base when it fine-tunes is what is checked.
    assert train([*arguments, "train.epochs=2", "train.method=finetune", "data.num_workers=0"]) == 0, \
        capsys.readouterr().err[-2000:]
    said = capsys.readouterr().out
    assert re.search(r"train.lr=auto -> 2e-05: full fine-tuning of a base of 1\.\dM parameters", said)
    assert "warning" not in said
    assert main(shlex.split(predict)[3:]) == 0
    assert "red" in capsys.readouterr().out
