"""The engine's persistent batch as the plugin follows it, row by row, in each worker process: which request each
row of the step's attention metadata is. The engine reports every change (requests added, removed, moved or swapped
between rows) to its logits processors before each forward pass; vllm_rows.py's processor applies them here, and
the attention backend reads the rows.

A request leaves its row when it finishes or is aborted, and also when vLLM preempts it or skips it for a step; the
last two come back. So a request that leaves is parked (`parked`), its state whole, until the engine drops the
sampling parameters it was added with (it keeps them while the request may come back): a request that comes back
with the same parameters and the same running answer continues on its own C_p and schedule, whatever vLLM
recomputed of its blocks. A request that leaves having decoded all it may, or with a stop token last, is done and is
not parked (a server may hold a finished request's parameters a while). Nothing is keyed on a block, which prefix
caching shares between requests.
"""

from __future__ import annotations

import weakref

from .request_layer import Request

PARKED_AT_MOST = 1024  # requests; beyond it the oldest parked state goes (its request, if it comes back, starts over)


class BatchRows:
    def __init__(self) -> None:
        self.rows: dict[int, Request] = {}
        # by the id of the engine's list of the request's answer tokens (the same list while the request lives)
        self.parked: dict[int, Request] = {}

    def update(
        self, removed: list[int], added: list[tuple[int, Request | None]], moved: list[tuple[int, int, bool]]
    ) -> None:
        """The engine's order: removed, then added (a row may be taken anew), then moved (`swap`: both ways)."""
        for index in removed:
            request = self.rows.pop(index, None)
            if request is not None:
                self.park(request)
        for index, request in added:
            if request is None:
                self.rows.pop(index, None)
            else:
                self.rows[index] = request
        for first, second, swap in moved:
            moving, other = self.rows.pop(first, None), self.rows.pop(second, None)
            if moving is not None:
                self.rows[second] = moving
            if swap and other is not None:
                self.rows[first] = other

    def park(self, request: Request) -> None:
        """Keep a request that left the batch while the engine holds its sampling parameters, unless it finished."""
        if request.owner is None or request.owner() is None or request.finished():
            return
        key = id(request.answer)
        self.parked[key] = request
        weakref.finalize(request.owner(), self.parked.pop, key, None)
        while len(self.parked) > PARKED_AT_MOST:
            self.parked.pop(next(iter(self.parked)))

    def resume(self, params: object, answer: list[int]) -> Request | None:
        """The parked request the engine adds again (the same parameters and answer list), taken out of the park."""
        request = self.parked.get(id(answer))
        if request is None or request.answer is not answer or request.owner is None or request.owner() is not params:
            return None
        request.come_back()
        return self.parked.pop(id(answer))

    def count(self) -> int:
        """Requests with plugin state, in the batch or parked (the leak check reads it)."""
        return len(self.holders())

    def holders(self) -> set[int]:
        """The ids of the requests with plugin state, in the batch or parked."""
        return {id(request) for request in (*self.rows.values(), *self.parked.values())}


ROWS = BatchRows()  # one engine core per process: its worker's batch
