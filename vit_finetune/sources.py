"""Where a model or a dataset comes from: a folder on this machine, a model shipped inside the package
(`builtin:NAME`, under assets/), or a Hub id, which the Hub's own pattern tells from a path.
"""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent  # vit_finetune/
BUILTIN_PREFIX = "builtin:"  # models shipped inside the package, e.g. builtin:tiny-vit-32 for the offline demo
ASSETS_DIR = PACKAGE_DIR / "assets"
# The Hub's own rule for repo ids: an optional namespace and a name, no spaces, at most 96 characters.
REPO_ID_PATTERN = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")
