"""One line for an environment where transformers cannot be imported because vLLM's companions sit beside this torch.

vLLM's wheels bring torchvision, torchaudio and torchcodec built for another torch; installed beside this one, the
first `import transformers` that reaches them fails (a ModuleNotFoundError or ImportError, or a RuntimeError such as
"operator torchvision::nms does not exist"). `import refreshkv` then raises `SharedEnvironmentError`, one line that
names the cause and the fix; the command lines (`refreshkv`, `python -m refreshkv...`) print it as their one
error line and exit with code 2. Any other import failure is left as it was. Standard library only: this runs while
the package's own imports are failing.
"""

from __future__ import annotations

import sys
from pathlib import Path

COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
FIX = f"pip uninstall -y {' '.join(COMPANIONS)}, or keep vLLM in its own virtualenv (docs/serving.md)"


class SharedEnvironmentError(ImportError):
    """transformers cannot be imported because of vLLM's companion packages; one line naming the fix."""


def _caused_by_a_companion(error: BaseException) -> bool:
    """Whether the error, or one it was raised from, names a companion package (its module or its operators) or was
    raised inside one."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        name = getattr(current, "name", None) or ""
        if name.split(".")[0] in COMPANIONS or any(companion in str(current) for companion in COMPANIONS):
            return True
        frame = current.__traceback__
        while frame is not None:
            if set(Path(frame.tb_frame.f_code.co_filename).parts) & set(COMPANIONS):
                return True
            frame = frame.tb_next
        current = current.__cause__ or current.__context__
    return False


def broken_by_companions(error: BaseException) -> str | None:
    """The one line for an import failure that vLLM's companions caused, else None."""
    if not isinstance(error, (ImportError, RuntimeError)) or not _caused_by_a_companion(error):
        return None
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return (
        f"transformers cannot be imported here ({type(error).__name__}: {first[:160]}): torchvision, torchaudio or "
        f"torchcodec installed beside this torch break transformers' import (vLLM brings them); fix: {FIX}"
    )


def on_the_command_line() -> bool:
    """Whether this process is one of the package's command lines: the `refreshkv` script, or `python -m refreshkv`
    / `python -m refreshkv.lm_eval` (whose argv[0] is "-m" while Python locates the module)."""
    return sys.argv[:1] == ["-m"] or Path(sys.argv[0] if sys.argv else "").name == "refreshkv"


def refuse(error: BaseException) -> None:
    """Turn an import failure that vLLM's companions caused into its one line: printed with exit code 2 on a
    command line, else raised as `SharedEnvironmentError`. Any other failure is left to propagate as it was."""
    line = broken_by_companions(error)
    if line is None:
        return
    if on_the_command_line():
        print(f"error: {line}", file=sys.stderr)
        raise SystemExit(2)
    raise SharedEnvironmentError(line) from None
