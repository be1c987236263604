"""Where the package keeps what it builds on a machine: $REFRESHKV_CACHE, default ~/.cache/refreshkv (converted
models: runtime/cache_folder.py; the compiled selection kernels: core/native_selection.py)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("REFRESHKV_CACHE", Path.home() / ".cache" / "refreshkv"))
