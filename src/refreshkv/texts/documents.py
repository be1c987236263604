"""Documents from local files, read the same way for training (train/data.py) and for the `ppl` task.

A `.txt` file is one document; a folder gives its `.txt` files (sorted, not recursive); a `.jsonl` file gives one
document per line, from its `text` field. Documents with no text are dropped.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Document:
    name: str  # file name, with ":line" for a JSONL document
    text: str


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")  # as stored: no newline translation
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text") from None


def _jsonl_documents(path: Path) -> list[Document]:
    documents = []
    for number, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{path}:{number} is not a JSON object") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ValueError(f"{path}:{number} has no string field 'text'")
        documents.append(Document(f"{path.name}:{number}", record["text"]))
    return documents


def read_documents(paths) -> list[Document]:
    """Documents of `paths` (text files, folders of .txt, JSONL with `text`), in the order given; empty ones dropped."""
    paths = [Path(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
    if not paths:
        raise ValueError("no data given: pass text files, folders of .txt files or JSONL files with a 'text' field")
    documents = []
    for path in paths:
        if path.is_dir():
            files = sorted(path.glob("*.txt"))
            if not files:
                raise ValueError(f"folder {path} holds no .txt files")
            documents += [Document(file.name, _read_text(file)) for file in files]
        elif path.suffix == ".jsonl" and path.is_file():
            documents += _jsonl_documents(path)
        elif path.is_file():
            documents.append(Document(path.name, _read_text(path)))
        else:
            raise ValueError(f"data path {path} does not exist")
    documents = [document for document in documents if document.text.strip()]
    if not documents:
        raise ValueError(f"the data ({', '.join(map(str, paths))}) holds no text")
    return documents
