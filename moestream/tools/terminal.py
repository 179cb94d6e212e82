"""The command line's shared pieces: consoles as wide as the terminal (80 columns when the
output is a file or a pipe, ``COLUMNS`` overrides), progress bars that stay on one line,
argument types that reject bad values before anything runs, and the message for an optional
dependency that is not installed."""
from __future__ import annotations

import importlib
from typing import Any

__all__ = ["console", "progress", "MissingExtraError", "require", "positive_int",
           "nonnegative_int", "positive_ints", "nonnegative_ints", "names_from", "print_table"]


def console(**kwargs: Any):
    """A rich Console sized by the terminal (rich reads ``COLUMNS`` and the tty)."""
    from rich.console import Console
    return Console(**kwargs)


def progress(con=None, *, transient: bool = False, disable: bool = False):
    """A progress bar of one line at any width from 40 columns: a short description, a bar
    that takes what is left, done/total and the elapsed time."""
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn,
                               TextColumn, TimeElapsedColumn)
    from rich.table import Column
    text = TextColumn("{task.description}",
                      table_column=Column(no_wrap=True, overflow="ellipsis", ratio=2))
    return Progress(SpinnerColumn(), text, BarColumn(bar_width=None, table_column=Column(ratio=1)),
                    MofNCompleteColumn(), TimeElapsedColumn(),
                    console=con if con is not None else console(), transient=transient,
                    disable=disable, expand=True)


class MissingExtraError(ImportError):
    """An optional dependency is missing; the message says which extra installs it."""


def require(module: str, *, extra: str, why: str) -> Any:
    """Import ``module`` or raise MissingExtraError naming ``pip install 'moestream[extra]'``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(f"{why} needs {module.split('.')[0]}, which is not installed: "
                                f"pip install 'moestream[{extra}]'") from exc


# ---- argument types: argparse reports a bad value as a usage error, before anything runs ----

def _int(text: str, low: int, what: str) -> int:
    import argparse
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An int >= 1."""
    return _int(text, 1, "a positive integer")


def nonnegative_int(text: str) -> int:
    """An int >= 0."""
    return _int(text, 0, "an integer >= 0")


def positive_ints(text: str) -> list[int]:
    """Comma-separated ints >= 1 (at least one)."""
    import argparse
    items = [v for v in text.split(",") if v.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected comma-separated positive integers")
    return [positive_int(v.strip()) for v in items]


def nonnegative_ints(text: str) -> list[int]:
    """Comma-separated ints >= 0 (at least one)."""
    import argparse
    items = [v for v in text.split(",") if v.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected comma-separated integers >= 0")
    return [nonnegative_int(v.strip()) for v in items]


def names_from(valid):
    """An argparse type: comma-separated names, each one of ``valid`` (at least one)."""
    import argparse
    valid = tuple(valid)

    def parse(text: str) -> list[str]:
        items = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in items if v not in valid]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                f"{', '.join(map(repr, bad)) or 'nothing'} not known; choose from "
                f"{', '.join(valid)}")
        return items
    return parse


def print_table(con, *, title: str | None, columns, rows, keys=()) -> list:
    """Print ``rows`` (lists of cell strings, rich markup allowed) under ``columns`` (header,
    justify) without cutting a cell: where the columns do not fit ``con``'s width they are
    printed as several tables, each repeating the columns whose indices are in ``keys`` (the
    ones that name a row). Returns the printed rich Tables."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    # a column's width in a SIMPLE_HEAD box: its widest cell or header, padding, a separator
    width = [max([len(header)] + [Text.from_markup(r[i]).cell_len for r in rows]) + 3
             for i, (header, _) in enumerate(columns)]
    keys = [i for i in range(len(columns)) if i in set(keys)]
    room = con.width - 2 - sum(width[i] for i in keys)
    groups: list[list[int]] = [[]]
    for i in (i for i in range(len(columns)) if i not in keys):
        if groups[-1] and sum(width[j] for j in groups[-1]) + width[i] > room:
            groups.append([])
        groups[-1].append(i)
    tables = []
    for n, group in enumerate(groups):
        table = Table(title=title if n == 0 else None, box=box.SIMPLE_HEAD)
        show = sorted(keys + group)
        for i in show:
            table.add_column(columns[i][0], justify=columns[i][1], no_wrap=True)
        for r in rows:
            table.add_row(*(r[i] for i in show))
        con.print(table)
        tables.append(table)
    return tables
