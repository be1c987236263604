"""The local cache folder of converted models: where it is, content hashes remembered in it, and the lock that
makes concurrent first loads convert once.

$REFRESHKV_CACHE, default ~/.cache/refreshkv (core/cache_root.py). A conversion is keyed by the GGUF's content
(SHA-256), not its name: another file with the same name and size gets its own conversion. The hash of a file is
computed once and remembered by path, inode, size, modification and change times (hashes/): a file rewritten in
place, even with its modification time set back, has a new change time and is hashed again.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
from pathlib import Path

from ..core.cache_root import cache_dir


def content_hash(path: Path) -> str:
    """SHA-256 of a file's content, computed now."""
    with path.open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def file_hash(path: Path) -> str:
    """SHA-256 of a file's content, remembered in the cache by path, inode, size, mtime and ctime so that it is
    computed once."""
    stat = path.stat()
    identity = f"{path.resolve()}|{stat.st_ino}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ctime_ns}"
    memo = cache_dir() / "hashes" / hashlib.sha256(identity.encode()).hexdigest()[:32]
    if memo.is_file():
        return memo.read_text().strip()
    digest = content_hash(path)
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        staging = memo.with_suffix(f".{os.getpid()}")
        staging.write_text(digest)
        staging.replace(memo)  # atomic: a reader never sees half a hash
    except OSError:
        pass  # a read-only cache still serves its conversions; the file is hashed again next time
    return digest


@contextlib.contextmanager
def exclusive(target: Path):
    """Hold the conversion lock of `target` (a file beside it), removed when released.

    A process that waited on a lock file which the holder then removed finds, once it has the lock, that the name
    no longer points to its file: it takes the lock again through the new file. So removing the file is safe, and
    no lock file stays behind.
    """
    path = target.parent / f".{target.name}.lock"
    while True:
        lock = open(path, "a")  # noqa: SIM115 (closed below, after the unlock)
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if os.stat(path).st_ino == os.fstat(lock.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        lock.close()
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        lock.close()
