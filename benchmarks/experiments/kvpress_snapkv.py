"""kvpress's SnapKV on the same prompt as our `snapkv`, for a side-by-side run in separate processes (issue 33).

kvpress needs transformers < 5.3 and this package >= 5.14, so they cannot share a process. In a virtualenv of its
own (`python -m venv --system-site-packages kvp && kvp/bin/pip install kvpress==0.5.5 transformers==5.2.0`):

    python benchmarks/experiments/eviction_overhead.py --save-prompt prompt.pt ...   # ours; writes the prompt
    kvp/bin/python benchmarks/experiments/kvpress_snapkv.py --model-dir DIR --prompt prompt.pt --budget 512

DIR is the converted embedded model (`python -c "from refreshkv.runtime.loading import resolve_model_dir as r;
print(r())"`). The press compresses the prompt to `--budget` tokens per layer inside its prefill forward (as under
`model.generate` with the press applied); the greedy decode that follows is timed per token, prefill excluded,
as `eviction_overhead.py` times ours. Prints one JSON object: ms/token per round, median, range, tokens held.

Question it answered (commit 2feb8c9, AMD EPYC with AVX2 only, 2 threads): is our `snapkv` slower to decode than
kvpress's SnapKV on the same tokens? Answer: no; 0.99x and 0.90x kvpress's ms/token in two alternated pairs of runs
(docs/results/eviction-overhead/snapkv-vs-kvpress.json).
"""

import argparse
import json
import statistics
import time

import torch
from kvpress import SnapKVPress
from transformers import AutoModelForCausalLM, DynamicCache


@torch.inference_mode()
def decode_ms_per_token(model, press, ids, new_tokens: int) -> tuple[float, int]:
    cache = DynamicCache()
    with press(model):
        logits = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        held = cache.get_seq_length()
        start = time.perf_counter()
        for _ in range(new_tokens - 1):
            token = logits.argmax(-1, keepdim=True)
            logits = model(token, past_key_values=cache, use_cache=True).logits[:, -1]
    return 1000 * (time.perf_counter() - start) / (new_tokens - 1), held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--prompt", required=True, help="token ids saved by eviction_overhead.py --save-prompt")
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, attn_implementation="sdpa")
    ids = torch.load(args.prompt)
    press = SnapKVPress(compression_ratio=1 - args.budget / ids.shape[1])
    runs = [decode_ms_per_token(model, press, ids, args.new_tokens) for _ in range(args.rounds)]
    times = [ms for ms, _ in runs]
    print(
        json.dumps(
            {
                "kvpress_snapkv": {
                    "ms_per_round": [round(t, 2) for t in times],
                    "median_ms": round(statistics.median(times), 2),
                    "range_ms": round(max(times) - min(times), 2),
                    "prompt_tokens": ids.shape[1],
                    "tokens_held_after_prefill": runs[0][1],
                }
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
