"""Training data: documents from local files, split by document, cut into windows of L + S tokens.

- Documents: as documents.py reads them (text files, folders of .txt, JSONL with `text`). The `ppl` task reads
  files the same way, so the test split written by `refreshkv train` (split/test.jsonl) is what `eval --task ppl`
  scores.
- Split: 80/10/10 train/dev/test by document, from the seed (a shuffled order cut at 80% and 90%); with three
  documents or more every split gets at least one. Documents, not windows, are split, so no text of the test split
  is trained on.
- Windows: each document is encoded whole (no special tokens) and cut into consecutive, non-overlapping windows;
  every window starts with the tokenizer's BOS token when it has one (the sequence start the model was trained
  with), then L + S - 1 text tokens; the first window starts at the document start. The remainder is dropped, and
  documents too short for one window are skipped and counted.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

from ..runtime.output_files import write_text
from ..texts.documents import Document

SPLITS = ("train", "dev", "test")


def split_documents(documents: list[Document], seed: int) -> dict[str, list[Document]]:
    """80/10/10 train/dev/test by document (every split non-empty from three documents on)."""
    if len(documents) < 3:
        raise ValueError(f"the data holds {len(documents)} document(s); a train/dev/test split needs at least 3")
    order = list(range(len(documents)))
    random.Random(f"split/{seed}").shuffle(order)
    held_out = max(1, round(0.1 * len(documents)))
    cuts = {"test": order[:held_out], "dev": order[held_out : 2 * held_out], "train": order[2 * held_out :]}
    return {split: [documents[i] for i in sorted(cuts[split])] for split in SPLITS}


@dataclasses.dataclass
class Windows:
    windows: list[list[int]]
    skipped: int  # documents shorter than one window


def cut_windows(tokenizer, documents: list[Document], length: int) -> Windows:
    """Consecutive windows of `length` tokens (BOS + text) over each document."""
    bos = getattr(tokenizer, "bos_token_id", None)
    prefix = [] if bos is None else [bos]
    text_tokens = length - len(prefix)
    windows, skipped = [], 0
    for document in documents:
        ids = tokenizer.encode(document.text, add_special_tokens=False)
        if len(ids) < text_tokens:
            skipped += 1
        windows += [
            prefix + ids[start : start + text_tokens] for start in range(0, len(ids) - text_tokens + 1, text_tokens)
        ]
    return Windows(windows, skipped)


def write_split(folder: Path, splits: dict[str, list[Document]]) -> None:
    """split/<name>.jsonl per split (one document per line) and split/documents.json (the names per split)."""
    folder.mkdir(parents=True, exist_ok=True)
    for split, documents in splits.items():
        lines = "".join(json.dumps({"name": d.name, "text": d.text}) + "\n" for d in documents)
        write_text(folder / f"{split}.jsonl", lines, "training split")
    names = {split: [d.name for d in documents] for split, documents in splits.items()}
    write_text(folder / "documents.json", json.dumps(names, indent=1) + "\n", "training split")
