"""The tables of README.md and docs/results.md are what benchmarks/analysis/docs_tables.py draws from the rows."""

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("docs_tables", ROOT / "benchmarks" / "analysis" / "docs_tables.py")
docs_tables = sys.modules["docs_tables"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
spec.loader.exec_module(docs_tables)


def test_the_committed_tables_are_what_the_rows_draw():
    assert docs_tables.stale() == [], "run python benchmarks/analysis/docs_tables.py and commit the tables"


def test_every_table_of_the_docs_is_drawn():
    names = [name for doc in docs_tables.DOCS for name in docs_tables.MARKED.findall(doc.read_text())]
    assert sorted(name for _, name, _, _ in names) == sorted(docs_tables.TABLES)
    results = ROOT / "docs" / "results.md"  # every table of it drawn: none outside the markers
    assert not re.search(r"^\|.*\|$", docs_tables.MARKED.sub("", results.read_text()), re.MULTILINE)


def test_a_figure_edited_by_hand_is_found_and_redrawn(tmp_path):
    readme = tmp_path / "README.md"
    text = (ROOT / "README.md").read_text()
    drawn = docs_tables.TABLES["headline"]()
    assert drawn in text
    readme.write_text(text.replace("| `full` |", "| `full` (edited) |", 1))
    assert docs_tables.stale([readme]) == [readme]
    assert docs_tables.redraw(readme.read_text(), {}) == text
