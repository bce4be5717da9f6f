"""Drawing a figure with matplotlib, headless, into a file written atomically: what every picture module shares.

matplotlib is imported when a figure is drawn, not with this module: a run with pictures=false never loads it.
"""

from __future__ import annotations

from pathlib import Path

from .layout import replace_atomically


def pyplot():
    """matplotlib.pyplot on the Agg backend: training machines have no display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure, path: Path, **options) -> None:
    """`figure` drawn into `path` through a temporary file renamed over it, then closed: a kill or a full disk
    midway leaves a picture already there (a user's, or an earlier evaluation's) as it was, never half of one."""
    try:
        replace_atomically(Path(path), lambda partial: figure.savefig(partial, **options))
    finally:
        pyplot().close(figure)
