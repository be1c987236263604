"""`python -m refreshkv.lm_eval ARGS`: lm-eval's own command line (the same ARGS) with the model type `refreshkv`
registered. Bad model arguments, a model that is not installed and task data that cannot be found (a shipped task's
`TaskDataError`, or the `datasets` library's FileNotFoundError for a YAML's `data_files`; both name the path) end the
run with one line (exit code 2) instead of a traceback."""

from __future__ import annotations

import sys

from lm_eval.__main__ import cli_evaluate

from ..core.policy import PolicyError
from ..runtime.models import ModelError
from . import ModelArgsError  # importing the package registers the model type


def main() -> None:
    try:
        cli_evaluate()
    except (ModelArgsError, ModelError, PolicyError, FileNotFoundError) as error:
        print(f"refreshkv.lm_eval: error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
