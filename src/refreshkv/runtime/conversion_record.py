"""What a GGUF conversion wrote into the cache folder, recorded so that a later load uses only those files.

A converted model is read from the cache at every load; a changed file there (a config's `rope_theta`, overwritten
weights) changed the answers without a word (issue 50). The conversion therefore records, in RECORD inside the
converted folder, the name, size and SHA-256 of every file it wrote; a load checks that the folder holds exactly
those files with those sizes and hashes (`problem`), and the caller converts again otherwise, saying why.

Cost: the weights' SHA-256 is computed once and remembered by their path, inode, size, modification and change
times (cache_folder.file_hash); the conversion remembers the hashes it records, so a load only stats them. A file
rewritten in place gets a new change time, which no user-level tool can set back, so it is hashed again even with its
old modification time restored. That memo lies in the cache folder too, where whoever can write the folder can forge
it; so every file that is not weights (config, generation config, tokenizer files: a few MB at most, milliseconds)
is hashed anew at every load, and a changed config is found whatever the memo says.
"""

from __future__ import annotations

import json
from pathlib import Path

from .cache_folder import content_hash, file_hash

RECORD = "refreshkv-conversion.json"
WEIGHTS = (".safetensors",)  # hashed once and remembered; every other file is hashed at every load


def record(folder: Path) -> None:
    """Record the files of a conversion just written to `folder` (their hashes are remembered as they are taken)."""
    files = {
        path.name: {"size": path.stat().st_size, "sha256": file_hash(path)}
        for path in sorted(folder.iterdir())
        if path.name != RECORD
    }
    staging = folder / f".{RECORD}.partial"
    staging.write_text(json.dumps({"files": files}, indent=1) + "\n")
    staging.replace(folder / RECORD)  # atomic: a reader finds the whole record or none


def problem(folder: Path) -> str | None:
    """Why `folder` is not what its conversion wrote (a file missing, added, resized or changed, or no record), or
    None when it is."""
    try:
        files = json.loads((folder / RECORD).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return "it has no record of the files its conversion wrote"
    present = {path.name for path in folder.iterdir() if path.name != RECORD}
    if present != set(files):
        return f"it holds other files than its conversion wrote ({', '.join(sorted(present ^ set(files)))})"
    for name, expected in files.items():
        path = folder / name
        if path.is_symlink() or not path.is_file():
            return f"{name} is not a plain file"
        digest = file_hash(path) if path.suffix in WEIGHTS else content_hash(path)
        if path.stat().st_size != expected["size"] or digest != expected["sha256"]:
            return f"{name} is not the file its conversion wrote (size or SHA-256 differs)"
    return None
