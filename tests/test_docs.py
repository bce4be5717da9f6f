"""The manual cannot drift from the project: every relative link and image in README.md, docs/*.md and
tests/README.md resolves (anchors too, with GitHub's heading slugs), and every `key=value` override in their
commands is a real recipe key (the schema's own list, the one `--keys` prints). tests/README.md, the map of the
test harness, names only helper modules, functions and variables that exist in tests/, and names them all."""

from __future__ import annotations

import ast
import functools
import re
import shlex
from pathlib import Path

import pytest

from tiny import REPO
from vit_finetune.recipe import key_descriptions

HARNESS_PAGE = REPO / "tests" / "README.md"
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), HARNESS_PAGE]
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


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(REPO).as_posix())
def test_every_link_and_image_resolves(page):
    assert broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(REPO).as_posix())
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


# ---------------------------------------------------------------- tests/README.md, the map of the harness

TESTS = REPO / "tests"
# Modules from outside tests/ that the page names by dotted name; any other dotted name must be a helper's.
OUTSIDE_MODULES = {"vit_finetune", "gc", "os"}
CODE_TOKEN = re.compile(r"[A-Za-z_$][\w./*$-]*")
VARIABLE = re.compile(r"^[A-Z][A-Z0-9_]{3,}\*?$")
DOTTED = re.compile(r"^[a-z_][a-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$")
OTHER_FILE = re.compile(r"\.(json|jsonl|md|sh|sbatch|yaml|toml|txt|png|csv|safetensors)$")
# Variables the harness itself touches: through os.environ in a helper module, or by its own prefixes anywhere.
ENVIRON_USE = re.compile(r'environ(?:\.get|\.setdefault|\.pop)?[\[(]\s*"([A-Z][A-Z0-9_]+)"|"([A-Z][A-Z0-9_]+)"\s+in\s+'
                         r'(?:os\.)?environ')
HARNESS_PREFIXES = re.compile(r"\b(?:VIT_FINETUNE|RANK_REPORT|WARM_LAUNCH)_[A-Z0-9_]*")


def code_of(page: Path) -> list[str]:
    """The page's code: each `inline code` span of its prose and each line of its code blocks."""
    prose, blocks = split_page(page.read_text())
    return [span for line in prose for span in re.findall(r"`([^`]+)`", line)] + \
        [line for _language, block in blocks for line in block]


def helper_modules() -> list[str]:
    """The harness's own files, as the page names them: `name.py`, `name/` and `name/module.py` (tests excluded)."""
    names = []
    for path in sorted(TESTS.iterdir()):
        if path.suffix == ".py" and not path.name.startswith("test_"):
            names.append(path.name)
        elif path.is_dir() and not path.name.startswith((".", "__")):
            names.append(f"{path.name}/")
            names += [f"{path.name}/{module.name}" for module in sorted(path.glob("*.py"))]
    return names


def module_file(folder: Path, name: str) -> Path | None:
    for candidate in (folder / f"{name}.py", folder / name / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.cache
def defined_names(module: Path) -> dict[str, ast.AST]:
    """A module's top-level names: functions, classes, assignments and imports."""
    names: dict[str, ast.AST] = {}
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        names[name.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update({(alias.asname or alias.name).split(".")[0]: node for alias in node.names})
    return names


def class_attributes(cls: ast.ClassDef) -> set[str]:
    """A class's methods and attributes, those its methods set on `self` included."""
    found = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node in cls.body:
            found.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node in cls.body:
            found.add(node.target.id)
        elif isinstance(node, ast.Assign) and node in cls.body:
            found.update(target.id for target in node.targets if isinstance(target, ast.Name))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
                and isinstance(node.ctx, ast.Store):
            found.add(node.attr)
    return found


def missing_dotted(dotted: str) -> str | None:
    """Why `module[.submodule].name[.attribute]` names nothing in tests/, or None when it names something."""
    first, *rest = dotted.split(".")
    if first in OUTSIDE_MODULES:
        return None
    module = module_file(TESTS, first)
    if module is None:
        return f"{dotted}: no helper module {first} in tests/"
    while rest and module.name == "__init__.py" and module_file(module.parent, rest[0]):
        module = module_file(module.parent, rest.pop(0))
    if not rest:
        return None
    where = module.relative_to(REPO).as_posix()
    node = defined_names(module).get(rest[0])
    if node is None:
        return f"{dotted}: {where} defines no {rest[0]}"
    if len(rest) > 1 and isinstance(node, ast.ClassDef) and rest[1] not in class_attributes(node):
        return f"{dotted}: {rest[0]} in {where} has no {rest[1]}"
    return None


def harness_sources() -> list[Path]:
    """The harness's Python files and the tests', less this one (whose examples name what does not exist)."""
    return [path for path in sorted(TESTS.rglob("*.py")) if path.resolve() != Path(__file__).resolve()]


def harness_text() -> str:
    """Where a variable the page names must appear: the tests' files, and the Makefile the page's commands run."""
    return "\n".join(path.read_text() for path in [*harness_sources(), REPO / "Makefile"])


def harness_problems(page: Path) -> list[str]:
    """Each name of the page's code that does not exist: a file, a module's function or class (and its method), an
    environment variable, a make target."""
    text, targets = harness_text(), set(re.findall(r"^([a-z][a-z-]*):", (REPO / "Makefile").read_text(), re.M))
    problems = []
    for code in code_of(page):
        problems += [f"make {target}: no such target in the Makefile"
                     for target in re.findall(r"\bmake ([a-z][a-z-]*)", code) if target not in targets]
        for token in CODE_TOKEN.findall(code):
            token = token.rstrip(".")
            if token.endswith((".py", "/")) or token.startswith("tests/"):
                if not ((TESTS / token).exists() or (REPO / token).exists()):
                    problems.append(f"{token}: no such file in tests/ or the project")
            elif OTHER_FILE.search(token):
                continue
            elif DOTTED.match(token):
                problems += [problem for problem in [missing_dotted(token)] if problem]
            elif VARIABLE.match(token):
                name = token.rstrip("*")
                if not re.search(rf"\b{name}" + ("" if token.endswith("*") else r"\b"), text):
                    problems.append(f"{token}: no such variable in tests/ or the Makefile")
    return sorted(set(problems))


def unmapped(page: Path) -> list[str]:
    """The helper modules and environment variables of the harness that the page does not name."""
    named = {token.rstrip(".") for code in code_of(page) for token in CODE_TOKEN.findall(code)}
    helpers = sorted(TESTS.glob("*.py")) + sorted(TESTS.glob("*/*.py"))
    variables = {name for path in helpers if not path.name.startswith("test_")
                 for pair in ENVIRON_USE.findall(path.read_text()) for name in pair if name}
    variables |= set(HARNESS_PREFIXES.findall("\n".join(path.read_text() for path in harness_sources())))
    named_variables = {token.rstrip("*") for token in named if VARIABLE.match(token)}
    return [f"helper module {name}" for name in helper_modules() if name not in named] + \
        [f"variable {name}" for name in sorted(variables)
         if not any(name == token or (name.startswith(token) and token.endswith("_")) for token in named_variables)]


def test_the_harness_map_names_only_what_exists():
    assert harness_problems(HARNESS_PAGE) == []


def test_the_harness_map_names_every_helper_module_and_variable():
    assert unmapped(HARNESS_PAGE) == []


def test_the_harness_checks_find_each_name_that_is_gone(tmp_path):
    """The two checks above would pass on a page they cannot read; this one proves they catch each mistake."""
    page = tmp_path / "README.md"
    page.write_text(
        "# Harness\n\n"
        "`runs.py` has `runs.train` and `runs.gone_helper`; `runs.WarmLauncher.run` but not `runs.WarmLauncher.fly`.\n"
        "`hub_server.server.HubServer.identify_clients`, `hub_server.storage.Vault`, `gone_module.anything`,\n"
        "`tests/gone.py`, `observed_site/`, `metrics.json`, `vit_finetune.cli.main`. Set `OMP_NUM_THREADS=1`,\n"
        "`VIT_FINETUNE_GONE`, `WARM_LAUNCH_HELD_*`; run `make test-fast`, not `make test-slow`.\n\n"
        "```\nrecorder.subprocess_env -> recorder.record_everything\n```\n")
    assert harness_problems(page) == [
        "VIT_FINETUNE_GONE: no such variable in tests/ or the Makefile",
        "gone_module.anything: no helper module gone_module in tests/",
        "hub_server.storage.Vault: tests/hub_server/storage.py defines no Vault",
        "make test-slow: no such target in the Makefile",
        "recorder.record_everything: tests/recorder.py defines no record_everything",
        "runs.WarmLauncher.fly: WarmLauncher in tests/runs.py has no fly",
        "runs.gone_helper: tests/runs.py defines no gone_helper",
        "tests/gone.py: no such file in tests/ or the project",
    ]
    missing = unmapped(page)
    assert "helper module tiny.py" in missing and "helper module hub_server/routes.py" in missing
    assert "variable VIT_FINETUNE_RECORD" in missing and "variable RANK_REPORT_DIR" in missing
    assert not any(name in missing for name in ("helper module runs.py", "helper module observed_site/",
                                                "variable OMP_NUM_THREADS", "variable WARM_LAUNCH_HELD_"))


def test_every_extra_named_anywhere_exists_under_a_name_pip_need_not_normalise():
    """pip 23 looks an extra up as typed while the metadata spells it normalised (PEP 685: `real_base` is written
    `real-base`, so `.[real_base]` installed nothing): a name of lower-case letters and digits is the same both ways."""
    tomllib = pytest.importorskip("tomllib", reason="the TOML reader of Python 3.11+")
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert [name for name in extras if not re.fullmatch(r"[a-z0-9]+", name)] == []
    files = [*PAGES, REPO / "Makefile", *sorted((REPO / "scripts").iterdir()), *sorted((REPO / "tests").glob("*.py")),
             *sorted((REPO / "vit_finetune").rglob("*.py"))]
    named = {(path.relative_to(REPO).as_posix(), extra) for path in files if path.is_file() and path != Path(__file__)
             for group in re.findall(r"\.\[([A-Za-z0-9_.,-]+)\]", path.read_text()) for extra in group.split(",")}
    assert {extra for _path, extra in named} >= {"dev", "realbase"}  # the pattern finds what the pages install
    assert sorted((path, extra) for path, extra in named if extra not in extras) == []
