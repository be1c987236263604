"""lm-evaluation-harness integration: the model type `refreshkv` (model.py), registered with lm-eval's registry when
this package is imported, and offline tasks with their data (tasks/). lm-eval's command line finds no model outside
its own package, so `python -m refreshkv.lm_eval ...` imports this one and hands over to that command line
(__main__.py); from Python, `import refreshkv.lm_eval` and then `lm_eval.simple_evaluate(model="refreshkv", ...)`.
"""

from __future__ import annotations

from pathlib import Path

from .model import ModelArgsError, RefreshKVLM

TASKS_DIR = Path(__file__).parent / "tasks"  # give it to lm-eval's --include_path

__all__ = ["TASKS_DIR", "ModelArgsError", "RefreshKVLM"]
