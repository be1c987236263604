"""`python -m refreshkv.lm_eval ARGS`: lm-eval's own command line (the same ARGS) with the model type `refreshkv`
registered. Bad model arguments, a model that is not installed and task data that cannot be found (a shipped task's
`TaskDataError`, or the `datasets` library's FileNotFoundError for a YAML's `data_files`; both name the path) end the
run with one line (exit code 2) instead of a traceback, and so do, before the model loads: an unknown task name, an
`--include_path` that does not exist, an `--output_path` whose folder cannot be written. Ctrl-C is one line (exit
code 130). Results that lm-eval was asked to save but could not (it logs "Could not save ..." and carries on) end the
run with one line and exit code 1, never 0."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from lm_eval._cli import HarnessCLI
from lm_eval.utils import setup_logging

from ..core.policy import PolicyError
from ..runtime.models import ModelError
from . import TASKS_DIR, ModelArgsError  # importing the package registers the model type

PROGRAM = "refreshkv.lm_eval"
LIST_TASKS = f"python -m {PROGRAM} ls tasks (this package's offline tasks: --include_path {TASKS_DIR})"


class ArgumentError(ValueError):
    """An lm-eval argument refused before the model loads; one line."""


class SaveFailures(logging.Handler):
    """lm-eval's "Could not save ..." warnings (its evaluation tracker logs them and carries on), each with the
    reason it logs next where its log level shows it."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.failures: list[str] = []
        self.awaiting_reason = False  # lm-eval logs the exception's repr (at INFO) right after the warning

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if record.levelno >= logging.WARNING and message.startswith("Could not save"):
            self.failures.append(message)
            self.awaiting_reason = True
        elif self.awaiting_reason and record.levelno == logging.INFO:
            self.failures[-1] += f" ({message.splitlines()[0][:200]})" if message else ""
            self.awaiting_reason = False


def writable_folder(path: Path) -> Path | None:
    """The nearest folder that exists at or above `path`, if this process can make files in it."""
    for folder in (path, *path.parents):
        if folder.exists():
            return folder if folder.is_dir() and os.access(folder, os.W_OK | os.X_OK) else None
    return None


def check_paths(args) -> None:
    """`--include_path` folders exist; `--output_path`'s folder (its parent for a .json file) can be written."""
    include = getattr(args, "include_path", None)
    for part in include.split(":") if isinstance(include, str) else []:
        if part and not Path(part).exists():
            raise ArgumentError(f"--include_path {part} does not exist; give a folder (or YAML file) of task configs")
    output = getattr(args, "output_path", None)
    if output:
        path = Path(output)
        target = path.parent if path.suffix == ".json" else path
        if target.exists() and not target.is_dir():
            raise ArgumentError(f"--output_path {output}: {target} is not a folder; give a folder or a .json path")
        if writable_folder(target) is None:
            raise ArgumentError(f"--output_path {output} cannot be written (its folder is not writable); give another")


def run(argv: list[str] | None = None) -> int:
    """lm-eval's command line (`cli_evaluate`'s steps: logging, parse, execute) with the checks above; the exit
    code."""
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    setup_logging()
    tracker_log = logging.getLogger("lm_eval.loggers.evaluation_tracker")
    failures = SaveFailures()
    tracker_log.addHandler(failures)
    try:
        parser = HarnessCLI()
        args = parser.parse_args()
        check_paths(args)
        parser.execute(args)
    except KeyboardInterrupt:
        print(f"{PROGRAM}: interrupted", file=sys.stderr)
        return 130
    except (ModelArgsError, ModelError, PolicyError, FileNotFoundError, ArgumentError) as error:
        print(f"{PROGRAM}: error: {error}", file=sys.stderr)
        return 2
    except ValueError as error:  # lm-eval's own refusal of task names (EvaluatorConfig.process_tasks)
        if not str(error).startswith("Tasks not found"):
            raise
        missing = str(error).removeprefix("Tasks not found:").strip()
        print(f"{PROGRAM}: error: unknown task {missing}; list the tasks with: {LIST_TASKS}", file=sys.stderr)
        return 2
    finally:
        tracker_log.removeHandler(failures)
    if failures.failures:
        output = getattr(args, "output_path", None)
        print(
            f"{PROGRAM}: error: lm-eval did not save what it was asked to save under {output}: "
            f"{'; '.join(failures.failures)}",
            file=sys.stderr,
        )
        return 1
    return 0


def main() -> None:
    sys.exit(run())


if __name__ == "__main__":
    main()
