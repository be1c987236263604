"""lm-evaluation-harness integration: the model type `refreshkv` (model.py), registered with lm-eval's registry when
this package is imported, and offline tasks with their data (tasks/). lm-eval's command line finds no model outside
its own package, so `python -m refreshkv.lm_eval ...` imports this one and hands over to that command line
(__main__.py); from Python, `import refreshkv.lm_eval` and then `lm_eval.simple_evaluate(model="refreshkv", ...)`.
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    from .model import ModelArgsError, RefreshKVLM
except ModuleNotFoundError as error:
    if (error.name or "").split(".")[0] != "lm_eval":
        raise
    NEEDS = "refreshkv.lm_eval needs lm-eval: pip install 'refreshkv[lm_eval]'"
    if sys.argv[:1] == ["-m"]:  # `python -m refreshkv.lm_eval` while Python locates it: one line, no traceback
        print(f"refreshkv.lm_eval: error: {NEEDS}", file=sys.stderr)
        sys.exit(2)
    raise ModuleNotFoundError(NEEDS, name="lm_eval") from None

TASKS_DIR = Path(__file__).parent / "tasks"  # give it to lm-eval's --include_path

__all__ = ["TASKS_DIR", "ModelArgsError", "RefreshKVLM"]
