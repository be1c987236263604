"""What the vLLM plugin runs: `--additional-config '{"refreshkv": {...}}'` (the keys `make_policy` takes), checked at
the engine's start, and a request's own choice in its sampling parameters (`extra_args={"refreshkv": {...}}`).

Only methods that keep the full cache run inside vLLM: their C_f is the request's own block table, untouched, so
prefix caching, preemption and the scheduler work as they are. An eviction method would have to free blocks, which
vLLM's KV manager offers no hook for (docs/serving.md).
"""

from __future__ import annotations

import json
from typing import Any

from ..core.policy import METHODS, Policy, PolicyError, make_policy

CONFIG_KEY = "refreshkv"
# the methods that keep every token and read C_f through the `FullCacheStore` interface, which paged blocks implement
SERVED_METHODS = ("full", "oracle", "recycled", "refreshkv", "streamingllm++")


def served_policy(settings: object, context: int | None = None) -> Policy:
    """The method of `settings` (a dict, or its JSON text), refused in one line (PolicyError) if the plugin cannot
    serve it: an unknown or eviction method, a parameter it does not take, a budget of 0 or above `context`."""
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
    if method not in SERVED_METHODS:
        known = "an eviction method (it would have to free blocks)" if method in METHODS else "unknown"
        raise PolicyError(f"method {method!r} is {known}; inside vLLM choose from: {', '.join(SERVED_METHODS)}")
    if params.get("full_cache", "dense") != "dense":
        raise PolicyError("inside vLLM C_f is vLLM's own paged blocks: full_cache must be 'dense'")
    budget = params.get("budget")
    if context is not None and isinstance(budget, int) and not isinstance(budget, bool) and budget > context:
        raise PolicyError(f"budget {budget} is above the model's context of {context} tokens")
    return make_policy(str(method), **params)
