"""The model card: label names from the data cannot change the card's structure or inject HTML."""

from __future__ import annotations

import yaml
from markdown_it import MarkdownIt

from vit_finetune.artifacts.card import model_card
from vit_finetune.recipe import Recipe

HOSTILE = ["<script>alert(1)</script>", "two\nlines\n# a heading\n| a | table |", "a|b", "*bold* [link](http://x) `code`"]
METRICS = {"accuracy": 0.5, "macro_f1": 0.4, "eval_samples": 8}


def card_parts(labels: list[str]) -> tuple[dict, str]:
    card = str(model_card(Recipe(), METRICS, labels, "user/model", lora=False))
    _, front, body = card.split("---\n", 2)
    return yaml.safe_load(front), body


def block_structure(body: str) -> list[str]:
    return [token.type for token in MarkdownIt("commonmark").enable("table").parse(body) if token.type != "inline"]


def label_line(body: str) -> str:
    """The rendered text of the card's Labels line."""
    tokens = MarkdownIt("commonmark").parse(body)
    inline = next(token for token in tokens if token.type == "inline" and token.content.startswith("Labels:"))
    return "".join(child.content for child in inline.children if child.type in ("text", "code_inline"))


def test_hostile_labels_leave_the_card_body_as_it_is_with_plain_labels():
    _, plain = card_parts(["w", "x", "y", "z"])
    front, hostile = card_parts(HOSTILE)
    assert block_structure(hostile) == block_structure(plain)  # no new heading, table, paragraph or HTML block
    render = MarkdownIt("commonmark").enable("table").render
    for tag in ("<script", "<a ", "<strong>", "<em>", "<code>", "<h", "<table", "<p>", "<li>"):
        assert render(hostile).count(tag) == render(plain).count(tag), tag  # no element the labels made
    # A reader still sees each label's own characters (a line break as a space).
    shown = label_line(hostile)
    for label in HOSTILE:
        assert " ".join(label.split()) in shown, (label, shown)
    assert front["pipeline_tag"] == "image-classification"  # the front matter is untouched


def test_a_hostile_dataset_path_and_output_folder_name_cannot_change_the_card(base, images, tmp_path):
    """A real run whose data folder and output folder are named like HTML and a heading: the card shows the names
    as text, with the same structure and elements as a run with plain names."""
    import shutil

    from runs import RECIPE, train

    hostile = '<img src=x onerror="alert(1)"> `x\n# owned'
    data = tmp_path / f"data {hostile}"
    shutil.copytree(images, data)
    cards = {}
    for label, dataset, out in (("plain", images, tmp_path / "plain"), ("hostile", data, tmp_path / hostile)):
        recipe = tmp_path / f"{label}.yaml"  # a recipe file: a command-line override cannot hold a line break
        recipe.write_text(yaml.safe_dump({"model": {"base": str(base)}, "data": {"dataset": str(dataset)},
                                          "output_dir": str(out)}))
        assert train(["--recipe", str(recipe), *RECIPE, "train.max_steps=2"]) == 0
        _, front, body = (out / "README.md").read_text().split("---\n", 2)
        cards[label] = body
    assert block_structure(cards["hostile"]) == block_structure(cards["plain"])
    render = MarkdownIt("commonmark").enable("table").render
    shown = render(cards["hostile"])
    assert "<h1>owned</h1>" not in shown and "<img src=x" not in shown
    for tag in ("<img", "<a ", "<strong>", "<em>", "<code>", "<h1", "<h2", "<h3", "<table", "<p>", "<li>", "<pre"):
        assert shown.count(tag) == render(cards["plain"]).count(tag), tag
    assert "&lt;img src=x onerror=" in shown  # the name is still there, as text


# U+202E RIGHT-TO-LEFT OVERRIDE: everything after it is drawn reversed, so "cat\u202egpj.exe" reads "catexe.jpg"
OVERRIDE = "\u202e"


def test_a_label_that_reverses_the_text_after_it_is_neutralised_in_the_card_and_the_page_and_kept_in_the_config(
        base, images, tmp_path):
    import json
    import shutil

    from transformers import AutoConfig

    from runs import RECIPE, train
    from vit_finetune.serving.app import header_html
    from vit_finetune.tasks import MultiLabel

    label = f"cat{OVERRIDE}gpj.exe"
    _, body = card_parts([label, "dog"])
    assert OVERRIDE not in body and "cat\\u202egpj.exe" in label_line(body)  # shown as its escape, in place
    data = tmp_path / "data"
    shutil.copytree(images, data)
    for split in ("train", "validation"):
        (data / split / "red").rename(data / split / label)
    out = tmp_path / "out"
    assert train([f"model.base={base}", f"data.dataset={data}", *RECIPE, "train.max_steps=1", f"output_dir={out}"]) == 0
    assert label in json.loads((out / "config.json").read_text())["id2label"].values()  # the label itself, as data
    card = (out / "README.md").read_text()
    assert OVERRIDE not in card and "cat\\u202egpj.exe" in label_line(card.split("---\n", 2)[2])
    page = header_html(str(out), AutoConfig.from_pretrained(out), 32)
    assert OVERRIDE not in page and "cat\\u202egpj.exe" in page
    note = MultiLabel([label, "dog"], [0.5, 0.5]).page_note([(label, 0.9)], [(label, 0.9)], 5)
    assert OVERRIDE not in note and "cat\\u202egpj.exe 0.90" in note
