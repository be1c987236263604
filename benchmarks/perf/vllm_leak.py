"""The plugin holds no state past its requests: many short requests through vLLM, some aborted, in a KV space small
enough that the scheduler preempts (and later recomputes) requests; the plugin's request count and the process's
memory are read every few rounds.

    python benchmarks/perf/vllm_leak.py --requests 1000 --out docs/results/vllm-serving/leak.json   # vllm virtualenv
"""

import argparse
import json
import os
import random
import resource
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: its plugin state is read here
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from vllm import EngineArgs, LLMEngine, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

from refreshkv.runtime.loading import resolve_model_dir  # noqa: E402
from refreshkv.serving import vllm_rows  # noqa: E402
from refreshkv.serving.batch_rows import ROWS  # noqa: E402

BOOK = Path(__file__).resolve().parents[2] / "data" / "books" / "austen-persuasion.txt"


def rss_mb() -> float:
    with open("/proc/self/status", encoding="utf-8") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrent", type=int, default=24)
    parser.add_argument("--blocks", type=int, default=24, help="KV blocks (32 tokens each): few, so requests preempt")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=str(resolve_model_dir("smollm2-135m")),
            dtype="float32",
            enforce_eager=True,
            max_model_len=1024,
            max_num_seqs=args.concurrent,
            num_gpu_blocks_override=args.blocks,
            gpu_memory_utilization=0.3,
            additional_config={"refreshkv": {"method": "refreshkv", "budget": 16}},
        )
    )
    words = BOOK.read_text(encoding="utf-8").split()
    tokenizer = engine.get_tokenizer()
    chance = random.Random(0)
    sent, finished, aborted, readings = 0, 0, 0, []
    steps_of: dict[str, int] = {}
    while finished + aborted < args.requests:
        while sent < args.requests and len(steps_of) < args.concurrent:
            start = chance.randrange(len(words) - 400)
            ids = tokenizer.encode(" ".join(words[start : start + chance.randrange(60, 300)]), add_special_tokens=False)
            params = SamplingParams(temperature=0.0, max_tokens=chance.randrange(4, 120), ignore_eos=True)
            engine.add_request(f"r{sent}", TokensPrompt(prompt_token_ids=ids), params)
            steps_of[f"r{sent}"] = 0
            sent += 1
        for output in engine.step():
            steps_of[output.request_id] += 1
            if output.finished:
                del steps_of[output.request_id]
                finished += 1
            elif steps_of[output.request_id] == 3 and int(output.request_id[1:]) % 7 == 0:
                engine.abort_request([output.request_id])
                del steps_of[output.request_id]
                aborted += 1
        if (finished + aborted) % 100 < 2 and (not readings or readings[-1]["done"] != finished + aborted):
            readings.append({"done": finished + aborted, "plugin_requests": ROWS.count(), "rss_mb": round(rss_mb())})
            print(readings[-1], flush=True)
    engine.add_request("last", TokensPrompt(prompt_token_ids=[1, 2, 3]), SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():  # one more step: vLLM reports the requests that left the batch
        engine.step()
    result = {
        "requests": args.requests,
        "finished": finished,
        "aborted": aborted,
        "plugin_requests_after": ROWS.count(),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "readings": readings,
        "resumed_after_leaving_the_batch": vllm_rows.COUNTS.resumed,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "readings"}))


if __name__ == "__main__":
    main()
