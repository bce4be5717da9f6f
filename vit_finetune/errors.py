"""The project's one error type: a user's mistake or a refused run, each kind with the exit code it ends with.

The CLI catches `VitFinetuneError` alone and prints its message; anything else (a plain ValueError from a
library, say) is a bug and keeps its traceback. Each stage defines its own subclass next to its code.
"""

from __future__ import annotations

EXIT_FAILURE = 1
EXIT_USAGE = 2


class VitFinetuneError(Exception):
    """Base of every error meant for the user: the message says what was wrong and how to fix it."""

    exit_code = EXIT_FAILURE
