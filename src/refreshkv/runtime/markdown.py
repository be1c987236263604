"""Markdown tables that show what they print as written (report summaries, benchmark tables): a cell is one line,
HTML-escaped (a method named `<script>` is text), with `|` escaped so that it cannot split the row."""

from __future__ import annotations

import html


def md_text(value) -> str:
    """`value` as Markdown text that shows as written."""
    return html.escape(" ".join(str(value).split()), quote=False).replace("|", "\\|")


def md_row(cells) -> str:
    """One Markdown table row of `cells`, each escaped (`md_text`)."""
    return "| " + " | ".join(md_text(c) for c in cells) + " |"
