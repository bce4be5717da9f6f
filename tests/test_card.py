"""The model card: label names from the data cannot change the card's structure or inject HTML."""

from __future__ import annotations

import yaml
from markdown_it import MarkdownIt

from vit_finetune.export import model_card
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
