"""Decode speed inside vLLM: each method of the plugin against vLLM's own attention, in one engine, interleaved.

    python benchmarks/perf/vllm_serving.py --out docs/results/vllm-serving/cpu.json     # in the vllm virtualenv

One in-process engine (plugin on, its method `full`: vLLM's own attention) serves every run; each request names its
method in its sampling parameters, so every method shares the engine, its weights and its prefix cache. Per round,
for each prompt length and batch, each method decodes `--new-tokens` tokens for `batch` distinct prompts of that
length (book passages; the prompts are prefilled once, then found in the prefix cache), and vLLM's own attention
decodes the same batch from prompts of K tokens: the practical ceiling of a method that reads K tokens per step.
Reported per cell: the median decode step (ms, steps where every request decodes), decode tokens/s, the KV bytes
read per step (vLLM's own: every token of every request and layer; a method: what its steps recorded) and the
bytes ceiling (own bytes / the method's bytes), with the ratios to vLLM's own step and to the ceiling.
A prompt found in the prefix cache is prefilled from its last token only, so a method's question window is that one
query (the papers' window of 1): the schedule of refreshes can differ from a first-time prompt's; speed only.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: steps timed here, counts read here

from vllm import EngineArgs, LLMEngine, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

from refreshkv.runtime.loading import resolve_model_dir  # noqa: E402
from refreshkv.serving import vllm_rows  # noqa: E402

BOOKS = Path(__file__).resolve().parents[2] / "data" / "books"
OWN = "vllm"  # vLLM's own attention (the plugin's method `full`)


def book_tokens(tokenizer) -> list[int]:
    text = " ".join(path.read_text(encoding="utf-8") for path in sorted(BOOKS.glob("austen-*.txt")))
    return tokenizer.encode(text, add_special_tokens=False)


def decode_steps(engine, prompts, settings, new_tokens, tag) -> tuple[list[float], int, int]:
    """Decode `new_tokens` for each prompt at once: the seconds of each step where every request decodes, the
    plugin's layer-steps and bytes read over them."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, extra_args={"refreshkv": settings})
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", TokensPrompt(prompt_token_ids=prompt), params)
    produced = {}
    while len(produced) < len(prompts) or min(produced.values()) < 1:  # the prefills, and each first token
        for output in engine.step():
            produced[output.request_id] = len(output.outputs[0].token_ids)
    counts = vllm_rows.COUNTS
    start_bytes, start_steps = counts.bytes_read, counts.layer_steps
    seconds = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        if len(outputs) == len(prompts) and not any(output.finished for output in outputs):
            seconds.append(time.perf_counter() - start)
    return seconds, counts.layer_steps - start_steps, counts.bytes_read - start_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--lengths", default="4096,8192")
    parser.add_argument("--batches", default="1,8,16")
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--methods", default="refreshkv,recycled,streamingllm++,oracle")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    lengths, batches = [int(x) for x in args.lengths.split(",")], [int(x) for x in args.batches.split(",")]
    methods = args.methods.split(",")
    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=str(resolve_model_dir("smollm2-135m")),
            dtype="float32",
            enforce_eager=True,
            max_model_len=max(lengths) + args.new_tokens + 8,
            max_num_seqs=max(batches),
            max_num_batched_tokens=max(lengths) + args.new_tokens + 8,
            gpu_memory_utilization=0.3,
            additional_config={"refreshkv": {"method": "full"}},
        )
    )
    config = engine.model_config.hf_text_config
    token_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4  # float32
    book = book_tokens(engine.get_tokenizer())
    cells: dict[tuple, list] = {}
    for round_ in range(args.rounds):
        for length in lengths:
            for batch in batches:
                rows = [book[(length + 7) * i : (length + 7) * i + length] for i in range(batch)]
                short = [row[-args.budget :] for row in rows]  # the ceiling: vLLM's own step at a context of K
                runs = [(OWN, rows, {"method": "full"}), ("ceiling", short, {"method": "full"})]
                runs += [(name, rows, {"method": name, "budget": args.budget}) for name in methods]
                for name, prompts, settings in runs:
                    tag = f"r{round_}-{length}-{batch}-{name}"
                    seconds, steps, read = decode_steps(engine, prompts, settings, args.new_tokens, tag)
                    context = (len(prompts[0]) + args.new_tokens // 2) * batch * token_bytes
                    cells.setdefault((length, batch, name), []).append(
                        {
                            "ms": 1000 * statistics.median(seconds),
                            "bytes": context if steps == 0 else read * config.num_hidden_layers // steps * batch,
                        }
                    )
                    print(tag, f"{1000 * statistics.median(seconds):.1f} ms", flush=True)
    rows_out = []
    for (length, batch, name), runs in cells.items():
        ms = statistics.median(run["ms"] for run in runs)
        own = statistics.median(run["ms"] for run in cells[(length, batch, OWN)])
        ceiling = statistics.median(run["ms"] for run in cells[(length, batch, "ceiling")])
        own_bytes = cells[(length, batch, OWN)][0]["bytes"]
        rows_out.append(
            {
                "length": length,
                "batch": batch,
                "method": name,
                "ms_per_step": round(ms, 2),
                "tokens_per_s": round(batch / ms * 1000, 1),
                "speedup_vs_vllm": round(own / ms, 3),
                "share_of_ceiling": round(ceiling / ms, 3),
                "kv_bytes_per_step": runs[0]["bytes"],
                "bytes_ceiling": round(own_bytes / runs[0]["bytes"], 2),
            }
        )
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if "Model name" in line), "")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "command": "python benchmarks/perf/vllm_serving.py "
                + " ".join(f"--{key.replace('_', '-')} {value}" for key, value in vars(args).items()),
                "machine": f"{model_name}, {os.cpu_count()} cores, {platform.python_version()}",
                "budget": args.budget,
                "new_tokens": args.new_tokens,
                "rows": rows_out,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
