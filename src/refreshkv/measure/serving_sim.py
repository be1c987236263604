"""Serving many requests, modelled from `refreshkv bench` measurements (issue 48; docs/serving.md).

Input: a bench result (`refreshkv bench --batch 1,4,8,16 --json`; a run of one row works too): per method at one
context length, ms per decode step at each batch (and, for methods that refresh, of full and partial steps), KV bytes
a row holds, the prefill's tokens/s, the weights' bytes. Output per method: output tokens/s, latency, time to the
first token and the batch reached, for requests arriving at random on several data-parallel replicas.

What the model assumes (said in docs/serving.md):
- Every request has the bench's prompt (its length less its new tokens) and `output_tokens` new tokens, and costs
  what the bench measured at its length throughout (the output is short beside the prompt).
- Arrivals are Poisson at `rate` requests/s (infinite: all at once, the capacity); each goes to the replica holding
  the fewest requests (running and waiting). Replicas hold the whole model each and share nothing (data parallel).
- A replica's KV pool is its memory less the weights; a request holds its row's bytes (KV sized for its output, and
  the decode step's transient where the bench worked it out) from admission to its last token. Waiting requests are
  admitted first come, first served, as many as fit, at the next step boundary (continuous batching).
- Admitted requests are prefilled before the next decode step, at the measured prefill tokens/s, one after the
  other; decoding waits meanwhile (no chunked prefill). The prefill gives each request its first token.
- A decode step of b rows costs the bench's step at b: between measured batches linear, beyond the largest the
  line through the last two, and from a single measured batch scaled like its bytes (weights + b x KV read per row).
- Refreshes (methods whose steps were partly full, partly partial): as measured (the bench's mean step, where one
  row's refresh made the whole batch's step full), or modelled from the full and partial steps with f the share of
  row-layer steps that attended fully: `none` (partial steps only: the ceiling without refreshes), `aligned` (the
  scheduler refreshes rows together, or a paged kernel reads only the refreshing rows' C_f: f of the difference),
  `any-row` (a layer's step is full when any of its b rows refreshes: 1 - (1 - f)^b of it).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import deque

REFRESH_MODES = ("none", "aligned", "any-row")  # besides "measured", for methods that refresh


@dataclasses.dataclass(frozen=True)
class MethodCosts:
    """One method's measured costs at one context length (seconds, bytes)."""

    method: str
    batches: tuple[int, ...]  # measured batch sizes, ascending
    step_s: tuple[float, ...]  # mean decode step at each
    full_s: tuple[float, ...] | None  # full steps (refreshes) at each; None for a method without both kinds
    partial_s: tuple[float, ...] | None
    full_fraction: float  # share of row-layer steps that attended fully
    row_bytes: int  # what a request holds
    attended_bytes: float  # KV read per row and step (mean)
    prefill_tokens_per_s: float

    @property
    def refreshes(self) -> bool:
        return self.full_s is not None


@dataclasses.dataclass(frozen=True)
class Workload:
    rate: float  # requests per second, all replicas together (math.inf: all at once)
    requests: int
    prompt_tokens: int
    output_tokens: int
    replicas: int
    memory_bytes: float  # per replica: weights + KV pool
    seed: int = 0


def older(row: dict, key: str, before: str) -> float:
    """`key` of a bench row; in a result from before issue 48 (one row at a time) its figure for the batch."""
    return row[key] if key in row else row[before]


def bench_costs(result: dict, length: int | None = None) -> tuple[int, dict[str, MethodCosts]]:
    """The length simulated (default the bench's longest) and each method's costs there. Reads bench results of
    one row too (before issue 48: no `batch`, ms per step = ms per token)."""
    lengths = sorted({row["length"] for row in result["rows"]})
    length = lengths[-1] if length is None else length
    if length not in lengths:
        raise ValueError(f"the bench measured lengths {lengths}, not {length}")
    rows = sorted((row for row in result["rows"] if row["length"] == length), key=lambda row: row.get("batch", 1))
    sizes = result.get("row_bytes", {}).get(str(length), {})
    costs = {}
    for method in dict.fromkeys(row["method"] for row in rows):
        mine = [row for row in rows if row["method"] == method]
        first = mine[0]
        both = all(row.get("full_step_ms") is not None and row.get("partial_step_ms") is not None for row in mine)
        costs[method] = MethodCosts(
            method=method,
            batches=tuple(row.get("batch", 1) for row in mine),
            step_s=tuple(older(row, "decode_ms_per_step", "decode_ms_per_token") / 1000 for row in mine),
            full_s=tuple(row["full_step_ms"] / 1000 for row in mine) if both else None,
            partial_s=tuple(row["partial_step_ms"] / 1000 for row in mine) if both else None,
            full_fraction=first["full_step_fraction"],
            row_bytes=older(first, "kv_bytes_held_per_row", "kv_bytes_held") + sizes.get(method, {}).get("decode", 0),
            attended_bytes=older(first, "kv_bytes_attended_per_row", "kv_bytes_attended"),
            prefill_tokens_per_s=first["prefill_tokens_per_s"],  # of all the batch's rows: a row takes prompt / this
        )
    return length, costs


def at_batch(batches: tuple[int, ...], seconds: tuple[float, ...], batch: int, weights: int, attended: float) -> float:
    """A step's seconds at `batch` from those measured at `batches` (module doc: linear between and beyond them;
    from one batch, scaled like the bytes a step reads)."""
    if len(batches) == 1:
        return seconds[0] * (weights + batch * attended) / (weights + batches[0] * attended)
    upper = next((i for i, measured in enumerate(batches) if measured >= batch), len(batches) - 1)
    upper = max(upper, 1)
    (b0, t0), (b1, t1) = (batches[upper - 1], seconds[upper - 1]), (batches[upper], seconds[upper])
    return t0 + (t1 - t0) * (batch - b0) / (b1 - b0)


def step_seconds(costs: MethodCosts, batch: int, refresh: str, weights: int) -> float:
    """One decode step of `batch` rows; `refresh` "measured" or one of REFRESH_MODES (module doc)."""
    if refresh == "measured":
        return at_batch(costs.batches, costs.step_s, batch, weights, costs.attended_bytes)
    full = at_batch(costs.batches, costs.full_s, batch, weights, costs.attended_bytes)
    partial = at_batch(costs.batches, costs.partial_s, batch, weights, costs.attended_bytes)
    f = costs.full_fraction
    share = {"none": 0.0, "aligned": f, "any-row": 1 - (1 - f) ** batch}[refresh]
    return partial + share * (full - partial)


@dataclasses.dataclass
class Request:
    arrival: float
    left: int = 0  # tokens still to decode
    first_token: float = 0.0
    done: float = 0.0


@dataclasses.dataclass
class Replica:
    clock: float = 0.0
    waiting: deque = dataclasses.field(default_factory=deque)
    running: list = dataclasses.field(default_factory=list)
    steps: int = 0  # decode steps taken
    rows_stepped: int = 0  # their batch sizes summed

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)


def arrivals(workload: Workload) -> list[float]:
    if math.isinf(workload.rate):
        return [0.0] * workload.requests
    rng = random.Random(workload.seed)
    times, now = [], 0.0
    for _ in range(workload.requests):
        now += rng.expovariate(workload.rate)
        times.append(now)
    return times


def largest_batch(costs: MethodCosts, workload: Workload, weights: int) -> int:
    """Requests a replica holds at once; refused where not one fits."""
    rows = int((workload.memory_bytes - weights) // costs.row_bytes)
    if rows < 1:
        raise ValueError(
            f"{costs.method}: a replica of {workload.memory_bytes / 2**30:.2f} GB holds the weights "
            f"({weights / 2**30:.2f} GB) and no request ({costs.row_bytes / 2**20:.0f} MB each)"
        )
    return rows


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def simulate(costs: MethodCosts, workload: Workload, refresh: str, weights: int) -> dict:
    """Serve `workload` with `costs` (module doc); the figures a table shows."""
    most = largest_batch(costs, workload, weights)
    prefill_s = workload.prompt_tokens / costs.prefill_tokens_per_s
    replicas = [Replica() for _ in range(workload.replicas)]
    pending = deque(Request(arrival) for arrival in arrivals(workload))
    finished = []
    while len(finished) < workload.requests:
        busy = [replica for replica in replicas if replica.busy]
        now = min((replica.clock for replica in busy), default=math.inf)
        if pending and pending[0].arrival <= now:  # arrivals first, each to the least loaded replica
            request = pending.popleft()
            target = min(replicas, key=lambda replica: len(replica.waiting) + len(replica.running))
            target.clock = max(target.clock, request.arrival)
            target.waiting.append(request)
            continue
        replica = min(busy, key=lambda replica: replica.clock)
        admitted = [replica.waiting.popleft() for _ in range(min(len(replica.waiting), most - len(replica.running)))]
        if admitted:
            for request in admitted:
                replica.clock += prefill_s
                request.first_token, request.left = replica.clock, workload.output_tokens - 1
            replica.running += admitted
        else:
            replica.clock += step_seconds(costs, len(replica.running), refresh, weights)
            replica.steps += 1
            replica.rows_stepped += len(replica.running)
            for request in replica.running:
                request.left -= 1
        for request in [request for request in replica.running if request.left == 0]:
            request.done = replica.clock
            replica.running.remove(request)
            finished.append(request)
    start = min(request.arrival for request in finished)
    end = max(request.done for request in finished)
    latency = [request.done - request.arrival for request in finished]
    first = [request.first_token - request.arrival for request in finished]
    steps = sum(replica.steps for replica in replicas)
    return {
        "method": costs.method,
        "refresh": refresh,
        "largest_batch": most,
        "measured_batches": list(costs.batches),
        "mean_batch": sum(replica.rows_stepped for replica in replicas) / steps if steps else 0.0,
        "output_tokens_per_s": workload.requests * workload.output_tokens / (end - start),
        "latency_p50_s": percentile(latency, 0.5),
        "latency_p99_s": percentile(latency, 0.99),
        "first_token_p50_s": percentile(first, 0.5),
        "first_token_p99_s": percentile(first, 0.99),
    }


def simulate_bench(result: dict, workload: Workload, length: int | None = None, methods=None) -> list[dict]:
    """Every method of a bench result (or `methods`) under `workload`: as measured and, for methods that refresh,
    under each of REFRESH_MODES."""
    _, costs = bench_costs(result, length)
    weights = result["machine"]["weight_bytes"]
    chosen = list(costs) if methods is None else methods
    unknown = [method for method in chosen if method not in costs]
    if unknown:
        raise ValueError(f"the bench has no rows of {', '.join(unknown)}; it has {', '.join(costs)}")
    return [
        simulate(costs[method], workload, refresh, weights)
        for method in chosen
        for refresh in ("measured", *(REFRESH_MODES if costs[method].refreshes else ()))
    ]
