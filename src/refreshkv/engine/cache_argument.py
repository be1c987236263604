"""The keyword under which a model's forward and `generate` take the cache.

transformers 5.24 renamed the argument from `past_key_values` to `cache` (the old name warns and goes away in 5.40
for forwards, 6.0 for `generate`). Every call that hands a cache to a model goes through `with_cache`, which reads
the name from the model's own forward, so the package is silent on both sides of the rename.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from torch import nn

NEW_NAME, OLD_NAME = "cache", "past_key_values"


@functools.cache
def _keyword_of(model_class: type[nn.Module]) -> str:
    return NEW_NAME if NEW_NAME in inspect.signature(model_class.forward).parameters else OLD_NAME


def cache_keyword(model: nn.Module) -> str:
    """`cache` where the model's forward takes it, else `past_key_values`."""
    return _keyword_of(type(model))  # type: ignore[arg-type]  # a class is hashable (mypy issue 20409)


def with_cache(model: nn.Module, cache: object) -> dict[str, Any]:
    """Keyword arguments passing `cache` to `model(...)` or `model.generate(...)`."""
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"model must be a transformers model (a torch module, e.g. from refreshkv.load_model()), got "
            f"{type(model).__name__}"
        )
    return {cache_keyword(model): cache}
