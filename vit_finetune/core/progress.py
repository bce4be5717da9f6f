"""What a run shows while it works: a redrawn bar on a terminal or in a notebook's cell, plain periodic lines in a
log file or CI, and only the result with --quiet.

A redrawn tqdm bar written to a file is one endless line of carriage returns; a log reader wants one line per
logged step instead.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

_quiet = False
_LIBRARY_SWITCHES = ("HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY",
                     "PYTHONWARNINGS")


@contextmanager
def configured(quiet: bool = False) -> Iterator[None]:
    """What the libraries show for the length of one command. Entered by the CLI before the heavy libraries load
    (their own bars follow the same choice); on leaving, the caller's logging, warning filters and environment are
    as they were, so a notebook or a test that calls the CLI in-process keeps its warnings."""
    global _quiet
    saved_env = {name: os.environ.get(name) for name in _LIBRARY_SWITCHES}
    saved_disable, saved_quiet = logging.root.manager.disable, _quiet
    # transformers sets its logger's level from TRANSFORMERS_VERBOSITY when it is first imported, maybe inside this.
    library_logger = logging.getLogger("transformers")
    saved_library_level = library_logger.level
    with warnings.catch_warnings():
        _quiet = quiet or _quiet
        if quiet or not interactive():
            # Read by datasets and huggingface_hub when they are imported.
            os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
            os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        if quiet:
            # Only the result and errors: the libraries' warnings (deprecations, notices) and log records below
            # ERROR go too, in this process and in the processes it starts (DataLoader workers, a launcher's).
            os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
            os.environ.setdefault("PYTHONWARNINGS", "ignore")
            warnings.simplefilter("ignore")
            logging.disable(logging.WARNING)
        try:
            yield
        finally:
            _quiet = saved_quiet
            logging.disable(saved_disable)
            library_logger.setLevel(saved_library_level)
            for name, value in saved_env.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def is_quiet() -> bool:
    return _quiet


def interactive() -> bool:
    """A terminal that can redraw a bar (not a pipe, a log file or CI), or a notebook's cell."""
    return sys.stderr.isatty() or in_notebook()


def in_notebook() -> bool:
    """A Jupyter kernel runs this (Colab, Kaggle, JupyterLab): its stderr is no terminal, yet a cell redraws a bar, and
    tqdm.auto draws its notebook bar there (ipywidgets'; without them, its plain bar). Read as tqdm.auto reads it."""
    ipython = sys.modules.get("IPython")  # imported by the kernel itself: never imported here
    shell = getattr(ipython, "get_ipython", lambda: None)() if ipython else None
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


def say(text: str) -> None:
    """A status line on stdout (the bar and its log lines go to stderr); nothing with --quiet."""
    if _quiet:
        return
    if interactive():
        from tqdm.auto import tqdm

        tqdm.write(text)  # above the bar, which is redrawn below it
    else:
        print(text, flush=True)


class LogLines:
    """The tqdm methods the training loop uses, printing one plain line per set_postfix (each logged step)."""

    def __init__(self, total: int, initial: int = 0, desc: str = "train", disable: bool = False, unit: str = "step"):
        self.total, self.count, self.desc, self.disable, self.unit = total, initial, desc, disable, unit
        self.start = time.perf_counter()

    def update(self, steps: int = 1) -> None:
        self.count += steps

    def set_postfix(self, **values) -> None:
        if self.disable:
            return
        elapsed = time.perf_counter() - self.start
        fields = " ".join(f"{key} {value}" for key, value in values.items())
        print(f"{self.desc} {self.unit} {self.count}/{self.total} ({100 * self.count / max(1, self.total):.0f}%) {fields} "
              f"[{elapsed:.0f}s]", file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def progress(total: int, initial: int = 0, desc: str = "train", enabled: bool = True, unit: str = "step"):
    """A tqdm bar on a terminal, LogLines elsewhere; silent when disabled or quiet."""
    disable = not enabled or _quiet
    if interactive():
        from tqdm.auto import tqdm

        return tqdm(total=total, initial=initial, desc=desc, disable=disable, dynamic_ncols=True, unit=unit)
    return LogLines(total, initial, desc, disable, unit)


def passes(batches, desc: str, enabled: bool = True):
    """`batches` (a sized iterable) with a bar of its own, counted in batches; closed when the iteration ends."""
    bar = progress(len(batches), desc=desc, enabled=enabled, unit="batch")
    try:
        for batch in batches:
            yield batch
            bar.update(1)
    finally:
        bar.close()
