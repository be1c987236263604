"""A `PolicyCache` refuses new tokens that do not continue the tokens it holds.

`model.generate` given a cache that holds tokens continues from them: it feeds only the input ids past the cache's
length (transformers' rule for a conversation's next turn, which a PolicyCache follows). Given the same prompt again,
the ids are no longer than what the cache holds, so transformers feeds a slice of them at positions the cache has
already filled: the answer comes from a prompt cut anywhere, and the cache counts those tokens on top of the earlier
generation's (issue 50). A pre-hook on the model reads the position ids of
each forward through the cache and refuses, in one line and before anything changes, new tokens whose first position
is not where the cache's tokens end: the cache must be `reset()` (or a new one made) for a new prompt.

The positions are read on the host. To keep decoding on a GPU free of a wait per step, a one-token forward is checked
only where reading costs nothing (the CPU); a forward of several tokens (a prompt, a question) always is. Steps
that count tokens on the device (runtime/static_decode.py) are not checked: their host count stands still.
"""

from __future__ import annotations

import weakref

import torch

from ..core.policy import PolicyError
from .cache_argument import NEW_NAME, OLD_NAME


class ContinuationCheck:
    """Watches `model`'s forwards through `cache` (held by a weak reference); `close()` removes the hook."""

    def __init__(self, model, cache):
        self._cache = weakref.ref(cache)
        self._handle = model.register_forward_pre_hook(self._check, with_kwargs=True)

    def _check(self, module, args, kwargs) -> None:
        cache = self._cache()
        positions = kwargs.get("position_ids")
        if cache is None or positions is None or kwargs.get(NEW_NAME, kwargs.get(OLD_NAME)) is not cache:
            return
        held = cache.get_seq_length()
        if held == 0 or cache.counting_on_device or (positions.shape[-1] == 1 and positions.device.type != "cpu"):
            return
        expected = cache.positions(held + 1, positions.device)  # each row's next position: held tokens less its pads
        first = positions.reshape(-1, positions.shape[-1])[:, 0]
        if not torch.equal(first, expected.expand_as(first)):
            raise PolicyError(
                f"this PolicyCache holds {held} tokens of a generation and the new tokens start at position "
                f"{int(first.min())}, not where those end: call cache.reset() (or make a new PolicyCache) for a new "
                "prompt, or pass the whole conversation so far to continue it"
            )

    def close(self) -> None:
        self._handle.remove()
