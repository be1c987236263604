"""The question window's queries of the prompts a worker prefilled, kept where a later prefix-cache hit finds them.

vLLM prefills a prompt found in its prefix cache from its uncached tail only (at least its last token), so the
queries of the window's earlier tokens are never computed again: without them the method would select C_p by the
tail alone, and the same request would answer differently the second time. Each query of a stored prompt's window
is kept under the digest of the tokens up to and including its position (a query depends on those alone), so any
later prompt with the same tokens up to there finds it, whatever follows. Oldest first out beyond `capacity` bytes.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import torch
from torch import Tensor

WINDOW_STORE_BYTES = 256 * 2**20  # per worker; SmolLM2's 32-token window over 30 layers is 2.2 MB a prompt


def prefix_digests(ids: list[int], start: int, end: int) -> list[bytes]:
    """The digest of `ids[: p + 1]` for each position p in [start, end)."""
    running = hashlib.blake2b(digest_size=16)
    running.update(torch.tensor(ids[:start], dtype=torch.int64).numpy().tobytes())
    digests = []
    for token in ids[start:end]:
        running.update(int(token).to_bytes(8, "little", signed=True))
        digests.append(running.copy().digest())
    return digests


class WindowStore:
    def __init__(self, capacity: int = WINDOW_STORE_BYTES):
        self.capacity = capacity
        self.entries: OrderedDict[bytes, dict[int, Tensor]] = OrderedDict()
        self.nbytes = 0
        self.hits = 0  # layers of a prefill that found queries here

    def put(self, digests: list[bytes], layer_idx: int, queries: Tensor) -> None:
        """Keep `queries` (1, Hq, n, D) of one layer, of the positions whose digests are `digests` (n of them)."""
        for digest, query in zip(digests, queries[0].unbind(1)):
            entry = self.entries.setdefault(digest, {})
            self.entries.move_to_end(digest)
            if layer_idx not in entry:
                entry[layer_idx] = query.clone()
                self.nbytes += query.numel() * query.element_size()
        while self.nbytes > self.capacity and len(self.entries) > 1:
            _, gone = self.entries.popitem(last=False)
            self.nbytes -= sum(query.numel() * query.element_size() for query in gone.values())

    def get(self, digests: list[bytes], layer_idx: int) -> Tensor | None:
        """(1, Hq, n, D): the queries of one layer at the longest run of the positions `digests` that ends at the
        last of them and is kept whole; None if the last one is not kept."""
        found: list[Tensor] = []
        for digest in reversed(digests):
            query = self.entries.get(digest, {}).get(layer_idx)
            if query is None:
                break
            found.append(query)
        if not found:
            return None
        self.hits += 1
        return torch.stack(found[::-1], dim=1).unsqueeze(0)

    def clear(self) -> None:
        self.entries.clear()
        self.nbytes = 0


WINDOWS = WindowStore()  # one engine core per process: its worker's prompts
