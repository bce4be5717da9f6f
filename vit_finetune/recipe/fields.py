"""The field types every section of the schema is built from: a strict, frozen section, a number that is no boolean,
a whole number within its bound, a path with `~` spelled out once, a colour.
"""

from __future__ import annotations

import os
import re
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, StrictInt

from vit_finetune.recipe.limits import WHOLE_NUMBER_LIMITS, names_fit


def _not_a_bool(value: Any) -> Any:
    # YAML reads `true` as a bool, and pydantic's lax mode would take it as 1 for a number.
    if isinstance(value, bool):
        raise ValueError("a boolean is not a number; give a number")
    return value


def expand_home(value: str | None) -> str | None:
    """`~` (or `~user`) spelled out once, when the recipe is read: every safety check and every write then sees one
    folder (left to each consumer, a check looked in $HOME while a write went to a folder named `~`)."""
    if value is None or not value.startswith("~"):
        return value
    expanded = os.path.expanduser(value)
    if expanded.startswith("~"):
        raise ValueError(f"no home folder is known for {value.split('/')[0]!r}; give the full path")
    return expanded


def at_most(key: str) -> AfterValidator:
    """The bound WHOLE_NUMBER_LIMITS sets on `key`'s whole number (auto and null pass), refused with its reason."""
    limit, why = WHOLE_NUMBER_LIMITS[key]

    def check(value: Any) -> Any:
        if isinstance(value, int) and value > limit:
            raise ValueError(f"must be at most {limit:,} ({why}); give a smaller number")
        return value

    return AfterValidator(check)


def Bounded(key: str, kind: Any = StrictInt) -> Any:
    """A whole-number key (`kind`: the type as it may also be auto or null) within its WHOLE_NUMBER_LIMITS bound."""
    return Annotated[kind, at_most(key)]


ALPHA_COLOUR = re.compile(r"^(white|black|#[0-9a-fA-F]{6})$")


def check_colour(value: str) -> str:
    if not ALPHA_COLOUR.match(value):
        raise ValueError("must be white, black or a colour written #rrggbb, e.g. #ffffff")
    return value


# A path a run reads or writes (or a Hub id); `~` is expanded here and nowhere else.
HomePath = Annotated[str, AfterValidator(expand_home), AfterValidator(names_fit)]


HOME_PATH_KEYS = ("model.base", "data.dataset", "train.resume", "train.distill.teacher", "output_dir")


# Numbers refuse booleans; a float key still takes a YAML int (lr: 1) and YAML 1.1's 1e-4, which it reads as a string.
Float = Annotated[float, BeforeValidator(_not_a_bool)]

# float32's smallest normal number, torch.finfo(torch.float32).tiny: training computes in float32, where a positive
# value below it is a denormal or exactly 0, the very value a key that must be above 0 refuses.
FLOAT32_SMALLEST_NORMAL = 2.0 ** -126


def survives_float32(value: Any) -> Any:
    """A positive number as float32 holds it: one below FLOAT32_SMALLEST_NORMAL is refused with the fix."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < FLOAT32_SMALLEST_NORMAL:
        raise ValueError(f"{value:g} is below float32's smallest normal number ({FLOAT32_SMALLEST_NORMAL:.4g}): "
                         "training computes in float32, where it becomes 0, which this key refuses; give a number of "
                         f"at least {FLOAT32_SMALLEST_NORMAL:.4g}")
    return value


# A float key that must be above 0 (its Field says gt=0) and is computed with in float32.
PositiveFloat = Annotated[float, BeforeValidator(_not_a_bool), AfterValidator(survives_float32)]


class Strict(BaseModel):
    # No path, id or name is longer than PATH_MAX: a longer string is a mistake, and would flood every message.
    # Frozen: a recipe is read and checked once; what a run changes (plan.py) is a copy.
    model_config = ConfigDict(extra="forbid", frozen=True, str_max_length=4096)
