"""How much of a decode step the output layer takes: the model's lm_head on one token, timed alone, against a whole
decode step of `full` at a given context (issue 29: Gemma 3 270M's 262K-row output layer), in float32 and bfloat16.

    python benchmarks/perf/output_layer.py --model gemma3-270m --length 8192 --threads 2

Medians of `--repeats` timings, all in one process; the step time is `generate`'s median decode step.
"""

import argparse
import json
import statistics
import time

import torch

from refreshkv import generate, load_model
from refreshkv.measure.bench import bench_prompt, machine_facts


def median_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        model, tokenizer = load_model(args.model, dtype=dtype)
        hidden = torch.randn(1, 1, model.config.hidden_size, dtype=dtype)
        head = model.get_output_embeddings()
        with torch.inference_mode():
            head_s = median_seconds(lambda head=head, hidden=hidden: head(hidden), args.repeats)
        ids = bench_prompt(tokenizer, args.length - args.new_tokens)
        out = generate(model, ids, method="full", max_new_tokens=args.new_tokens, eos_token_id=[])
        step_s = statistics.median(out.step_s)
        rows.append(
            {
                "dtype": name,
                "output_layer_ms": round(1000 * head_s, 2),
                "output_layer_bytes": head.weight.numel() * head.weight.element_size(),
                "full_step_ms": round(1000 * step_s, 2),
                "output_layer_share": round(head_s / step_s, 3),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"model": args.model, "length": args.length, "rows": rows, "machine": machine_facts(model)}))


if __name__ == "__main__":
    main()
