"""What one request's decode step costs at one layer inside vLLM, and its parts: the plugin's own code over a cache
in vLLM's CPU layout (serving/paged_store.py `cpu_blocks`), without the engine, so that each part's milliseconds
show apart.

    python benchmarks/perf/served_step_parts.py --length 8056 --budget 1024 [--warm]   # either virtualenv, one thread

Per method, `--steps` decode steps of one request at one layer (SmolLM2-135M's shapes: 9 query heads, 3 KV heads,
head size 64; float32; blocks of 128 tokens scattered over a cache 8 times the request's, as an engine's are): the
whole step (`Request.decode`) and the C calls inside it (timed around the functions the plugin calls). Before each
step a 160 MB buffer is written, so that the step finds the cache cold (inside the engine every other request and
layer passes between two of its steps, but a 2-core machine's share of the L3 keeps some of it: the engine's steps
lie between this and `--warm`, steps one after another). `recycled` runs with `stride` 1: every step is a refresh,
the step that the requests of a batch that arrived together take at once. The words for span pooling come from the
embedded model's tokenizer over the package's book. Prints the median ms per request-layer of each.
"""

import argparse
import contextlib
import importlib
import statistics
import time
from collections import defaultdict

import torch
from call_timer import timed_call
from transformers import AutoTokenizer

from refreshkv.core.policy import make_policy
from refreshkv.engine.spans import WordTable
from refreshkv.runtime.loading import resolve_model_dir
from refreshkv.serving.paged_store import cpu_blocks
from refreshkv.serving.request_layer import ModelFacts, Request, StepCounts
from refreshkv.texts import book_text

QUERY_HEADS, KV_HEADS, DIM, BLOCK, LAYER = 9, 3, 64, 128, 5  # LAYER: past quest's dense layers
# the C calls of each method's served step, by the module whose name the plugin calls them by
SERVED, SELECTION, QUEST = "refreshkv.serving.paged_store", "refreshkv.core.native_selection", "refreshkv.methods.quest"
REFRESH_PARTS = ((SERVED, "attend_paged"), (SELECTION, "refresh_partial"), (SERVED, "gather_paged"))
PARTS = {
    "recycled": REFRESH_PARTS,
    "refreshkv": REFRESH_PARTS,
    "quest": ((QUEST, "quest_pages"), (SERVED, "attend_paged_at")),
}


@contextlib.contextmanager
def timed(parts: tuple[tuple[str, str], ...], spent: dict[str, float]):
    """Each (module, name) of `parts` timed into `spent[name]` (seconds, summed) while inside; put back after."""
    originals = {(module, name): getattr(importlib.import_module(module), name) for module, name in parts}
    for (module, name), function in originals.items():
        setattr(importlib.import_module(module), name, timed_call(function, name, spent))
    try:
        yield
    finally:
        for (module, name), function in originals.items():
            setattr(importlib.import_module(module), name, function)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=8056)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--methods", default="recycled,refreshkv,quest")
    parser.add_argument("--warm", action="store_true", help="no buffer written between steps")
    args = parser.parse_args()
    torch.set_num_threads(1)  # vLLM's CPU worker runs on one core here
    torch.manual_seed(0)
    blocks_needed = -(-(args.length + args.steps) // BLOCK)
    blocks = cpu_blocks(torch.randn(8 * blocks_needed, KV_HEADS, BLOCK, 2 * DIM))
    table = torch.randperm(8 * blocks_needed)[:blocks_needed]
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(), local_files_only=True)
    ids = tokenizer(book_text()).input_ids[: args.length]
    inv_freq = 1.0 / 10000 ** (torch.arange(0, DIM, 2) / DIM)
    facts = ModelFacts("llama", [inv_freq] * (LAYER + 1), WordTable.of(tokenizer))
    flush = torch.empty(40_000_000)
    state = "warm" if args.warm else "cold"
    print(f"{args.length} tokens, K = {args.budget}, ms per request-layer step, {state} (median of {args.steps})")
    for method in args.methods.split(","):
        params = {"stride": 1} if method == "recycled" else {}
        request = Request(make_policy(method, budget=args.budget, **params), ids, args.steps, facts, StepCounts())
        request.prompt_length = args.length
        request.keep_window(LAYER, torch.randn(1, QUERY_HEADS, 32, DIM), 0)
        request.store_prompt(LAYER, blocks, table, 0.125)
        per_step: dict[str, list[float]] = defaultdict(list)
        for step in range(args.steps):
            if not args.warm:
                flush.fill_(float(step))
            query, key = torch.randn(1, QUERY_HEADS, 1, DIM), torch.randn(1, KV_HEADS, 1, DIM)
            spent: dict[str, float] = defaultdict(float)
            with timed(PARTS[method], spent):
                start = time.perf_counter()
                request.decode(LAYER, query, key, key, 0.125, blocks, table, args.length + step + 1)
                per_step["step"].append(time.perf_counter() - start)
            for _, name in PARTS[method]:
                per_step[name].append(spent[name])
        parts = ", ".join(f"{name} {1e3 * statistics.median(times):.3f}" for name, times in per_step.items())
        print(f"{method}: {parts}; full steps {request.counts.full_layer_steps / args.steps:.2f}")


if __name__ == "__main__":
    main()
