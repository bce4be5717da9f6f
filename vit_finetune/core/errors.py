"""The project's one error type: a user's mistake or a refused run, each kind with the exit code it ends with; and
the short excerpt and shortened text every message quotes a value or a library's message by.

The CLI catches `VitFinetuneError` alone and prints its message (the Python API, vit_finetune/__init__.py, lets it
reach the caller with the same message); anything else (a plain ValueError from a library, say) is a bug and keeps
its traceback. Each stage defines its own subclass next to its code.
"""

from __future__ import annotations

import reprlib
from typing import Any, Callable

EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # the shell's code for a process stopped by Ctrl-C (128 + SIGINT)


class VitFinetuneError(Exception):
    """Base of every error meant for the user: the message says what was wrong and how to fix it."""

    exit_code = EXIT_FAILURE
    said_elsewhere = False  # another process printed the message


class RunError(VitFinetuneError):
    """A run refused before it started, or whose final model could not be written, with the reason and the fix."""


class StoppedByAnotherProcess(VitFinetuneError):
    """Another process of the launch met a user's error first and said it; this one stops with it, silently."""

    said_elsewhere = True



class Problems(RunError):
    """Several problems a pre-flight found in one recipe, said together: the user fixes them in one go, not one per
    attempt. It ends with the first problem's exit code."""

    def __init__(self, problems: list[VitFinetuneError]):
        self.problems = problems
        self.exit_code = problems[0].exit_code
        listed = "\n".join(f"  - {problem}".replace("\n", "\n    ") for problem in problems)
        super().__init__(f"{len(problems)} problems before the run started:\n{listed}")


def problems_of(*checks: Callable[[], object]) -> list[VitFinetuneError]:
    """Run each check (a function that raises a VitFinetuneError for what it refuses) and return what they raised,
    in order; a check that passes adds nothing."""
    found = []
    for check in checks:
        try:
            check()
        except VitFinetuneError as problem:
            found.append(problem)
    return found


def raise_together(problems: list[VitFinetuneError]) -> None:
    """Nothing found: return. One problem: raised as it is, its message and exit code unchanged. Several: Problems."""
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise Problems(problems)

# torchrun and Accelerate set RANK in each process of a launch; the first prints a user's error at once.
PRINTING_RANK = "0"
# The others wait this long before printing theirs: when the error is the same everywhere (a recipe's, a
# refused base), the launcher stops them meanwhile, as it stops every process once one has failed, and the
# message appears once, not once per process. An error of theirs alone is still printed.
OTHER_RANKS_WAIT_S = 3.0


EXCERPT = reprlib.Repr()
EXCERPT.maxlevel, EXCERPT.maxstring, EXCERPT.maxother, EXCERPT.maxlong = 2, 60, 60, 40
EXCERPT.maxlist = EXCERPT.maxtuple = EXCERPT.maxdict = EXCERPT.maxset = 4


def excerpt(value: Any) -> str:
    """A short repr of a value a message quotes: never the whole of a huge or deeply nested one (reprlib stops
    early)."""
    return EXCERPT.repr(value)


def shortened(text: object, limit: int = 300) -> str:
    """A library's message for one of ours: at most `limit` characters, cut between words (a message cut mid-word,
    "trust_remote_code=Tru", reads as advice it is not), on one line."""
    words = " ".join(str(text).split())
    if len(words) <= limit:
        return words
    cut = words[:limit].rsplit(" ", 1)[0] if " " in words[:limit] else words[:limit]
    return cut + " ..."


def report(error: VitFinetuneError) -> None:
    """Print a user's error on stderr, once per launch of several processes."""
    import os
    import sys
    import time

    if error.said_elsewhere:
        return
    if os.environ.get("RANK", PRINTING_RANK) != PRINTING_RANK:
        time.sleep(OTHER_RANKS_WAIT_S)
    print(f"error: {error}", file=sys.stderr)


# Text someone else chose (a label, a file name, a target's name) made safe to show: every character visible, none
# that moves, hides or restyles the rest. The terminal, the model card and the page show labels through it; the label
# itself is kept as it is wherever it is data (config.json, predict's JSON Lines and CSV). The lowest layer: it
# imports nothing of the package.
def printable(text: object) -> str:
    """`text` with each character Python does not call printable written as its escape: line breaks and other
    controls (a file named "cat.png\\n  0.99  dog" would print a prediction the model never made), and the
    invisible format characters, U+202E RIGHT-TO-LEFT OVERRIDE and the other bidirectional controls among them,
    which reorder the text after them ("\\u202e" is shown instead)."""
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in str(text))


# The data's errors: a dataset that cannot be used as configured, and one image that cannot be decoded. The lowest
# module of the data package: every stage raises them, and the rest of the package catches them by name.
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
