"""The manual cannot drift from the project: every relative link and image in README.md and docs/*.md
resolves (anchors too, with GitHub's heading slugs), and every `key=value` override in their commands is a
real recipe key (the schema's own list, the one `--keys` prints)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tiny import REPO
from vit_finetune.recipe import key_descriptions

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^(```+|~~~+)\s*(\S*)")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
SHELL_LANGUAGES = {"", "bash", "sh", "shell", "console"}
# A recipe override: a lower-case dotted name then `=` (env and make variables are upper case: ARGS=, HF_TOKEN=).
PLACEHOLDERS = {"section.key", "key.sub"}  # how the pages write "any key"
OVERRIDE = re.compile(r"^([a-z][a-z0-9_]*(?:\.[a-z0-9_]+)*)=(?!=)")


def split_page(text: str) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """The prose lines (code blocks blanked) and each fenced block as (language, lines)."""
    prose, blocks, block = [], [], None
    for line in text.splitlines():
        fence = FENCE.match(line.strip())
        if block is None and fence:
            block = (fence.group(2).lower(), [])
            prose.append("")
        elif block is not None and line.strip().startswith(("```", "~~~")):
            blocks.append(block)
            block = None
            prose.append("")
        elif block is not None:
            block[1].append(line)
            prose.append("")
        else:
            prose.append(line)
    return prose, blocks


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in split_page(page.read_text())[0]:
        if match := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line):
            slug = github_slug(match.group(1))
            found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return found


def broken_links(page: Path) -> list[str]:
    problems = []
    prose = "\n".join(re.sub(r"`[^`]*`", "", line) for line in split_page(page.read_text())[0])
    for target in LINK.findall(prose):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not checked offline
            continue
        path_part, _, anchor = target.partition("#")
        linked = (page.parent / path_part).resolve() if path_part else page
        if not linked.exists():
            problems.append(f"{page.name}: {target} -> {linked} does not exist")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            problems.append(f"{page.name}: {target} -> no heading with anchor #{anchor} in {linked.name}")
    return problems


def command_lines(page: Path) -> list[str]:
    """Shell commands of a page that reach the toolkit: lines of shell code blocks and `inline code` in prose."""
    prose, blocks = split_page(page.read_text())
    lines = []
    for language, block in blocks:
        if language in SHELL_LANGUAGES:
            lines.extend(re.sub(r"\\$", "", line) for line in block)
    for line in prose:
        lines.extend(re.findall(r"`([^`]+)`", line))
    return [line for line in lines if re.search(r"vit_finetune|\bmake\s|slurm_", line)]


def overrides_in(command: str) -> list[str]:
    """The recipe keys a command sets: key=value tokens, and those inside a make ARGS="..."."""
    try:
        tokens = shlex.split(command, comments=True)
    except ValueError:  # an unbalanced quote in prose, e.g. a shortened command: split on spaces
        tokens = command.split()
    keys = []
    for token in tokens:
        if token.startswith("ARGS="):
            keys.extend(overrides_in(token.removeprefix("ARGS=")))
        elif match := OVERRIDE.match(token):
            keys.append(match.group(1))
    return keys


def inline_overrides(page: Path) -> list[str]:
    """`section.key=value` written alone in prose (e.g. `train.resume_ignore_changes=[train.lr]`)."""
    keys = []
    for line in split_page(page.read_text())[0]:
        for code in re.findall(r"`([^`]+)`", line):
            if match := re.match(r"^([a-z][a-z0-9_]*\.[a-z0-9_.]+)=", code):
                keys.append(match.group(1))
    return keys


def unknown_keys(page: Path) -> list[str]:
    known = set(key_descriptions())
    used = [key for line in command_lines(page) for key in overrides_in(line)] + inline_overrides(page)
    return sorted({f"{page.name}: {key}" for key in used if key not in known | PLACEHOLDERS})


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_link_and_image_resolves(page):
    assert broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_override_in_a_command_is_a_recipe_key(page):
    assert unknown_keys(page) == []


def test_the_checks_find_a_broken_link_a_missing_anchor_and_an_unknown_key(tmp_path):
    """The checks above would pass on a page they cannot read; this one proves they catch each mistake."""
    (tmp_path / "other.md").write_text("# Other page\n\n## Small data: the study\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\nSee [the study](other.md#small-data-the-study), [up](#page), ![a picture](missing.png),\n"
        "[gone](nowhere.md) and [no such part](other.md#small-data).\n\n"
        "```\npython -m vit_finetune --recipe demo train.epochs=1 train.epoch=2\n"
        "HF_TOKEN=x make train ARGS=\"data.crop_scale=auto data.crop=1\"   # env and make variables are not keys\n```\n\n"
        "Set `model.lora.rank=8` or `model.lora.r=8`.\n")
    assert broken_links(page) == [
        f"page.md: missing.png -> {tmp_path / 'missing.png'} does not exist",
        f"page.md: nowhere.md -> {tmp_path / 'nowhere.md'} does not exist",
        "page.md: other.md#small-data -> no heading with anchor #small-data in other.md",
    ]
    assert unknown_keys(page) == ["page.md: data.crop", "page.md: model.lora.rank", "page.md: train.epoch"]


def test_github_slugs():
    assert github_slug("Which weights are kept, and other training options") == \
        "which-weights-are-kept-and-other-training-options"
    assert github_slug("Streaming: datasets larger than the disk") == "streaming-datasets-larger-than-the-disk"
    assert github_slug("Sharded models (FSDP, DeepSpeed)") == "sharded-models-fsdp-deepspeed"
    assert github_slug("ImageNet-21k on 8 and 64 GPUs: the arithmetic") == "imagenet-21k-on-8-and-64-gpus-the-arithmetic"
    assert github_slug("What it does: the demo, measured") == "what-it-does-the-demo-measured"
