"""Does an eviction method decode at the cost of a plain cache of its size? (issue 33, item 3)

    python benchmarks/experiments/eviction_overhead.py --length 4096 --budget 512 --rounds 5 --threads 2

`snapkv` (and any `--methods`) with K = `--budget` on a `--length`-token prompt, against stock transformers
(`model.generate`, DynamicCache + SDPA) over the last K + 32 tokens of the same prompt, i.e. a cache of the same
size: decode ms per token (prefill excluded), all in one process, rounds interleaved (the order flips every round);
medians and ranges over rounds. `--save-prompt` writes the prompt for kvpress's SnapKV on the same tokens
(benchmarks/experiments/kvpress_snapkv.py, in a virtualenv of its own).

Answer (commit def6a43, AMD EPYC with AVX2 only, 2 threads, 5 rounds): yes; `snapkv` 72.4 ms/token and
`streamingllm` 72.7 against stock transformers' 74.3 over a cache of the same size
(docs/results/eviction-overhead/snapkv-vs-stock.json; docs/benchmark.md, "Eviction methods after prefill").
"""

import argparse
import json
import statistics
import time

import torch
from transformers import DynamicCache

from refreshkv import generate, load_model
from refreshkv.engine.cache_argument import with_cache
from refreshkv.measure.bench import bench_prompt, machine_facts


@torch.inference_mode()
def stock_ms_per_token(model, ids, new_tokens: int) -> float:
    cache = DynamicCache(config=model.config)
    logits = model(ids, **with_cache(model, cache), use_cache=True, logits_to_keep=1).logits[:, -1]
    start = time.perf_counter()
    for _ in range(new_tokens - 1):
        token = logits.argmax(-1, keepdim=True)
        logits = model(token, **with_cache(model, cache), use_cache=True).logits[:, -1]
    return 1000 * (time.perf_counter() - start) / (new_tokens - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--methods", default="snapkv,streamingllm")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--save-prompt", help="also write the prompt's token ids here (for kvpress_snapkv.py)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model()
    ids = bench_prompt(tokenizer, args.length - args.new_tokens)
    short = ids[:, -(args.budget + 32) :]
    if args.save_prompt:
        torch.save(ids, args.save_prompt)
    runs = ["stock"] + args.methods.split(",")
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_index in range(args.rounds):
        for name in runs if round_index % 2 == 0 else reversed(runs):
            if name == "stock":
                times[name].append(stock_ms_per_token(model, short, args.new_tokens))
                continue
            out = generate(model, ids, method=name, budget=args.budget, max_new_tokens=args.new_tokens, eos_token_id=[])
            times[name].append(out.decode_ms_per_token)
    stock = statistics.median(times["stock"])
    result = {
        name: {
            "median_ms": round(statistics.median(v), 2),
            "range_ms": round(max(v) - min(v), 2),
            "vs_stock": round(statistics.median(v) / stock, 3),
        }
        for name, v in times.items()
    }
    print(
        json.dumps(
            {
                "length": args.length,
                "budget": args.budget,
                "stock_prompt": short.shape[1],
                "results": result,
                "machine": machine_facts(model),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
