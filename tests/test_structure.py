"""The package's shape, read from its source with `ast`: no import cycle among its modules, imports at the top
unless a module must stay light to import, one module (core/layout.py) that spells the names a run writes, and a
top level of the API, the commands and the wings.

A function-local import counts like one at the top: Python resolves it later, but the two modules depend on each
other all the same, and a cycle hidden that way still decides what may be imported first. Imports under
`if TYPE_CHECKING:` are for annotations only and never run, so they are left out.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from dataclasses import dataclass
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import vit_finetune
from vit_finetune.core import layout

PACKAGE = Path(vit_finetune.__file__).resolve().parent

# Libraries that take a measurable part of a second or more to import (torch and transformers: seconds; pydantic,
# for the recipe's schema: ~0.4 s; huggingface_hub: ~0.3 s), against ~0.05 s for the command line's own module.
SLOW_TO_IMPORT = {"torch", "transformers", "datasets", "accelerate", "peft", "evaluate", "pydantic", "huggingface_hub",
                  "gradio", "matplotlib", "onnx", "onnxruntime"}
# The modules that may import some of the package's slow modules inside functions, and why: each must stay light
# to import for a command that tests time or whose imports they list (test_first_minutes.py, test_launch.py).
# Anywhere else, or of a module that is quick to import, an import inside a function only hides the layering.
KEPT_LIGHT = {
    "vit_finetune": "`python -m vit_finetune` imports the package before its --help answers; the API's functions load "
                    "the recipe's schema, torch and the Hub's client when called",
    "vit_finetune.cli": "--help and the recipe listings answer at once; each command imports its own stage",
    "vit_finetune.model.saved_model": "predict refuses a model that is neither a folder nor on the Hub before torch loads",
    "vit_finetune.serving.prediction": "predict refuses a wrong output or image before torch loads",
    "vit_finetune.serving.evaluate_saved": "evaluate refuses a folder it may not write into before torch loads",
    "vit_finetune.serving.app": "the page refuses a taken port or a missing gradio before the model's stack loads",
}


def module_names(package: Path) -> dict[str, Path]:
    """Every module of the package under `package`, by its dotted name (a sub-package by its folder's name)."""
    names = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def runtime_imports(tree: ast.AST, inside_function: bool = False):
    """(import node, whether it sits inside a function) for each import that can run, TYPE_CHECKING blocks left out."""
    for child in ast.iter_child_nodes(tree):
        if is_type_checking_block(child):
            yield from runtime_imports(ast.Module(body=child.orelse, type_ignores=[]), inside_function)
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, inside_function
        else:
            yield from runtime_imports(child, inside_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                                   ast.Lambda)))


def imported_modules(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool, modules: set[str]) -> set[str]:
    """The package's modules one import statement of `importer` loads (`from . import a, b` loads a and b)."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in modules}
    base = node.module or ""
    if node.level:
        anchor = importer.split(".") if is_package else importer.split(".")[:-1]
        anchor = anchor[:len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([node.module] if node.module else []))
    submodules = {f"{base}.{alias.name}" for alias in node.names} & modules
    return (submodules or {base} & modules) - {importer}


@dataclass
class Imports:
    graph: dict[str, dict[str, int]]  # importer -> {imported module of the package: line of its first import}
    inside_functions: list[tuple[str, str, int]]  # (importer, imported, line) of each import inside a function
    at_top: dict[str, set[str]]  # importer -> what it imports when it is imported: the package's modules and libraries


@functools.cache  # read once for all the tests of this file (each reading parses every module)
def read_imports(package: Path) -> Imports:
    """Every runtime import among the modules of `package`, and the libraries each imports at its top."""
    modules = module_names(package)
    found = Imports({name: {} for name in modules}, [], {name: set() for name in modules})
    for name, path in modules.items():
        for node, inside_function in runtime_imports(ast.parse(path.read_text(), str(path))):
            targets = imported_modules(node, name, path.name == "__init__.py", set(modules))
            for target in targets:
                found.graph[name].setdefault(target, node.lineno)
                if inside_function:
                    found.inside_functions.append((name, target, node.lineno))
            if not inside_function:
                libraries = {alias.name for alias in node.names} if isinstance(node, ast.Import) else (
                    {node.module} if node.module and not node.level else set())
                found.at_top[name] |= targets | {library.split(".")[0] for library in libraries}
    return found


def slow_to_import(module: str, at_top: dict[str, set[str]]) -> bool:
    """Whether importing `module` imports one of SLOW_TO_IMPORT, itself or through the package's modules."""
    seen, waiting = set(), [module]
    while waiting:
        name = waiting.pop()
        if name in SLOW_TO_IMPORT:
            return True
        if name not in seen:
            seen.add(name)
            waiting.extend(at_top.get(name, ()))
    return False


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None if it has none (a depth-first search)."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once every path from it is searched
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for target in sorted(graph.get(node, {})):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def spelled(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def test_no_import_cycle_among_the_package_modules():
    graph = read_imports(PACKAGE).graph
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {spelled(cycle, graph)}"


def test_imports_inside_functions_only_of_slow_modules_into_modules_kept_light():
    found = read_imports(PACKAGE)
    hidden = [f"{importer}:{line} imports {target}" + ("" if importer in KEPT_LIGHT else f" ({importer} is not kept light)")
              for importer, target, line in found.inside_functions
              if importer not in KEPT_LIGHT or not slow_to_import(target, found.at_top)]
    assert not hidden, "move these imports to the top of their module:\n" + "\n".join(hidden)


def write_package(root: Path, files: dict[str, str]) -> Path:
    package = root / "pkg"
    for name, source in {"__init__.py": "", **files}.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(source)
    return package


def test_the_check_finds_a_cycle_closed_inside_a_function_and_names_it(tmp_path):
    package = write_package(tmp_path, {
        "low.py": "def f():\n    from .high import g\n",  # the import that closes the circle, hidden in a function
        "middle.py": "from . import low\n",
        "high.py": "from .middle import low\n\n\ndef g():\n    pass\n",
        "typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .high import g\n",
    })
    found = read_imports(package)
    assert find_cycle(found.graph) == ["pkg.high", "pkg.middle", "pkg.low", "pkg.high"]
    assert spelled(find_cycle(found.graph), found.graph) == ("pkg.high (line 1) -> pkg.middle (line 1) -> "
                                                             "pkg.low (line 2) -> pkg.high")
    assert found.inside_functions == [("pkg.low", "pkg.high", 2)]
    assert "pkg.high" not in found.graph["pkg.typed"]  # an annotation-only import is no dependency
    (package / "low.py").write_text("def f():\n    pass\n")
    assert find_cycle(read_imports.__wrapped__(package).graph) is None  # read afresh, not from the cache


def test_a_module_is_slow_to_import_through_what_it_imports_at_its_top(tmp_path):
    package = write_package(tmp_path, {
        "heavy.py": "import torch.nn\n",
        "through.py": "from .heavy import x\n",
        "light.py": "import json\n\n\ndef f():\n    import torch\n    from . import heavy\n",
    })
    at_top = read_imports(package).at_top
    assert slow_to_import("pkg.heavy", at_top) and slow_to_import("pkg.through", at_top)
    assert not slow_to_import("pkg.light", at_top)  # its torch is imported when f runs, not when it is imported


def names_a_run_writes() -> dict[str, str]:
    """layout's file names (a name with a dot: `runs` or `best` are words too common to search the source for)."""
    return {value: key for key, value in vars(layout).items()
            if key.isupper() and isinstance(value, str) and "." in value.strip(".")}


def test_no_module_but_layout_spells_a_name_a_run_writes():
    names = names_a_run_writes()
    assert {"metrics.json", "recipe.yaml", "model.onnx", "export.json", ".vit_finetune_manifest.json"} <= set(names)
    spelled_elsewhere = [f"{path.relative_to(PACKAGE)}:{node.lineno} spells {node.value!r}: use layout.{names[node.value]}"
                         for path in sorted(PACKAGE.rglob("*.py")) if path.name != "layout.py"
                         for node in ast.walk(ast.parse(path.read_text()))
                         if isinstance(node, ast.Constant) and node.value in names]
    assert not spelled_elsewhere, "\n".join(spelled_elsewhere)


def test_layout_spells_transformers_names_as_transformers_does():
    """layout writes them out so that reading a name does not import transformers; they must stay the same names."""
    from transformers.utils import CONFIG_NAME, IMAGE_PROCESSOR_NAME, SAFE_WEIGHTS_NAME

    assert (layout.CONFIG_FILE, layout.WEIGHTS_FILE, layout.PROCESSOR_FILE) == (CONFIG_NAME, SAFE_WEIGHTS_NAME,
                                                                              IMAGE_PROCESSOR_NAME)


def test_layout_imports_nothing_of_the_package():
    assert read_imports(PACKAGE).graph["vit_finetune.core.layout"] == {}


def readme_rows(readme: str) -> list[set[str]]:
    """The module rows of README's picture of the package, top row first (an indented line continues its row)."""
    section = readme.split("## How the code is laid out", 1)[1]
    block = section.split("```\n", 2)[1]
    rows: list[set[str]] = []
    for line in block.splitlines():
        names = set(re.split(r"\s{2,}", line.strip(), maxsplit=1)[0].split())
        if line.startswith(" "):
            rows[-1] |= names
        else:
            rows.append(names)
    return rows


def test_the_readme_picture_of_the_package_holds():
    """Each module (a sub-package as one) sits in one row and imports only modules of lower rows: the picture is the
    layering as it is. The benchmark (bench/) is a command of its own, beside the picture."""
    graph = read_imports(PACKAGE).graph
    short = {name: name.split(".")[1] for name in graph if name.count(".") >= 1}
    short = {name: part for name, part in short.items() if part not in ("bench", "__main__")}
    rows = readme_rows((PACKAGE.parent / "README.md").read_text())
    row_of = {module: index for index, row in enumerate(rows) for module in row}
    assert sum(map(len, rows)) == len(row_of), "a module sits in two rows"
    assert set(row_of) == set(short.values()), (f"missing from the picture: {set(short.values()) - set(row_of)}; "
                                                f"not in the package: {set(row_of) - set(short.values())}")
    upward = sorted({f"{short[importer]} (row {row_of[short[importer]] + 1}) imports {short[target]} "
                     f"(row {row_of[short[target]] + 1})" for importer in short for target in graph[importer]
                     if target in short and short[target] != short[importer]
                     and row_of[short[target]] <= row_of[short[importer]]})
    assert not upward, "README's picture: " + "; ".join(upward)


WINGS = ["core", "recipe", "data", "tasks", "model", "artifacts", "training", "serving"]  # lowest first
# The modules that are commands of their own, however short: `python -m` enters them.
COMMAND_ENTRIES = {"__main__.py"}


def test_the_package_top_level_is_the_api_the_commands_and_the_wings():
    entries = sorted(path.name for path in PACKAGE.iterdir() if path.name != "__pycache__")
    assert entries == sorted(["__init__.py", "__main__.py", "cli.py", "bench", *WINGS])
    assert len(entries) <= 12


def test_every_wing_says_what_it_holds_and_stays_light_to_import():
    """A wing's __init__ is its docstring (which modules do what) and at most the names the rest may use: cli imports
    model.saved_model and serving.prediction before torch loads, which a heavy wing __init__ would undo."""
    at_top = read_imports(PACKAGE).at_top
    for wing in WINGS:
        init = PACKAGE / wing / "__init__.py"
        assert ast.get_docstring(ast.parse(init.read_text())), f"{wing}/__init__.py has no docstring"
    for wing in ("core", "model", "artifacts", "training", "serving"):
        assert not slow_to_import(f"vit_finetune.{wing}", at_top), f"{wing}/__init__.py imports a slow library"


def test_no_module_holds_too_little_to_stand_alone():
    """A module under 40 lines belongs in its neighbour (an __init__ and a command entry excepted)."""
    short = [f"{path.relative_to(PACKAGE)}: {lines} lines" for path in sorted(PACKAGE.rglob("*.py"))
             if path.name not in {"__init__.py", *COMMAND_ENTRIES}
             and (lines := len(path.read_text().splitlines())) < 40]
    assert not short, "merge into a neighbour: " + "; ".join(short)


# Libraries the package imports without declaring them, and why that is right.
UNDECLARED = {"torchvision": "the benchmark's peer uses its transforms where installed, else the same steps of its own "
                             "(vit_finetune/bench/peer.py)"}


def libraries_imported(package: Path) -> dict[str, str]:
    """Each library outside the standard library that the package's source imports (top-level name), with a file
    that imports it."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and not node.level else [])
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != package.name:
                    found.setdefault(top, str(path.relative_to(package.parent)))
    return found


def test_every_library_the_package_imports_is_declared_in_pyproject():
    """A library that only arrives with another dependency goes when that one stops bringing it (httpx2 did, with
    huggingface_hub 1.x): each one imported is a dependency or an extra of pyproject.toml itself."""
    tomllib = pytest.importorskip("tomllib", reason="the TOML reader of Python 3.11+")
    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]
    requirements = [*project["dependencies"], *(line for extra in project["optional-dependencies"].values()
                                                for line in extra)]
    declared = {canonicalize_name(Requirement(line).name) for line in requirements}
    distributions = packages_distributions()  # import name -> the distributions that install it
    undeclared = {module: where for module, where in libraries_imported(PACKAGE).items() if module not in UNDECLARED
                  and not {canonicalize_name(name) for name in distributions.get(module, [module])} & declared}
    assert undeclared == {}
