"""Text that ships with the package (README.md here names each file's source and licence) and the reader of
documents from local files (documents.py)."""

from importlib import resources


def book_text() -> str:
    """The opening chapters of Pride and Prejudice: the demo's and the benchmarks' long prompt."""
    return resources.files(__name__).joinpath("pride-and-prejudice-opening.txt").read_text(encoding="utf-8")
