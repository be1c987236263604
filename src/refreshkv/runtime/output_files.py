"""Where the package writes the files it makes for the user, and how (results, reports and plots, a conversation's
rows, benchmark JSON and plots, a training run's records). docs/evaluation.md, "Where outputs go", states the rules:

- A path given on the command line (or to a function) is taken as given. A path written inside a file the package
  reads (a sweep YAML's `out`) must lie in that file's folder or in the current working directory, so that a YAML
  from elsewhere cannot make a run write anywhere else (`lies_inside`).
- A file is never written through a symbolic link: a link at the path (even one whose target is missing, which
  would be created) is refused in one line, never followed and never replaced (`refuse_link`, and O_NOFOLLOW or
  O_EXCL on every open, so that a link made after the check is not followed either).
- Only a regular file is ever replaced or appended to: a folder, a device (/dev/full), a FIFO or a socket at the path
  is refused in one line, --force or not (`refuse_not_a_file`), never renamed over.
- An output that a run cannot resume (a trace, a benchmark's JSON and plots) never replaces a file without --force,
  and its folder is checked before the work (`check_output`).
- A file is written whole or not at all: a new file is created exclusively (`create_new`), and a file that is
  replaced is written beside it and renamed over it (`replaced`). The folders leading to a file are the user's
  (given, or the sweep file's): a folder that is a link is followed.

- A write that fails part way (a full disk) is a `WriteFailed` of one line naming the file and the bytes it
  needed; a replaced file is then left as it was, a results file keeps its whole rows (its resume cuts a torn tail).

Every refusal is an `OutputError`, a ValueError of one line naming the path.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import secrets
import stat
import tempfile
from pathlib import Path


class OutputError(ValueError):
    """An output path the package will not write; the message is one line naming it and what to do."""


class WriteFailed(Exception):
    """A write the system refused part way (a full disk, a quota); one line naming the file and the space needed.
    Not a ValueError: the input was fine (the command line exits with 1, not 2)."""


FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # the system's "no room for it" errors


def write_failed(path: Path, what: str, error: OSError, needed: int | None = None) -> WriteFailed:
    """The one line for a write the system refused, with the bytes it needed where they are known."""
    space = "" if needed is None else f" ({needed} bytes needed)"
    return WriteFailed(
        f"cannot write {what} {path}: {error.strerror or error}{space}; free some space and run the command again"
    )


def refuse_link(path: Path, what: str) -> None:
    """Refuse `path` if it is a symbolic link (dangling or not)."""
    if path.is_symlink():
        raise OutputError(
            f"{what} {path} is a symbolic link; files are never written through one: remove it or give another path"
        )


def refuse_not_a_file(path: Path, what: str) -> None:
    """Refuse `path` if a link, or anything but a regular file, is there (a folder, a device such as /dev/full, a
    FIFO, a socket): an output never replaces, appends to or renames over one of those."""
    refuse_link(path, what)
    try:
        mode = path.lstat().st_mode
    except OSError:  # nothing there (or nothing this process may see): the write says what is wrong
        return
    if stat.S_ISREG(mode):
        return
    if stat.S_ISDIR(mode):
        raise OutputError(f"{what} {path} is a folder; give a file path")
    kind = (
        "a FIFO (named pipe)"
        if stat.S_ISFIFO(mode)
        else "a device"
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
        else "a socket"
        if stat.S_ISSOCK(mode)
        else "not a file"
    )
    raise OutputError(f"{what} {path} is {kind}, not a regular file; give a file path (--force or not)")


def check_output(path: Path, what: str, force: bool) -> None:
    """Refuse, before any work, an output that could not be written at the end (a link, a folder or other non-file
    at the path, a folder that is missing or cannot take a file) or that would replace a file without `force` (the
    command's --force)."""
    refuse_not_a_file(path, what)
    if path.exists() and not force:
        raise OutputError(f"{what} {path} exists; give --force to replace it, or choose another file")
    try:
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as error:
        raise _cannot(path, what, error) from None


def _cannot(path: Path, what: str, error: OSError) -> OutputError:
    return OutputError(f"cannot write {what} {path} ({error.strerror or error}); give a path in a writable folder")


def _exclusive(path: Path) -> int:
    """`path` created for writing, never through a link (O_EXCL does not follow one, O_NOFOLLOW says so)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)


def create_new(path: Path, what: str) -> int:
    """A descriptor of `path`, created now for writing: refused if anything (a file, a link) is there already or its
    folder cannot take it."""
    refuse_link(path, what)
    try:
        return _exclusive(path)
    except FileExistsError:
        refuse_not_a_file(path, what)  # made since the check
        raise OutputError(f"{what} {path} exists; remove it or choose another file") from None
    except OSError as error:
        raise _cannot(path, what, error) from None


@contextlib.contextmanager
def new_text_file(path: Path, what: str):
    """A text file created now at `path` (`create_new`), removed again when the block leaves it empty (a run that
    failed before its first line leaves nothing); a full disk while writing it is a `WriteFailed`."""
    file = os.fdopen(create_new(path, what), "w", encoding="utf-8")
    try:
        yield file
    except OSError as error:
        if error.errno not in FULL:
            raise
        raise write_failed(path, what, error) from None
    finally:
        empty = file.tell() == 0
        file.close()
        if empty:
            path.unlink(missing_ok=True)


def write_bytes(path: Path, data: bytes, what: str) -> None:
    """`data` as the whole new content of `path`, written beside it, then renamed over it: a reader sees the old file
    or the new one, never a part. A link or anything but a regular file at `path` is refused; a full disk is a
    `WriteFailed`, the old file kept."""
    refuse_not_a_file(path, what)
    staging = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.partial")
    try:
        file = os.fdopen(_exclusive(staging), "wb")
    except OSError as error:
        raise (
            write_failed(path, what, error, len(data)) if error.errno in FULL else _cannot(path, what, error)
        ) from None
    try:
        try:
            with file:
                file.write(data)
        except OSError as error:
            raise write_failed(path, what, error, len(data)) from None
        refuse_not_a_file(path, what)  # made while writing: the rename would replace it, still refused
        try:
            os.replace(staging, path)
        except OSError as error:  # e.g. a folder of that name
            raise _cannot(path, what, error) from None
    finally:
        staging.unlink(missing_ok=True)


def lies_inside(path: Path, folders: list[Path]) -> bool:
    """Whether `path` lies in one of `folders` (both resolved: neither `..` nor a link leads out)."""
    target = path.resolve()
    return any(target.is_relative_to(folder.resolve()) for folder in folders)


def write_text(path: Path, text: str, what: str) -> None:
    """`text` (UTF-8) as the whole new content of `path`, by `write_bytes`."""
    write_bytes(path, text.encode("utf-8"), what)


def save_figure(figure, path: Path, what: str, dpi: int) -> None:
    """A matplotlib figure as a PNG at `path`, by `write_bytes`."""
    image = io.BytesIO()
    figure.savefig(image, format="png", dpi=dpi)
    write_bytes(path, image.getvalue(), what)
