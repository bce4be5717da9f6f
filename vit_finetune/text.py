"""Text someone else chose (a label, a file name, a target's name) made safe to show: every character visible, none
that moves, hides or restyles the rest. The terminal, the model card and the page show labels through it; the label
itself is kept as it is wherever it is data (config.json, predict's JSON Lines and CSV).

The lowest layer: it imports nothing of the package.
"""

from __future__ import annotations


def printable(text: object) -> str:
    """`text` with each character Python does not call printable written as its escape: line breaks and other
    controls (a file named "cat.png\\n  0.99  dog" would print a prediction the model never made), and the
    invisible format characters, U+202E RIGHT-TO-LEFT OVERRIDE and the other bidirectional controls among them,
    which reorder the text after them ("\\u202e" is shown instead)."""
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in str(text))
