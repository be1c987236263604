"""The CUDA path, checked and timed on a GPU machine in one go.

    python benchmarks/experiments/cuda_check.py shapes DIR      # here: config + tokenizer of both named models
    python benchmarks/experiments/cuda_check.py check DIR --out OUT   # on the GPU: random weights in those shapes
    python benchmarks/experiments/cuda_check.py check DIR --device cpu --quick   # here, before spending device time

The GPU machines this project is lent cannot install the named models (no package index; the GGUF files are larger
than what travels), so `check` builds each model from its config with seeded random weights: a decode step's
time does not depend on the weights' values, except through how often the query-drift schedule of `refreshkv`
refreshes (reported as `full_step_fraction`; `recycled`'s fixed stride is independent of them). It writes, each
row as soon as it is measured (a run stopped at its time limit keeps what it finished):

- `decode-attention.jsonl`: one query over 1K-32K keys in each model's head layout, float32 and bfloat16, without
  a mask and with one as a partial cache's empty slots give it: the query heads of a group packed into rows of
  their KV head then SDPA, SDPA over the unpacked heads (`enable_gqa`; without a mask also through
  `attention_math.grouped_decode`) and the explicit products: median microseconds of 50 calls and the largest
  difference to the packed output.
- `methods.jsonl`: every registered method decodes on the GPU from a shared prefill, fed `full`'s tokens (teacher
  forcing, so near-tied random logits cannot send the methods down different paths): with a budget that holds
  every token, the largest logit difference to `full` (must be float32 rounding); at K = L/8, that its logits are
  finite and where its cache lies (`kv_bytes_by_device`); `refreshkv` with `full_cache="offload"` against the dense
  one (its C_f in pinned host memory: the only path that needs a GPU).
- `decode-ab.jsonl`: `full` and `refreshkv` with the one-query attention always packed and always over the
  unpacked heads (`attention_math.GROUPED_DECODE_FROM` 2^31 and 0), alternated in one process, stock transformers
  beside them: median decode step per round.
- `decode-ab-padded.jsonl`: `full` over two rows of which one is left-padded (so every step has a mask), its
  one-query attention always packed against the shipped rule, alternated in one process: median decode step and
  whether the greedy tokens are the packed run's.
- `compiled.jsonl`: the `--compiled` methods eager and with `compile=True` at 8K in bfloat16: the first compiled
  generation's seconds (it compiles) and the median step of the ones after it. Last, as it may not finish.

Question it answered (three H200 sessions, commits 2ebb988 to 1bf9347): does every method run on CUDA and equal
`full` where it must, what limits a decode step there, and from how many keys one query is attended over the
unpacked heads. Answer: every method runs and matches `full` (largest logit difference 0, or 2.5e-6 for the methods
with their own softmax); a step is host-bound (17-47 ms eager, 9-13 ms compiled, stock transformers too); the
unpacked heads from 4,096 keys (`attention_math.GROUPED_DECODE_FROM`). Figures: docs/benchmark.md, "On a GPU";
rows: docs/results/cuda-h200/. Run it again when a GPU of another kind is lent.
"""

import argparse
import contextlib
import itertools
import json
import shutil
import sys
import time
from pathlib import Path

import torch

SHAPE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)
WINDOW = {"snapkv": {"window": 8}, "pyramidkv": {"window": 8}, "dynamickv": {"window": 8}}


def settings(method: str, keep_all: int, small: int) -> list[dict]:
    """A method's parameters that keep every token (its output must equal `full`'s), then K = `small`."""
    if method == "full":
        return [{}]
    if method == "refreekv":  # no budget: threshold 0 keeps every token
        return [{"threshold": 0.0}, {"threshold": 0.01}]
    return [{"budget": budget, **WINDOW.get(method, {})} for budget in (keep_all, small)]


def save_shapes(folder: Path) -> None:
    """Config and tokenizer of each named model, without weights (what `check` builds random models from)."""
    from refreshkv.runtime.loading import resolve_model_dir

    for name in ("smollm2-135m", "gemma3-270m"):
        source, target = resolve_model_dir(name), folder / name
        target.mkdir(parents=True, exist_ok=True)
        for file in SHAPE_FILES:
            if (source / file).is_file():
                shutil.copy(source / file, target / file)


def random_model(shape: Path, target: Path) -> Path:
    """A model folder with seeded random weights in `shape`'s architecture, loadable by `--model`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(shape))
    model.save_pretrained(target)
    for file in SHAPE_FILES:
        if (shape / file).is_file() and not (target / file).is_file():
            shutil.copy(shape / file, target / file)
    return target


def check_methods(model_dir: Path, out: Path, device: torch.device, prompt_length: int, new_tokens: int) -> None:
    import refreshkv
    from refreshkv.measure.bench import bench_prompt

    model, tokenizer = refreshkv.load_model(model_dir, device=str(device))
    ids = bench_prompt(tokenizer, prompt_length).to(device)
    full = refreshkv.generate(model, ids, method="full", max_new_tokens=new_tokens, return_logits=True, eos_token_id=[])
    forced = torch.tensor(full.tokens, device=device)
    keep_all, small = prompt_length + new_tokens, prompt_length // 8

    def follow(method, **params):
        start = time.perf_counter()
        out = refreshkv.generate(model, ids, method=method, forced_tokens=forced, return_logits=True, **params)
        logits = torch.stack(out.logits)
        return {
            "max_logit_diff_to_full": (logits - torch.stack(full.logits)).abs().max().item(),
            "finite": bool(torch.isfinite(logits).all()),
            "kv_bytes_by_device": out.stats()["kv_bytes_by_device"],
            "seconds": round(time.perf_counter() - start, 2),
        }

    with out.open("w") as rows:
        runs = [(name, params) for name in sorted(refreshkv.METHODS) for params in settings(name, keep_all, small)]
        runs += [("recycled", {"budget": small, "full_cache": where, "stride": 4}) for where in ("dense", "offload")]
        for name, params in runs:
            try:
                row = {"method": name, "params": params, **follow(name, **params)}
            except Exception as error:  # a method that fails on the GPU is the finding: record it, go on
                row = {"method": name, "params": params, "error": f"{type(error).__name__}: {error}"[:500]}
            write_row(rows, row)


def decode_variants(query, keys, values, mask) -> dict:
    """One query's attention over a KV-head-sized cache, each way returning (1, query heads, 1, dim); `mask` None or
    (1, KV heads, 1, n) bool as a partial cache's empty slots give it (SDPA over the unpacked heads then takes it
    repeated per query head)."""
    import torch.nn.functional as F

    from refreshkv.core.attention_math import _explicit_attention, grouped_decode, pack_queries

    heads, kv_heads, dim = query.shape[1], keys.shape[1], query.shape[-1]
    scale, packed = dim**-0.5, pack_queries(query, kv_heads)
    group = heads // kv_heads
    per_head = None if mask is None else mask.repeat_interleave(group, 1)
    variants = {
        "packed_sdpa": lambda: F.scaled_dot_product_attention(packed, keys, values, attn_mask=mask, scale=scale),
        "grouped_sdpa": lambda: F.scaled_dot_product_attention(
            query, keys, values, attn_mask=per_head, scale=scale, enable_gqa=True
        ),
        "explicit": lambda: _explicit_attention(packed, keys, values, scale, mask),
    }
    if mask is None:  # the library's own call, to see that it is the variant above
        variants["grouped_decode"] = lambda: grouped_decode(query, keys, values, scale).transpose(1, 2)
    return {name: (lambda call=call: call().reshape(1, heads, 1, dim)) for name, call in variants.items()}


def median_us(call, device: torch.device, repeats: int = 50) -> float:
    """Median microseconds of `repeats` calls after one untimed call (CUDA events on a GPU: generate.StepTimer)."""
    from refreshkv.runtime.generate import StepTimer

    call()
    timer = StepTimer(device)
    for _ in range(repeats):
        timer.mark()
        call()
        timer.mark()
    return 1e6 * sorted(timer.seconds())[repeats // 2]


def write_row(rows, row: dict) -> None:
    rows.write(json.dumps(row) + "\n")
    rows.flush()
    print(json.dumps(row), flush=True)


def time_decode_attention(out: Path, device: torch.device, lengths: tuple[int, ...]) -> None:
    shapes = {"smollm2-135m": (9, 3, 64), "gemma3-270m": (4, 1, 256)}  # query heads, KV heads, head dimension
    with out.open("w") as rows:
        for (model, (heads, kv_heads, dim)), dtype, n, masked in itertools.product(
            shapes.items(), (torch.float32, torch.bfloat16), lengths, (False, True)
        ):
            query = torch.randn(1, heads, 1, dim, device=device, dtype=dtype)
            keys, values = (torch.randn(1, kv_heads, n, dim, device=device, dtype=dtype) for _ in range(2))
            # a partial cache's empty slots: about 1 in 64 off, different per KV head
            mask = torch.rand(1, kv_heads, 1, n, device=device) > 1 / 64 if masked else None
            variants = decode_variants(query, keys, values, mask)
            reference = variants["packed_sdpa"]().float()
            for name, call in variants.items():
                row = {"model": model, "dtype": str(dtype).removeprefix("torch."), "keys": n, "masked": masked}
                row |= {"variant": name, "us": round(median_us(call, device), 1)}
                row["max_diff"] = (call().float() - reference).abs().max().item()
                write_row(rows, row)


@contextlib.contextmanager
def unpacked_heads_from(keys: int):
    """Inside the block, one query takes the unpacked heads from `keys` keys on (`attention_math.GROUPED_DECODE_FROM`;
    0: always, 2**31: never, packed rows); the shipped value is back after it."""
    from refreshkv.core import attention_math

    shipped = attention_math.GROUPED_DECODE_FROM
    attention_math.GROUPED_DECODE_FROM = keys
    try:
        yield
    finally:
        attention_math.GROUPED_DECODE_FROM = shipped


def decode_ab(model_dir: Path, out, device, dtype: str, length: int, budget: int, new_tokens: int, rounds: int):
    """`full` and `refreshkv` with the one-query attention packed, then over the unpacked heads, alternated round by
    round."""
    import refreshkv
    from refreshkv.measure.bench import bench_prompt
    from refreshkv.measure.bench_round import REFERENCE, PeakMemory, run_round

    model, tokenizer = refreshkv.load_model(model_dir, dtype=getattr(torch, dtype), device=str(device))
    ids = bench_prompt(tokenizer, length - new_tokens).to(device)  # length: with the new tokens
    methods = {"full": {}, "refreshkv": {"budget": budget}}
    for round_, grouped in itertools.product(range(rounds), (False, True)):
        names = ([] if grouped else [REFERENCE]) + list(methods)
        with unpacked_heads_from(0 if grouped else 2**31):
            runs = run_round(model, ids, methods, names, new_tokens, PeakMemory(device), share_prefill=False)
        for run in runs:
            row = {"model": model_dir.name, "dtype": dtype, "length": length, "round": round_}
            row |= {"method": run.method, "grouped": grouped if run.method != REFERENCE else None}
            row |= {
                "median_step_ms": round(1000 * run.decode_median_s, 3),
                "mean_ms": round(1000 * run.decode_mean_s, 3),
            }
            write_row(out, row)
    del model


def decode_ab_padded(model_dir: Path, out, device, dtype: str, length: int, new_tokens: int, rounds: int):
    """`full` over two rows, one left-padded (`length` and 7/8 of it: every step has a mask), the one-query attention
    always packed against the shipped rule (`GROUPED_DECODE_FROM`), alternated round by round."""
    import statistics

    import refreshkv
    from refreshkv.core import attention_math
    from refreshkv.measure.bench import bench_prompt

    model, tokenizer = refreshkv.load_model(model_dir, dtype=getattr(torch, dtype), device=str(device))
    long, short = bench_prompt(tokenizer, length - new_tokens), bench_prompt(tokenizer, (length - new_tokens) * 7 // 8)
    pad = long.shape[1] - short.shape[1]
    ids = torch.cat([long, torch.cat([long.new_zeros(1, pad), short], 1)]).to(device)
    attention_mask = (torch.arange(ids.shape[1]) >= torch.tensor([[0], [pad]])).long().to(device)
    shipped, packed_tokens = attention_math.GROUPED_DECODE_FROM, None
    for round_, rule in itertools.product(range(rounds), ("packed", "shipped")):
        with unpacked_heads_from(shipped if rule == "shipped" else 2**31):
            result = refreshkv.generate(model, ids, attention_mask, max_new_tokens=new_tokens, eos_token_id=[])
        row = {"model": model_dir.name, "dtype": dtype, "length": length, "rows": 2, "round": round_, "rule": rule}
        row["median_step_ms"] = round(1000 * statistics.median(result.step_s), 3)
        packed_tokens = result.tokens if rule == "packed" else packed_tokens  # this round's packed run's
        row["same_tokens_as_packed"] = result.tokens == packed_tokens
        write_row(out, row)
    del model


def time_compiled(model_dir: Path, out, device, methods: list[str], length: int, budget: int, new_tokens: int):
    """Eager, then compiled (the first compiled generation compiles; two more are timed), one row per method."""
    import statistics

    import refreshkv
    from refreshkv.measure.bench import bench_prompt

    model, tokenizer = refreshkv.load_model(model_dir, dtype=torch.bfloat16, device=str(device))
    ids = bench_prompt(tokenizer, length - new_tokens).to(device)  # length: with the new tokens
    for method in methods:
        params = {} if method == "full" else {"budget": budget}
        settings = dict(method=method, max_new_tokens=new_tokens, eos_token_id=[], **params)
        eager = [refreshkv.generate(model, ids, **settings) for _ in range(2)]
        started = time.perf_counter()
        refreshkv.generate(model, ids, compile=True, **settings)
        compile_s = time.perf_counter() - started
        compiled = [refreshkv.generate(model, ids, compile=True, **settings) for _ in range(2)]
        row = {"model": model_dir.name, "method": method, "length": length, "budget": params.get("budget")}
        row["first_compiled_generation_s"] = round(compile_s, 1)
        for name, results in (("eager", eager), ("compiled", compiled)):
            row[f"{name}_median_step_ms"] = [round(1000 * statistics.median(r.step_s), 3) for r in results]
        row["full_step_fraction"] = compiled[-1].cache.full_step_fraction()
        row["same_tokens_as_eager"] = compiled[-1].tokens == eager[-1].tokens
        write_row(out, row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=["shapes", "check"])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--out", type=Path, default=Path("cuda-check"))
    parser.add_argument("--models", type=Path, default=Path("/tmp/cuda-check-models"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="small sizes, to try the script before a GPU run")
    parser.add_argument("--steps", default="attention,methods,ab,compiled", help="which of these to run")
    parser.add_argument("--lengths", default="1024,2048,4096,8192,32768", help="key counts of the attention step")
    parser.add_argument("--compiled", default="full,refreshkv,recycled", help="methods of the compiled step")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each A/B")
    args = parser.parse_args()
    if args.step == "shapes":
        save_shapes(args.folder)
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("cuda_check.py check: no CUDA GPU here")
    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    print(torch.__version__, torch.cuda.get_device_name() if device.type == "cuda" else "cpu", flush=True)
    quick, steps = args.quick, args.steps.split(",")
    if "attention" in steps:
        lengths = (512,) if quick else tuple(int(n) for n in args.lengths.split(","))
        time_decode_attention(args.out / "decode-attention.jsonl", device, lengths)
    if not {"methods", "ab", "ab-padded", "compiled"} & set(steps):
        return
    smollm2 = random_model(args.folder / "smollm2-135m", args.models / "smollm2-135m")
    if "methods" in steps:
        check_methods(smollm2, args.out / "methods.jsonl", device, *((256, 8) if quick else (2048, 32)))
    new_tokens, rounds = (8, 1) if quick else (64, args.rounds)
    if "ab" in steps:
        gemma = random_model(args.folder / "gemma3-270m", args.models / "gemma3-270m")
        with (args.out / "decode-ab.jsonl").open("w") as rows:
            for model_dir, dtype, length, budget in (
                (smollm2, "float32", 8192, 1024),
                (smollm2, "bfloat16", 8192, 1024),
                (gemma, "bfloat16", 16384, 2048),
            ):
                length, budget = (512, 128) if quick else (length, budget)
                decode_ab(model_dir, rows, device, dtype, length, budget, new_tokens, rounds)
    if "ab-padded" in steps:
        with (args.out / "decode-ab-padded.jsonl").open("w") as rows:
            for dtype in ("float32", "bfloat16"):
                decode_ab_padded(smollm2, rows, device, dtype, 512 if quick else 8192, new_tokens, rounds)
    if "compiled" in steps:
        with (args.out / "compiled.jsonl").open("w") as rows:
            methods = ["full"] if quick else args.compiled.split(",")
            time_compiled(smollm2, rows, device, methods, 512 if quick else 8192, 128 if quick else 1024, new_tokens)


if __name__ == "__main__":
    main()
