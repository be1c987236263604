"""How many rows fit in memory: what a batched `bench` works out before it times anything (issue 48).

A row's bytes under a method (`RowBytes`):
- `kv`, measured: the method's cache after one prefill of one row at the benchmarked length, sized for the tokens
  still to be decoded (stores are allocated for them at prefill): `full` the whole sequence, refreshkv and recycled
  C_f (in their `full_cache` format: int4 is 4-bit codes plus scales) and C_p, an eviction method its K tokens and
  the decoded ones. Measured rather than modelled, so it holds for every method, layer-adaptive ones included.
  `kv_layer`, measured alike: the largest layer's share.
- `decode`, estimated: one decode step's transient per row, at most one layer's at a time: the logits over the
  vocabulary (and a float32 copy), float32 logits, probabilities and selection scores per query head over the whole
  context (a full step or a refresh), and, for a C_f not held densely (quantized, offloaded), that layer's keys and
  values made dense. Small beside the KV; an overestimate for methods that never attend to the whole context.
- `prefill`, estimated: the prompt's forward per row, one layer at a time: hidden states (residual, normed input,
  attention output), queries, keys and values, the MLP's gate, up and product, and attention scores of up to 256
  prompt queries per query head (H2O scores the prompt in blocks of 256).

A run of B rows prefills N of them (N = B, or `bench --distinct-rows N`: the N rows repeated to B after the prefill,
runtime/generate.py `repeat_rows`) and its peak is the most that one of four phases holds (`working_set`):
- a prefill forward: N x kv and G x prefill for G rows per forward (a batch is prefilled a few rows at a time when
  all at once would not fit, runtime/generate.py `prefill_in_groups`);
- when G < N, the join of the groups' caches: N x kv and N x kv_layer (engine/join_rows.py moves one layer at a time);
- when N < B, the copies: B x kv and N x kv_layer (one layer at a time, its N rows freed once copied);
- a decode step: B x kv and B x decode.
`--memory-cap` bounds the whole run: weights + that working set (the process's own memory, the interpreter and
PyTorch's libraries, is not counted); each method's batch is the largest that fits with one row per prefill forward,
and its prefill then takes as many rows per forward as still fit. A run without a cap is checked against the memory
free here the same way. GB here are 2^30 bytes, as the tables' MB are 2^20.
"""

from __future__ import annotations

import bisect
import dataclasses
from pathlib import Path

import torch

from ..core.policy import Policy
from ..engine.cache import PolicyCache
from ..engine.shared_prefill import SharedPrefill
from ..runtime.generate import prefill

GB = 2**30
PREFILL_SCORED_QUERIES = 256  # H2O's block of prompt queries (methods/h2o.py), the largest a built-in method scores


@dataclasses.dataclass(frozen=True)
class RowBytes:
    kv: int  # measured
    kv_layer: int  # measured: the largest layer's
    decode: int  # estimated
    prefill: int  # estimated


def gb(size: float) -> str:
    return f"{size / GB:.2f} GB"


def _text(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _sizes(text) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of the model's attention."""
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return heads, getattr(text, "num_key_value_heads", None) or heads, head_dim


def decode_bytes(config, element: int, context: int, dense_full_cache: bool = True) -> int:
    """Estimated transient of one row in one decode step (module doc); `element`: bytes per value of the model's
    dtype; `dense_full_cache=False`: the method makes one layer's keys and values dense at a full step."""
    text = _text(config)
    heads, kv_heads, head_dim = _sizes(text)
    logits = text.vocab_size * (element + 4)
    scores = context * heads * 4 * 3
    densified = 0 if dense_full_cache else context * kv_heads * head_dim * 2 * element
    return logits + scores + densified


def prefill_bytes(config, element: int, length: int) -> int:
    """Estimated transient of one row in the prompt's forward (module doc)."""
    text = _text(config)
    heads, kv_heads, head_dim = _sizes(text)
    per_token = 3 * text.hidden_size + (heads + 2 * kv_heads) * head_dim + 3 * text.intermediate_size
    return length * (per_token * element + PREFILL_SCORED_QUERIES * heads * 4)


@torch.inference_mode()
def row_bytes(model, prompt: torch.Tensor, policies: dict[str, Policy], new_tokens: int) -> dict[str, RowBytes]:
    """Each method's `RowBytes` for rows like `prompt` (one row) followed by `new_tokens` decoded tokens: its KV
    from one prefill of `prompt` (the methods that share their prefill in one forward), the rest estimated."""
    caches = {name: PolicyCache(policy, model, new_tokens) for name, policy in policies.items()}
    shared = [cache for cache in caches.values() if cache.policy.shares_prefill]
    alone = [cache for cache in caches.values() if not cache.policy.shares_prefill]
    mask = torch.ones_like(prompt)
    for group in ([SharedPrefill(shared)] if shared else []) + alone:
        prefill(model, prompt, mask, group)
    element = model.dtype.itemsize
    context = prompt.shape[1] + new_tokens
    return {
        name: RowBytes(
            sum(cache.nbytes_per_layer()),
            max(cache.nbytes_per_layer()),
            decode_bytes(model.config, element, context, getattr(cache.policy, "full_cache", "dense") == "dense"),
            prefill_bytes(model.config, element, prompt.shape[1]),
        )
        for name, cache in caches.items()
    }


def check_cap(cap: float, weights: int) -> None:
    """A cap must leave room beside the weights."""
    if cap <= weights:
        raise ValueError(f"--memory-cap {gb(cap)} does not hold the model's weights ({gb(weights)}); give more")


def prefilled_rows(batch: int, distinct: int | None) -> int:
    """Rows a batch prefills: `distinct` (None: every row), at most the batch; the others are copies of them."""
    return batch if distinct is None else min(distinct, batch)


def working_set(batch: int, prefill_rows: int, rows: list[RowBytes], distinct: int | None = None) -> int:
    """Bytes beside the weights at the peak of a run of `batch` rows of each of `rows` (methods whose caches exist at
    once: a shared prefill), `distinct` of them prefilled (None: all; the others copies of those), `prefill_rows` per
    forward: the most that one phase of the run holds (module doc), one method's transient at a time."""
    prefilled = prefilled_rows(batch, distinct)
    kv = sum(row.kv for row in rows)
    layer = max(row.kv_layer for row in rows)
    phases = (
        prefilled * kv + prefill_rows * max(row.prefill for row in rows),
        prefilled * kv + (prefilled * layer if prefill_rows < prefilled else 0),
        batch * kv + (prefilled * layer if prefilled < batch else 0),
        batch * kv + batch * max(row.decode for row in rows),
    )
    return max(phases)


def _most(fits, limit: int) -> int:
    """The largest n in 1..limit with fits(n), for a `fits` true up to some n and false beyond (0: none)."""
    return bisect.bisect_left(range(1, limit + 1), True, key=lambda n: not fits(n))


def largest_batch(room: float, rows: list[RowBytes], distinct: int | None = None) -> int:
    """The most rows of each of `rows` whose run fits in `room` bytes, `distinct` of them prefilled (None: all), one
    row at a time (0: not one)."""
    most = int(room // sum(row.kv for row in rows)) + 1
    return _most(lambda batch: working_set(batch, 1, rows, distinct) <= room, most)


def most_prefill_rows(batch: int, room: float, rows: list[RowBytes], distinct: int | None = None) -> int:
    """Rows per prefill forward for a run of `batch` rows, `distinct` of them prefilled (None: all), that fits in
    `room` (0: not even one at a time)."""
    return _most(lambda group: working_set(batch, group, rows, distinct) <= room, prefilled_rows(batch, distinct))


def capped_batches(
    cap: float, weights: int, rows: dict[str, RowBytes], length: int, distinct: int | None = None
) -> dict[str, int]:
    """Each method's largest batch under `cap` beside the weights, `distinct` rows prefilled (None: all); refused if
    a method fits no row."""
    batches = {name: largest_batch(cap - weights, [row], distinct) for name, row in rows.items()}
    for name, batch in batches.items():
        if batch == 0:
            need = working_set(1, 1, [rows[name]])
            raise ValueError(
                f"--memory-cap {gb(cap)} holds no row of {name} at {length} tokens (weights {gb(weights)} + "
                f"{need / 2**20:.0f} MB for one row, its prefill included): give at least {gb(weights + need)}"
            )
    return batches


def check_fits(
    batch: int, rows: list[RowBytes], together: bool, available: int | None, what: str, distinct: int | None = None
) -> int:
    """Rows per prefill forward for `batch` rows of each method in `rows`, `distinct` of them prefilled (None: all),
    in `available` bytes (None: unknown, all at once), refused where not even one at a time fits. `together`: one
    prefill for all, whose caches then exist at once; else one method at a time."""
    if available is None:
        return prefilled_rows(batch, distinct)
    runs = [rows] if together else [[row] for row in rows]
    prefill_rows = min(most_prefill_rows(batch, available, run, distinct) for run in runs)
    if prefill_rows == 0:
        most = min(largest_batch(available, run, distinct) for run in runs)
        need = max(working_set(batch, 1, run, distinct) for run in runs)
        shared = " (the methods' caches at once: fewer methods or --no-share-prefill need less)" if together else ""
        raise ValueError(
            f"{what} needs about {gb(need)} for KV, decode and a one-row prefill{shared}; {gb(available)} are free "
            f"here: at most {most} rows"
        )
    return prefill_rows


def proc_bytes(path: str, field: str) -> int | None:
    """A size that Linux gives in kB in a /proc file (`MemAvailable` in /proc/meminfo...); None where unreadable."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def available_memory(device: torch.device) -> int | None:
    """Bytes free for new tensors: on a GPU its free memory, on Linux MemAvailable; None where unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return proc_bytes("/proc/meminfo", "MemAvailable")
