"""The data's errors: a dataset that cannot be used as configured, and one image that cannot be decoded. The
lowest module of the data package: every stage raises them, and the rest of the package catches them by name.
"""

from __future__ import annotations

from ..errors import VitFinetuneError


class DataError(VitFinetuneError):
    """A dataset that cannot be used as configured; the message names the value and the fix."""


class BadImageError(DataError):
    """One sample that cannot be decoded into a usable image."""

    def __init__(self, message: str):
        # Raised in a DataLoader worker, torch re-raises it in the main process as BadImageError(its banner and
        # the worker's traceback as text). Keep our own sentence: the user needs the file, not the worker's stack.
        if "Original Traceback" in message:
            message = message.rsplit(f"{BadImageError.__name__}: ", 1)[-1].strip()
        super().__init__(message)
