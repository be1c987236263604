"""Tables on the terminal that never cut a number: a rich table where it fits the width, otherwise (a narrow
terminal, a pipe: rich takes 80 columns there) the same cells as records, one `header: value` line each."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text


def plain(cell) -> str:
    return cell.plain if isinstance(cell, Text) else str(cell)


def print_table(console: Console, table: Table) -> None:
    natural = console.measure(table, options=console.options.update(max_width=100_000)).maximum
    if natural <= console.width:
        console.print(table)
        return
    headers = [plain(column.header) for column in table.columns]
    rows = zip(*(list(column.cells) for column in table.columns))
    lines = [plain(table.title)] if table.title else []
    for row in rows:
        first, *rest = (plain(cell) for cell in row)
        lines.append(f"{headers[0] or 'row'}: {first}" if headers[0] else first)
        lines += [f"  {header}: {plain(cell)}" for header, cell in zip(headers[1:], rest)]
    if table.caption:
        lines.append(plain(table.caption))
    console.print(Text("\n".join(lines)), soft_wrap=True)
