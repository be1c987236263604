"""One decode query over a long KV cache on the CPU: SDPA's kernel against the explicit path of
`decode_attention` (two products and a float32 softmax), per cache length, dtype and batch, for the embedded
model's shapes (9 query heads, 3 KV heads, head_dim 64) and 30 layers' worth of distinct caches (so that no cache
stays in the CPU's caches between calls). Where the explicit path wins sets `EXPLICIT_DECODE_FROM`.

    python benchmarks/perf/decode_attention.py --threads 2
"""

import argparse
import time

import torch

from refreshkv.core import attention_math
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


def compare(length: int, dtype: torch.dtype, batch: int) -> tuple[float, float]:
    """ms for all layers' decode attention, SDPA and explicit."""
    caches = [[torch.randn(batch, KV_HEADS, length, HEAD_DIM, dtype=dtype) for _ in range(2)] for _ in range(LAYERS)]
    query = torch.randn(batch, QUERY_HEADS, 1, HEAD_DIM, dtype=dtype)

    def all_layers():
        for keys, values in caches:
            attention_math.decode_attention(query, keys, values, HEAD_DIM**-0.5)

    times = {}
    for _ in range(2):  # alternate the two paths, twice
        for name, threshold in (("sdpa", length + 1), ("explicit", 0)):
            attention_math.EXPLICIT_DECODE_FROM = threshold
            times[name] = min(times.get(name, float("inf")), best_ms(all_layers))
    return times["sdpa"], times["explicit"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    facts = cpu_facts()
    print(f"{facts['cpu']} (bf16 instructions: {facts['cpu_bf16']}), {args.threads} threads, {LAYERS} layers")
    print("| dtype | batch | keys | SDPA ms | explicit ms | explicit / SDPA |")
    print("|---|---|---|---|---|---|")
    for dtype in (torch.bfloat16, torch.float32):
        for batch in (1, 2):
            for length in LENGTHS:
                sdpa, explicit = compare(length, dtype, batch)
                print(
                    f"| {str(dtype)[6:]} | {batch} | {length} | {sdpa:.2f} | {explicit:.2f} | {explicit / sdpa:.2f} |"
                )


if __name__ == "__main__":
    main()
