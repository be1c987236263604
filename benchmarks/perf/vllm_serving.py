"""Decode speed inside vLLM by the wall clock: each method of the plugin against vLLM's own attention, in one engine,
interleaved.

    python benchmarks/perf/vllm_serving.py --out docs/results/vllm-serving/cpu.json     # in the vllm virtualenv

One in-process engine (plugin on, its method `full`: vLLM's own attention) serves every run; each request names its
method in its sampling parameters, so every method shares the engine and its weights. Per round, for each prompt
length and batch, each method decodes `--new-tokens` tokens for the same `batch` prompts of that length (book
passages), and vLLM's own attention decodes the same batch from prompts of K tokens: the practical ceiling of a
method that reads K tokens per step. Batches up to `--fresh-up-to` are prefilled anew by every run (the prefix cache
emptied before each): their time to the first token is a user's. Larger batches are prefilled once before their
runs, untimed, and every run finds its prompts in the prefix cache (the plugin keeps the question window's queries
for it: the same C_p as a fresh prefill); their time to the first token is not reported.
Every step is timed (serving/wall_clock.py): decode tokens/s is the tokens decoded after every request's first over
the wall time they took, every step counted; beside it the mean, median, p90 and largest step, the largest step of
the prefill phase, the time to the first and to the second token, and the share of request-layer steps that read
the whole cache. The JSON keeps every step's time. Before the first round, one untimed run of vLLM's own and of each
method over prompts no round uses.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: steps timed here, counts read here

from vllm import EngineArgs, LLMEngine  # noqa: E402

from refreshkv.runtime.loading import resolve_model_dir  # noqa: E402
from refreshkv.serving.wall_clock import timed_run  # noqa: E402

BOOKS = Path(__file__).resolve().parents[2] / "data" / "books"
OWN = "vllm"  # vLLM's own attention (the plugin's method `full`)
RATIOS = ("tokens_per_s", "first_token_s_mean", "step_ms_max")


def serving_engine(max_model_len: int, max_num_seqs: int) -> LLMEngine:
    """The in-process engine the serving benchmarks time: SmolLM2 in float32, eager, a whole prompt per prefill chunk,
    the plugin on with `full` (vLLM's own attention) unless a request names its method."""
    return LLMEngine.from_engine_args(
        EngineArgs(
            model=str(resolve_model_dir("smollm2-135m")),
            dtype="float32",
            enforce_eager=True,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_model_len,
            gpu_memory_utilization=0.3,
            additional_config={"refreshkv": {"method": "full"}},
        )
    )


def book_tokens(tokenizer) -> list[int]:
    text = " ".join(path.read_text(encoding="utf-8") for path in sorted(BOOKS.glob("austen-*.txt")))
    return tokenizer.encode(text, add_special_tokens=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--lengths", default="8056")  # with 128 new tokens, within the 8K context
    parser.add_argument("--batches", default="1,8,16")
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--methods", default="refreshkv,recycled,quest")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--fresh-up-to", type=int, default=1, help="the largest batch prefilled anew by every run")
    args = parser.parse_args()
    lengths, batches = [int(x) for x in args.lengths.split(",")], [int(x) for x in args.batches.split(",")]
    methods = args.methods.split(",")
    engine = serving_engine(max(lengths) + args.new_tokens + 8, max(batches))
    book = book_tokens(engine.get_tokenizer())
    # untimed: the engine's first prefill at each length (and the plugin's first selection) cost more than later ones
    unseen = [book[-length:] for length in lengths]
    for settings in [{"method": "full"}] + [{"method": name, "budget": args.budget} for name in methods]:
        timed_run(engine, unseen, settings, 2, f"warm-up-{settings['method']}")
    engine.reset_prefix_cache()
    runs: dict[tuple, list] = {}
    for round_ in range(args.rounds):
        for length in lengths:
            for batch in batches:
                rows = [book[(length + 7) * i : (length + 7) * i + length] for i in range(batch)]
                short = [row[-args.budget :] for row in rows]  # the ceiling: vLLM's own step at a context of K
                cells = [(OWN, rows, {"method": "full"}), ("ceiling", short, {"method": "full"})]
                cells += [(name, rows, {"method": name, "budget": args.budget}) for name in methods]
                fresh = batch <= args.fresh_up_to
                if not fresh:  # every run finds the prompts in the prefix cache, the plugin their question windows
                    warm = {"method": "refreshkv", "budget": args.budget}
                    timed_run(engine, rows + short, warm, 2, f"r{round_}-{length}-{batch}-warm")
                for name, prompts, settings in cells:
                    if fresh:
                        engine.reset_prefix_cache()
                    run = timed_run(engine, prompts, settings, args.new_tokens, f"r{round_}-{length}-{batch}-{name}")
                    summary = {**run.summary(), "fresh_prefill": fresh}
                    runs.setdefault((length, batch, name), []).append(
                        {**summary, "step_ms": [round(1000 * s, 2) for s in run.step_seconds]}
                    )
                    print(length, batch, name, json.dumps(summary), flush=True)
    rows_out = []
    for (length, batch, name), cell in runs.items():
        row = {"length": length, "batch": batch, "method": name, "rounds": len(cell)}
        for key in cell[0]:
            if key not in ("step_ms", "fresh_prefill"):
                row[key] = statistics.median(run[key] for run in cell)
        row["fresh_prefill"] = cell[0]["fresh_prefill"]
        for key in RATIOS:  # each as a multiple of vLLM's own in the same round, the median over rounds
            own = runs[(length, batch, OWN)]
            pairs = [(run[key], theirs[key]) for run, theirs in zip(cell, own)]
            row[f"{key}_vs_vllm"] = round(statistics.median(ours / theirs for ours, theirs in pairs), 3)
        ceiling = runs[(length, batch, "ceiling")]
        row["share_of_ceiling"] = round(
            statistics.median(run["tokens_per_s"] / top["tokens_per_s"] for run, top in zip(cell, ceiling)), 3
        )
        row["step_ms"] = [run["step_ms"] for run in cell]
        rows_out.append(row)
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if "Model name" in line), "")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "command": "python benchmarks/perf/vllm_serving.py "
                + " ".join(f"--{key.replace('_', '-')} {value}" for key, value in vars(args).items()),
                "machine": f"{model_name}, {os.cpu_count()} cores, Python {platform.python_version()}",
                "commit": commit,
                "budget": args.budget,
                "new_tokens": args.new_tokens,
                "rows": rows_out,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
