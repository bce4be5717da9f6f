"""CSV files as a spreadsheet opens them: a cell that begins with `=`, `+`, `-`, `@`, a tab or a carriage return is
read as a formula by Excel, LibreOffice and Google Sheets (OWASP's "CSV injection"), so a label or file name such as
`=HYPERLINK("http://…"&A1,"click")` would run when the file is opened. Every CSV this toolkit writes goes through
`csv_writer`, which writes such a cell with a leading single quote: shown as the text it is, never evaluated. A plain
number (`-5.99903`, `+2`, `-1e-05`) runs nothing and stays as written, so a negative prediction reads back as a number.
"""

from __future__ import annotations

import csv
import re
from typing import IO, Iterable

FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
# A decimal number with an optional sign and exponent, and nothing else: what every spreadsheet reads as a number.
PLAIN_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def inert_cell(value: object) -> object:
    """`value`, or its text behind a single quote when a spreadsheet would take it for a formula."""
    if isinstance(value, str) and value.startswith(FORMULA_STARTS) and not PLAIN_NUMBER.fullmatch(value):
        return f"'{value}"
    return value


class InertWriter:
    """csv.writer whose rows are written with every cell made inert (`inert_cell`)."""

    def __init__(self, file: IO[str]):
        self.writer = csv.writer(file)

    def writerow(self, row: Iterable[object]) -> None:
        self.writer.writerow([inert_cell(cell) for cell in row])


def csv_writer(file: IO[str]) -> InertWriter:
    return InertWriter(file)
