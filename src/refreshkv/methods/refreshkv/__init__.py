"""`refreshkv` (RefreshKV) and `recycled` (Recycled Attention), in four parts: the policy, its parameters and
schedule (policy.py); the dynamic schedule's query check (query_check.py); the partial cache C_p and the one rule that
refreshes it, whatever holds C_f (partial_cache.py); the step static decoding replays on the device (device_step.py)."""

from .partial_cache import RefreshState, SelectionRule
from .policy import Recycled, RefreshKV, default_question_floor
from .query_check import default_threshold

__all__ = ["Recycled", "RefreshKV", "RefreshState", "SelectionRule", "default_question_floor", "default_threshold"]
