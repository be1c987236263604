"""Where the package keeps what it converts on a machine: $REFRESHKV_CACHE, default ~/.cache/refreshkv (converted
models: runtime/cache_folder.py). As with XDG_CACHE_HOME, an empty value means the default, and a leading `~` is the
home folder."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("REFRESHKV_CACHE") or "~/.cache/refreshkv").expanduser()
