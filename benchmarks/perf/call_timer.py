"""A function timed into a running sum per name: how the parts scripts (served_step_parts.py,
served_refresh_parts.py) time the plugin's calls without changing them."""

import time
from collections.abc import Callable


def timed_call(function: Callable, name: str, spent: dict[str, float]) -> Callable:
    """`function`, its seconds added to `spent[name]` at every call."""

    def call(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - start

    return call
