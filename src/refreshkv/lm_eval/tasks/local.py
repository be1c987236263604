# lm-eval imports the functions a task YAML names (`!function local.NAME`) from a file beside it: these are the
# package's (refreshkv/lm_eval/task_data.py).
from refreshkv.lm_eval.task_data import load, score_ruler

__all__ = ["load", "score_ruler"]
