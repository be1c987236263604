"""Peak resident memory of a long prefill with several methods' prompt-time selections (issue 29, item 5).

    python benchmarks/perf/prefill_memory.py --model gemma3-270m --length 32768 --methods all --json out.json

One process, one shared prefill of every method named (`generate_many`: the caches of all of them exist together),
then a few decode steps each; prints the process's peak RSS (Linux `ru_maxrss`), which bounds each method's own
peak from above, and each method's KV bytes held. `--methods h2o` measures one method alone.
"""

import argparse
import json
import resource
import time

import torch

from refreshkv import METHODS, generate_many, load_model, make_policy
from refreshkv.measure.bench import bench_prompt, machine_facts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--methods", default="all", help="comma-separated, or all (every registered method)")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    names = sorted(METHODS) if args.methods == "all" else args.methods.split(",")
    ids = bench_prompt(tokenizer, args.length - args.new_tokens)
    start = time.perf_counter()
    outs = generate_many(
        model, ids, methods=[make_policy(n) for n in names], max_new_tokens=args.new_tokens, eos_token_id=[]
    )
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = {
        "model": args.model,
        "length": args.length,
        "methods": names,
        "peak_rss_bytes": peak,
        "seconds": round(seconds, 1),
        "prefill_s": round(outs[0].prefill_s, 1),
        "kv_bytes_held": {n: out.stats()["kv_bytes_full"] for n, out in zip(names, outs)},
        "machine": machine_facts(model),
    }
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as file:
            json.dump(result, file, indent=1)


if __name__ == "__main__":
    main()
