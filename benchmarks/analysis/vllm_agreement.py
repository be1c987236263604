"""Does refreshkv inside vLLM answer as refreshkv in the package's own transformers loop? SmolLM2's needle dev set
without answer prefix at 4K, K = L/8, today's default.

    OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=2 python benchmarks/analysis/vllm_agreement.py     # in the vllm virtualenv

For each source (`SOURCES`: a sweep file, one of its tasks and seeds, a number of examples) the sweep's own
configuration (`load_sweep`) gives the method and parameters, and the package's task code rebuilds its examples
(`prepare`: the chat-templated prompt's token ids, max new tokens) as the runner did. Each prompt is run once through
one in-process vLLM engine (the plugin on; prefix caching off, so that every prompt is prefilled whole and the
question window is the last 32 prompt tokens, as in the loop; one request at a time, its prefill in one chunk),
greedily, to the example's max new tokens or the model's end-of-sequence token, with the configuration's method
and parameters as the request's own. The answer is decoded and scored as the runner does (`task.score`) and set
beside the transformers row of the same configuration and example (its `config` key and `id`), read from the
sweep's files and `EXTRA_ROWS`.

Output: one JSONL row per example (resumes: examples already in --out are skipped) and the summary table on stdout,
per task: examples, the share where vLLM's prediction equals the loop's (and where the score does), the mean score
under each path. `--summary` prints the table of --out without running anything.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: one request at a time

ROOT = Path(__file__).resolve().parents[2]
SWEEPS = ROOT / "benchmarks" / "sweeps"
# (sweep file, task, task options, seed, examples): the transformers rows of refreshkv at today's default
SOURCES = (
    ("selection-dev-keep-decoded.yaml", "ruler/niah_single_2", {"question": "bare"}, 0, 20),
    ("selection-dev-keep-decoded.yaml", "ruler/niah_multikey_1", {"question": "bare"}, 0, 40),
    ("selection-dev-multivalue-keep-decoded.yaml", "ruler/niah_multivalue", {"question": "bare"}, 0, 40),
    ("selection-dev-multivalue-keep-decoded.yaml", "ruler/niah_multivalue", {"question": "bare"}, 3, 40),
    ("selection-dev-multivalue-keep-decoded.yaml", "ruler/niah_multivalue", {"question": "bare"}, 4, 9),
)
# transformers rows of the same configurations beyond the sweeps' (niah_single_2's examples 10-19; README.md)
EXTRA_ROWS = (ROOT / "docs" / "results" / "vllm-agreement" / "smollm2-single2-transformers.jsonl",)
RUN = "vllm-agreement"


def source_configs():
    """(configuration, examples, its transformers rows by (config, id)) per source."""
    from refreshkv.eval.distributed import sweep_files
    from refreshkv.eval.results_file import read_results
    from refreshkv.eval.sweep import load_sweep

    rows = {}
    for path in EXTRA_ROWS:
        rows.update({(row["config"], row["id"]): row for row in read_results(path)[0]})
    chosen = []
    for file, task, options, seed, count in SOURCES:
        sweep = load_sweep(SWEEPS / file)
        for path in sweep_files(sweep.out):
            rows.update({(row["config"], row["id"]): row for row in read_results(path)[0]})
        config = next(c for c in sweep.configs() if c.task == task and c.task_options == options and c.seed == seed)
        chosen.append((sweep, config, count))
    return chosen, rows


def summary(path: Path) -> str:
    from refreshkv.eval.results_file import read_results

    by_task: dict[tuple, list[dict]] = {}
    for row in read_results(path)[0]:
        by_task.setdefault((row["task"], row["seed"]), []).append(row)
    lines = [
        "| task | seed | examples | same prediction | same score | mean score, transformers | mean score, vLLM |",
        "|---|---|---|---|---|---|---|",
    ]
    for (task, seed), rows in by_task.items():
        same = sum(row["prediction"] == row["transformers_prediction"] for row in rows) / len(rows)
        same_score = sum(row["score"] == row["transformers_score"] for row in rows) / len(rows)
        ours = statistics.mean(row["transformers_score"] for row in rows)
        theirs = statistics.mean(row["score"] for row in rows)
        lines.append(f"| {task} | {seed} | {len(rows)} | {same:.0%} | {same_score:.0%} | {ours:.3f} | {theirs:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "vllm-agreement" / "smollm2.jsonl")
    parser.add_argument("--limit", type=int, default=None, help="at most this many examples per source")
    parser.add_argument("--summary", action="store_true", help="print the table of --out and stop")
    args = parser.parse_args()
    if args.summary:
        print(summary(args.out))
        return

    from vllm import EngineArgs, LLMEngine, SamplingParams
    from vllm.inputs import TokensPrompt

    from refreshkv.eval.config import find_task
    from refreshkv.eval.examples import prepare
    from refreshkv.eval.results_file import ResultsFile
    from refreshkv.runtime.loading import load_model, resolve_model_dir
    from refreshkv.serving.plugin_config import CONFIG_KEY

    chosen, transformers_rows = source_configs()
    models = {sweep.model for sweep, _, _ in chosen}
    lengths = {config.length for _, config, _ in chosen}
    assert len(models) == 1 and len(lengths) == 1, "one engine: one model and length"
    name = models.pop()
    model, tokenizer = load_model(name)  # the runner's tokenizer; the model only for `prepare`'s checks
    work = []
    for _, config, count in chosen:
        count = min(count, args.limit or count)
        for index, item in enumerate(prepare(model, tokenizer, config, count)):
            work.append((config, index, item))
    del model
    length = lengths.pop()
    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=str(resolve_model_dir(name)),
            dtype=chosen[0][1].dtype,
            enforce_eager=True,
            max_model_len=length,
            max_num_seqs=1,
            max_num_batched_tokens=length,
            enable_prefix_caching=False,
            gpu_memory_utilization=0.3,
            additional_config={CONFIG_KEY: {"method": "full"}},  # each request names its own
        )
    )
    with ResultsFile(args.out, run=RUN) as results:
        for number, (config, index, item) in enumerate(work):
            example = item.example
            if (config.key(), example["id"]) in results.done:
                continue
            before = transformers_rows.get((config.key(), example["id"]))
            if before is None:
                print(f"{example['id']}: no transformers row yet, skipped", flush=True)
                continue
            assert before["prompt_tokens"] == len(item.input_ids), f"{example['id']}: another prompt than the row's"
            settings = {"method": config.method, **config.params}
            params = SamplingParams(
                temperature=0.0, max_tokens=example["max_new_tokens"], extra_args={CONFIG_KEY: settings}
            )
            engine.add_request(example["id"], TokensPrompt(prompt_token_ids=item.input_ids), params)
            tokens: list[int] = []
            while engine.has_unfinished_requests():
                for output in engine.step():
                    tokens = list(output.outputs[0].token_ids)
            prediction = tokenizer.decode(tokens, skip_special_tokens=True)
            score = float(find_task(config.task).score(prediction, example))
            results.append(
                {
                    "run": RUN,
                    "config": config.key(),
                    "id": example["id"],
                    "task": config.task,
                    "seed": config.seed,
                    "index": index,
                    "method": config.method,
                    "params": config.params,
                    "prompt_tokens": len(item.input_ids),
                    "reference": example["reference"],
                    "prediction": prediction,
                    "score": score,
                    "new_tokens": len(tokens),
                    "transformers_prediction": before["prediction"],
                    "transformers_score": before["score"],
                    "transformers_new_tokens": before["new_tokens"],
                }
            )
            same = "same" if prediction == before["prediction"] else "DIFFERENT"
            print(f"{number + 1}/{len(work)} {example['id']}: {score:.2f} ({same}) {prediction!r}", flush=True)
    print(summary(args.out))


if __name__ == "__main__":
    main()
