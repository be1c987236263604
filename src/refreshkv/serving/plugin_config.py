"""What the vLLM plugin runs: `--additional-config '{"refreshkv": {...}}'` (the keys `make_policy` takes), checked at
the engine's start, and a request's own choice: `extra_args={"refreshkv": {...}}` in its sampling parameters
offline, `extra_body={"vllm_xargs": {"refreshkv": "<the same object as JSON text>"}}` through the OpenAI server
(whose `vllm_xargs` takes strings and numbers only). Both go through `served_policy`, one check.

Only methods that keep the full cache run inside vLLM: their C_f is the request's own block table, untouched, so
prefix caching, preemption and the scheduler work as they are. An eviction method would have to free blocks, which
vLLM's KV manager offers no hook for (docs/serving.md).
"""

from __future__ import annotations

import json
import math
from typing import Any

from ..core.policy import METHODS, Policy, PolicyError, check_budget_fits, make_policy

CONFIG_KEY = "refreshkv"
# the methods that keep every token and read C_f through the `FullCacheStore` interface, which paged blocks implement
SERVED_METHODS = ("fasa", "full", "oracle", "quest", "recycled", "refreshkv", "streamingllm++")
EVICTING = "an eviction method: vLLM's KV manager frees no blocks in the middle of a request"


def served_policy(settings: object, context: int | None = None) -> Policy:
    """The method of `settings` (a dict, or its JSON text), refused in one line (PolicyError) if the plugin cannot
    serve it: an unknown or eviction method, a parameter it does not take or of the wrong type, a budget of 0 or
    above `context`."""
    if isinstance(settings, str):
        try:
            settings = json.loads(settings)
        except json.JSONDecodeError as error:
            raise PolicyError(f"the '{CONFIG_KEY}' settings are not JSON ({error.msg}); give an object") from None
    if not isinstance(settings, dict):
        raise PolicyError(
            f"the '{CONFIG_KEY}' settings must be an object such as "
            f'{{"method": "refreshkv", "budget_ratio": 0.125}}, got {type(settings).__name__}'
        )
    params: dict[str, Any] = dict(settings)
    method = params.pop("method", "refreshkv")
    choices = f"inside vLLM choose from: {', '.join(SERVED_METHODS)}"
    if not isinstance(method, str):
        raise PolicyError(f"method must be a method's name, got {json.dumps(method)}; {choices}")
    if method not in SERVED_METHODS:
        reason = EVICTING if method in METHODS else "unknown"
        raise PolicyError(f"method {method!r} is {reason}; {choices}")
    for key, value in params.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise PolicyError(f"{key} must be a finite number, got {value}")
    if params.get("full_cache", "dense") != "dense":
        raise PolicyError("inside vLLM C_f is vLLM's own paged blocks: full_cache must be 'dense'")
    try:
        policy = make_policy(method, **params)
    except (TypeError, ValueError) as error:  # a value of a type no check expected: still one line, naming it
        if isinstance(error, PolicyError):
            raise
        given = ", ".join(f"{key}={json.dumps(value)}" for key, value in params.items())
        raise PolicyError(f"method '{method}' cannot take {given}: {error}") from None
    check_budget_fits(policy, context)
    return policy


def worst_case_bytes(policy: Policy, max_model_len: int, max_num_seqs: int, layers: int, slot_bytes: int) -> int:
    """The most the plugin's per-request state can hold at once: `max_num_seqs` requests, each with a C_p on each of
    `layers` at the largest K a prompt of `max_model_len` gives (where the method keeps the answer beside it,
    `keep_decoded`, room for an answer up to the context) and a copy of its answer's keys and values (kept for a
    preemption, request_layer.py); `slot_bytes`: one token's keys, values, position and score on one layer."""
    budget = policy.budget_for(max_model_len)
    slots = max_model_len + 1 if getattr(policy, "keep_decoded", False) else budget + 1
    return max_num_seqs * layers * (slots + max_model_len - budget) * slot_bytes
