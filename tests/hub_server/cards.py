"""The model card's metadata as the Hub reads it: the front matter of README.md, and the check the Hub runs on it
(POST /api/validate-yaml, which huggingface_hub calls before uploading a README.md)."""

from __future__ import annotations

import re
from typing import Any

import yaml  # a dependency of huggingface_hub


def split_front_matter(content: str) -> tuple[str | None, str]:
    """Return (yaml_text or None, body) for a README with '---' front matter."""
    text = content.lstrip("\ufeff")
    if not text.startswith("---"):
        return None, content
    lines = text.splitlines(keepends=True)
    if lines[0].strip() != "---":
        return None, content
    for i in range(1, len(lines)):
        if lines[i].strip() == "---":
            return "".join(lines[1:i]), "".join(lines[i + 1 :])
    return None, content


def load_yaml(text: str) -> Any:
    return yaml.safe_load(text)


def _looks_like_local_path(value: str) -> bool:
    v = value.strip()
    return (
        v.startswith(("/", "./", "../", "~", "\\", ".\\"))
        or v in (".", "..")
        or bool(re.match(r"^[A-Za-z]:[\\/]", v))
        or "\\" in v
    )


def as_str_list(value: Any) -> list | None:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return value
    return None


def validate_card_metadata(content: str, repo_type: str = "model") -> tuple[list[dict], list[dict]]:
    """A light version of the Hub's README metadata check. Returns (errors, warnings)."""
    errors: list[dict] = []
    warnings: list[dict] = []
    yaml_text, _ = split_front_matter(content)
    if yaml_text is None or not yaml_text.strip():
        warnings.append({"message": "empty or missing yaml metadata in repo card"})
        return errors, warnings
    try:
        meta = load_yaml(yaml_text)
    except Exception as e:  # yaml.YAMLError and friends
        errors.append({"message": f"Invalid YAML in README.md metadata: {e}"})
        return errors, warnings
    if meta is None:
        warnings.append({"message": "empty or missing yaml metadata in repo card"})
        return errors, warnings
    if not isinstance(meta, dict):
        errors.append({"message": "README.md metadata must be a YAML mapping"})
        return errors, warnings

    for key in ("datasets", "base_model"):
        if key not in meta:
            continue
        items = as_str_list(meta[key])
        if items is None:
            errors.append({"message": f'"{key}" must be a string or an array of strings'})
            continue
        for item in items:
            if not isinstance(item, str):
                errors.append({"message": f'"{key}" must be a string or an array of strings'})
            elif _looks_like_local_path(item) or not item.strip():
                hint = ("dataset id from https://hf.co/datasets" if key == "datasets"
                        else "model id from https://hf.co/models")
                errors.append(
                    {"message": f'"{key}" with value "{item}" is not valid. It must be a Hub id: use a {hint}.'}
                )
    for key in ("tags", "language"):
        if key in meta:
            items = as_str_list(meta[key])
            if items is None or not all(isinstance(i, str) for i in items):
                errors.append({"message": f'"{key}" must be a string or an array of strings'})
    for key in ("license", "pipeline_tag", "library_name"):
        if key in meta and meta[key] is not None and not isinstance(meta[key], str):
            errors.append({"message": f'"{key}" must be a string'})
    return errors, warnings
