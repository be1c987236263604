"""Throughput and latency of serving many requests on several replicas, modelled from a `refreshkv bench` result
(src/refreshkv/measure/serving_sim.py states the assumptions; docs/serving.md the design it stands for).

    python benchmarks/analysis/serving_sim.py bench-batch-smollm2-8k.json --memory 6 --replicas 4 --rates 0.5,1,2,inf

One markdown table per arrival rate: each method as measured and, for methods that refresh, without refreshes,
with refreshes aligned across rows, and with a batch's step full whenever any row refreshes.
"""

import argparse
import json
import math
from pathlib import Path

from refreshkv.measure.serving_sim import Workload, bench_costs, simulate_bench

COLUMNS = (
    ("method", "method", "{}"),
    ("refresh", "refresh", "{}"),
    ("largest batch", "largest_batch", "{}"),
    ("mean batch", "mean_batch", "{:.1f}"),
    ("output tok/s", "output_tokens_per_s", "{:.1f}"),
    ("latency p50 s", "latency_p50_s", "{:.1f}"),
    ("latency p99 s", "latency_p99_s", "{:.1f}"),
    ("first token p50 s", "first_token_p50_s", "{:.1f}"),
    ("first token p99 s", "first_token_p99_s", "{:.1f}"),
)


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(title for title, _, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(fmt.format(row[key]) for _, key, fmt in COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bench", type=Path, help="a `refreshkv bench --json` result")
    parser.add_argument("--length", type=int, help="context length to simulate (default: the bench's longest)")
    parser.add_argument("--memory", type=float, required=True, help="GB (2^30 bytes) per replica: weights + KV pool")
    parser.add_argument("--replicas", type=int, default=1, help="data-parallel GPUs or hosts")
    parser.add_argument("--rates", default="inf", help="arrival rates, requests/s in all (inf: all at once)")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--output-tokens", type=int, help="new tokens per request (default: the bench's)")
    parser.add_argument("--methods", help="comma-separated (default: every method of the bench)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write every row here")
    args = parser.parse_args()
    result = json.loads(args.bench.read_text())
    length, _ = bench_costs(result, args.length)
    methods = args.methods.split(",") if args.methods else None
    rows = []
    for rate in (float(text) for text in args.rates.split(",")):
        workload = Workload(
            rate=rate,
            requests=args.requests,
            prompt_tokens=length - result["new_tokens"],
            output_tokens=args.output_tokens or result["new_tokens"],
            replicas=args.replicas,
            memory_bytes=args.memory * 2**30,
            seed=args.seed,
        )
        served = [{**row, "rate": rate} for row in simulate_bench(result, workload, length, methods)]
        arrivals = "all at once" if math.isinf(rate) else f"{rate:g} requests/s"
        print(f"\n{workload.requests} requests of {length} tokens, {arrivals}, {args.replicas} x {args.memory:g} GB\n")
        print(markdown(served))
        rows += served
    if args.json is not None:
        args.json.write_text(json.dumps({"bench": str(args.bench), "memory_gb": args.memory, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
