"""One decode query over a long KV cache on the CPU: SDPA's kernel against the explicit paths of
`decode_attention` (two products and a float32 softmax; in float32 also the C of `native_attention.attend_rows`,
which `decode_attention` takes there, with and without its AVX-512 loops, and a plain read of the same keys and
values: what the memory allows), per cache length, dtype and batch, for the embedded model's shapes (9 query heads, 3
KV heads, head_dim 64) and 30 layers' worth of distinct caches (so that no cache stays in the CPU's caches between
calls). Where the explicit path wins sets `EXPLICIT_DECODE_FROM`.

    python benchmarks/perf/decode_attention.py --threads 2
"""

import argparse
import contextlib
import time

import torch

from refreshkv.core import attention_math, native_attention
from refreshkv.measure.bench import cpu_facts

LAYERS, QUERY_HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64
LENGTHS = (128, 512, 1024, 2048, 4096, 8192)


def best_ms(run, calls: int = 10, rounds: int = 5) -> float:
    """Best over `rounds` of the mean time of `calls` calls (both paths alternate rounds in `compare`)."""
    run()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            run()
        times.append((time.perf_counter() - start) / calls * 1e3)
    return min(times)


@contextlib.contextmanager
def without_wide_loops():
    """The C attention without its AVX-512 loops (as on a CPU without AVX-512), for a comparison."""
    wide, native_attention._wide = native_attention._wide, lambda: 0
    try:
        yield
    finally:
        native_attention._wide = wide


def kv_bytes(length: int, batch: int) -> int:
    """Bytes of the float32 keys and values `compare` attends to: all layers, `batch` rows of `length` tokens."""
    return 2 * LAYERS * batch * KV_HEADS * length * HEAD_DIM * 4


def compare(length: int, dtype: torch.dtype, batch: int, names: tuple[str, ...] | None = None) -> dict[str, float]:
    """ms for all layers' decode attention: SDPA, two products, and in float32 the C without and with its AVX-512
    loops and a plain read; `names`: those of the paths to time (all by default)."""
    caches = [[torch.randn(batch, KV_HEADS, length, HEAD_DIM, dtype=dtype) for _ in range(2)] for _ in range(LAYERS)]
    query = torch.randn(batch, QUERY_HEADS, 1, HEAD_DIM, dtype=dtype)
    packed = attention_math.pack_queries(query, KV_HEADS)

    def sdpa():
        attention_math.EXPLICIT_DECODE_FROM = length + 1
        for keys, values in caches:
            attention_math.decode_attention(query, keys, values, HEAD_DIM**-0.5)

    def products():
        for keys, values in caches:
            attention_math._explicit_attention(packed, keys, values, HEAD_DIM**-0.5, None)

    def c():
        for keys, values in caches:
            native_attention.attend_rows(query, keys, values, HEAD_DIM**-0.5, None)

    def narrow_c():
        with without_wide_loops():
            c()

    def read():
        for keys, values in caches:
            keys.sum()
            values.sum()

    paths = {"sdpa": sdpa, "products": products}
    if dtype == torch.float32:
        paths.update({"narrow c": narrow_c, "c": c, "read": read})
    paths = {name: run for name, run in paths.items() if names is None or name in names}
    times: dict[str, float] = {}
    for _ in range(2):  # alternate the paths, twice
        for name, run in paths.items():
            times[name] = min(times.get(name, float("inf")), best_ms(run))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    facts = cpu_facts()
    print(f"{facts['cpu']} (bf16 instructions: {facts['cpu_bf16']}), {args.threads} threads, {LAYERS} layers")
    print("| dtype | batch | keys | SDPA ms | two products ms | C without AVX-512 loops ms | C ms | plain read ms |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in (torch.bfloat16, torch.float32):
        for batch in (1, 8):
            for length in LENGTHS:
                t = compare(length, dtype, batch)
                names = ("sdpa", "products", "narrow c", "c", "read")
                cells = [f"{t[name]:.2f}" if name in t else "" for name in names]
                print(f"| {str(dtype)[6:]} | {batch} | {length} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
