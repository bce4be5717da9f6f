"""The fixed facts a recipe is read against: where recipes and shipped models live, the Hub's pattern for repo ids,
the limits a recipe's input must fit, and the short excerpt every message quotes a value by.

The lowest layer of the recipe package: it imports nothing of the package.
"""

from __future__ import annotations

import re
import reprlib
from pathlib import Path
from typing import Any

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # vit_finetune/
BUILTIN_PREFIX = "builtin:"  # models shipped inside the package, e.g. builtin:tiny-vit-32 for the offline demo
ASSETS_DIR = PACKAGE_DIR / "assets"
# A checkout keeps recipes/ beside the package; an installed wheel carries a copy inside it.
RECIPE_DIRS = (PACKAGE_DIR.parent / "recipes", PACKAGE_DIR / "recipes")
# recipes/accelerate/ holds Accelerate's own config files (`accelerate launch --config_file`), not recipes.
ACCELERATE_CONFIGS = "accelerate"
# The Hub's own rule for repo ids: an optional namespace and a name, no spaces, at most 96 characters.
REPO_ID_PATTERN = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")
# A recipe has ~60 keys. A YAML alias bomb ("billion laughs") loads in milliseconds as shared references, then
# expands to hundreds of millions of values wherever it is walked (validation, messages): refuse it first.
MAX_RECIPE_VALUES = 10_000
MAX_RECIPE_BYTES = 1_000_000
# The deepest key (model.lora.target_modules) is a list 3 levels down; YAML and pydantic recurse per level, and a
# value nested thousands deep ends in a RecursionError. (An alias bomb is shallow: MAX_RECIPE_VALUES stops it.)
MAX_RECIPE_DEPTH = 32
NAME_MAX = 255  # bytes in one file or folder name: ext4, XFS, APFS and NTFS allow no more
SEED_MAX = 2**32 - 1  # NumPy's generators take no larger seed (nor a negative one)
EXCERPT = reprlib.Repr()
EXCERPT.maxlevel, EXCERPT.maxstring, EXCERPT.maxother, EXCERPT.maxlong = 2, 60, 60, 40
EXCERPT.maxlist = EXCERPT.maxtuple = EXCERPT.maxdict = EXCERPT.maxset = 4


def excerpt(value: Any) -> str:
    """A short repr for messages: never the whole of a huge or deeply nested value (reprlib stops early)."""
    return EXCERPT.repr(value)


def names_fit(value: str | None) -> str | None:
    """A path's every name within NAME_MAX bytes; a longer one fails in the file system (ENAMETOOLONG) at first use."""
    for name in (value or "").split("/"):
        if len(name.encode()) > NAME_MAX:
            raise ValueError(f"holds a name of {len(name.encode())} bytes ({excerpt(name)}); file systems allow "
                             f"{NAME_MAX}. Shorten it")
    return value


def _is_file(path: str | Path) -> bool:
    """Path.is_file, but False (not OSError) for a name the file system refuses, e.g. longer than 255 bytes."""
    try:
        return Path(path).is_file()
    except OSError:
        return False


def _is_dir(path: str | Path) -> bool:
    try:
        return Path(path).is_dir()
    except OSError:
        return False


def count_values(data: Any, limit: int = MAX_RECIPE_VALUES) -> int:
    """Values in `data` with YAML aliases expanded, counted without expanding them (each shared node's count is
    remembered); anything over `limit`, or a node that contains itself, counts as limit + 1."""
    counts: dict[int, int] = {}
    open_nodes: set[int] = set()

    def count(node: Any) -> int:
        if not isinstance(node, (dict, list)):
            return 1
        key = id(node)
        if key in open_nodes:  # `a: &a [*a]` is a list that holds itself: infinitely large once expanded
            return limit + 1
        if key not in counts:
            open_nodes.add(key)
            children = node.values() if isinstance(node, dict) else node
            counts[key] = min(limit + 1, 1 + sum(count(child) for child in children))
            open_nodes.discard(key)
        return counts[key]

    try:
        return count(data)
    except RecursionError:  # nested deeper than Python's stack: no recipe is
        return limit + 1


def deepest(data: Any, limit: int = MAX_RECIPE_DEPTH) -> tuple[int, str]:
    """How deep `data` nests (counted up to limit + 1, without recursion) and the dotted key where it does. A node
    shared through YAML aliases is walked once, so an alias bomb costs no more than its text."""
    stack, found, seen = [(data, 1, "")], (0, ""), set()
    while stack:
        node, depth, key = stack.pop()
        if not isinstance(node, (dict, list)) or id(node) in seen:
            continue
        seen.add(id(node))
        found = max(found, (depth, key))
        if depth > limit:
            break
        children = node.items() if isinstance(node, dict) else ((None, child) for child in node)
        stack.extend((child, depth + 1, f"{key}.{name}".lstrip(".") if name is not None else key)
                     for name, child in children)
    return found
