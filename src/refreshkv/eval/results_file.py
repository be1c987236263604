"""The JSONL results file of a run (`ResultsFile`, locked from opening to closing) and reading results back.

One row per example, written as one whole line with a single `write` on a file opened in append mode, then fsync'd:
a run killed at any moment loses at most the example in flight. Rows are keyed by `config` (a hash of the
configuration, see `RunConfig.key` in config.py) and the example `id`; re-running skips the keys already in the file.

Every row also carries `run`, the identity of what wrote the file (`refreshkv eval`: the configuration key;
`refreshkv sweep`: the sweep's key). A file whose rows have another `run` is refused before anything is written.

Torn last line: a row counts only once its newline is written. A final line without a newline (a write cut short,
e.g. by a full disk or a crash of the machine) is ignored when reading and cut off before the next row is appended,
so the example is simply run again. A complete line that is not a JSON object is an error naming file and line.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path

from ..runtime.output_files import refuse_not_a_file, write_failed


class ResultsError(ValueError):
    """A results file that cannot be read or does not belong to this run (one line: file, line, what)."""


def is_number(value, integer: bool = False) -> bool:
    """An int (or, unless `integer`, a float), but not a bool: JSON, YAML and true/false on the command line."""
    return isinstance(value, int if integer else (int, float)) and not isinstance(value, bool)


def canonical(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def short_hash(value) -> str:
    return hashlib.sha256(canonical(value).encode()).hexdigest()[:16]


REQUIRED = ("run", "config", "id")


def read_results(
    path: str | os.PathLike, required: Iterable[str] = REQUIRED, warn: bool = True, numbers: Iterable[str] = ()
):
    """(rows, bytes of complete lines, whether a torn last line was found). Malformed rows raise ResultsError.

    `numbers`: fields that must hold a number (or null) where a row has them.
    """
    path = Path(path)
    if not path.exists():
        return [], 0, False
    if not path.is_file():
        raise ResultsError(f"{path} is not a file")
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    torn = bool(data[end:].strip())
    if torn:
        _refuse_a_complete_non_row(path, data[end:], data[:end].count(b"\n") + 1)
    rows = []
    for number, line in enumerate(data[:end].split(b"\n")[:-1], 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ResultsError(f"{path}:{number}: malformed JSONL row ({error})") from None
        if not isinstance(row, dict):
            raise ResultsError(f"{path}:{number}: malformed JSONL row (not a JSON object)")
        missing = [name for name in required if name not in row]
        if missing:
            raise ResultsError(f"{path}:{number}: row lacks the field(s) {', '.join(missing)}")
        for name in numbers:
            if row.get(name) is not None and not is_number(row[name]):
                raise ResultsError(f"{path}:{number}: field {name} must be a number, got {row[name]!r}")
        rows.append(row)
    if torn and warn:
        print(f"warning: {path}:{len(rows) + 1}: ignoring an incomplete last line (a cut-short write)", file=sys.stderr)
    return rows, end, torn


JSON_KINDS = {list: "array", str: "string", bool: "boolean", type(None): "null"}


def _refuse_a_complete_non_row(path: Path, tail: bytes, number: int) -> None:
    """A last line without its newline is a cut-short write, unless it is complete JSON that is no row (a JSON array
    or a pretty-printed object written by something else): that is refused, naming its line."""
    try:
        value = json.loads(tail)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return
    if not isinstance(value, dict):
        raise ResultsError(
            f"{path}:{number}: malformed JSONL row (a JSON {JSON_KINDS.get(type(value), 'number')}, not an object); a "
            "results file holds one JSON object per line"
        )


def done_key(row: dict) -> tuple:
    """What a row marks done: its configuration and example (a conversation's turns share their example)."""
    return row["config"], row.get("conversation", row["id"])


class ResultsFile:
    """The JSONL output of one run, locked from opening to closing: the rows already done, and whole-line appends.

    The file is opened (created if missing) and locked before it is read, so `done` stays what the file holds until
    `close`: a second run on the same file is refused instead of repeating rows, and the torn tail cut before the
    first append is the one read here. Opening first also refuses an unwritable path before any work is done; a file
    this run created and never wrote to is removed again on close. A symbolic link is refused, never followed
    (runtime/output_files.py).
    """

    def __init__(self, path: str | os.PathLike, run: str):
        self.path = Path(path)
        self.run = run
        self._fd, self._created = self._open_locked()
        try:
            rows, self._end, self._torn = read_results(self.path)
            self.done = self._done_in(self.path, rows)
        except BaseException:
            self.close()
            raise

    def _done_in(self, path: Path, rows: list[dict]) -> set[tuple]:
        """The (config, id) keys of `rows`, refusing a file that holds rows of another run."""
        others = sorted({str(row["run"]) for row in rows if row["run"] != self.run})
        if others:
            raise ResultsError(
                f"{path} holds results of another configuration (run {others[0]}, this run is {self.run}); "
                "choose another output file, nothing was written"
            )
        return {done_key(row) for row in rows}

    def include_done(self, paths: Iterable[Path]) -> None:
        """Count the rows of other files of this run (a sweep's rank files) as done; they are read, never written."""
        for path in paths:
            if path != self.path:
                self.done |= self._done_in(path, read_results(path, warn=False)[0])

    def _open_locked(self) -> tuple[int, bool]:
        """(descriptor holding the lock, whether this run created the file)."""
        refuse_not_a_file(self.path, "results file")  # a FIFO would block the open; a device takes no rows
        append = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW  # a link made after the check is not followed either
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            while True:
                try:
                    fd, created = os.open(self.path, append | os.O_CREAT | os.O_EXCL, 0o644), True
                except FileExistsError:
                    fd, created = os.open(self.path, append), False
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    raise ResultsError(f"{self.path} is being written by another run") from None
                if self._is_current(fd):
                    return fd, created
                os.close(fd)  # removed by a run that wrote nothing, between our open and our lock: open it afresh
        except OSError as error:
            raise ResultsError(
                f"cannot write {self.path} ({error.strerror or error}); choose another output file"
            ) from None

    def _is_current(self, fd: int) -> bool:
        try:
            return os.path.samestat(os.fstat(fd), os.stat(self.path))
        except FileNotFoundError:
            return False

    def append(self, *rows: dict) -> None:
        """Whole lines at the end of the file, in one write (a conversation's turns land together or not at all)."""
        if self._torn:  # cut the torn tail read under this lock, so that the next row starts on its own line
            os.ftruncate(self._fd, self._end)
            self._torn = False
        data = "".join(json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n" for row in rows).encode()
        try:
            written = os.write(self._fd, data)  # O_APPEND: one write of the whole lines at the end of the file
            if written != len(data):  # the rest would not fit: what was written is a torn tail, cut on resume
                raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} after {written} of {len(data)} bytes")
            os.fsync(self._fd)
        except OSError as error:
            raise write_failed(self.path, "results file", error, len(data)) from None
        self.done.update(done_key(row) for row in rows)

    def close(self) -> None:
        if self._fd is None:
            return
        if self._created and os.fstat(self._fd).st_size == 0:
            self.path.unlink(missing_ok=True)  # still locked: a run that failed before its first row leaves no file
        os.close(self._fd)
        self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
