"""The engine's persistent batch as the plugin follows it, row by row, in each worker process: which request each
row of the step's attention metadata is. The engine reports every change (requests added, removed, moved or swapped
between rows) to its logits processors before each forward pass; vllm_rows.py's processor applies them here, and
the attention backend reads the rows. A request that finishes, is aborted or is preempted leaves its row, and its
state goes with it; a preempted request comes back as a new one and starts over. Nothing is keyed on a block."""

from __future__ import annotations

from .request_layer import Request


class BatchRows:
    def __init__(self) -> None:
        self.rows: dict[int, Request] = {}

    def update(
        self, removed: list[int], added: list[tuple[int, Request | None]], moved: list[tuple[int, int, bool]]
    ) -> None:
        """The engine's order: removed, then added (a row may be taken anew), then moved (`swap`: both ways)."""
        for index in removed:
            self.rows.pop(index, None)
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

    def count(self) -> int:
        """Requests with plugin state (the leak check reads it)."""
        return len(self.rows)


ROWS = BatchRows()  # one engine core per process: its worker's batch
