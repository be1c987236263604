"""The CUDA path, checked and timed on a GPU machine in one go.

    python benchmarks/cuda_check.py shapes DIR                 # here: config + tokenizer of both named models
    python benchmarks/cuda_check.py check DIR --out OUT        # on the GPU: random weights in those shapes

The GPU machines this project is lent cannot install the named models (no package index; the GGUF files are larger
than what travels), so `check` builds each model from its config with seeded random weights: a decode step's
time does not depend on the weights' values, except through how often the query-drift schedule of `refreshkv`
refreshes (reported as `full_step_fraction`; `recycled`'s fixed stride is independent of them). It writes:

- `methods.jsonl`: every registered method decodes on the GPU from a shared prefill, fed `full`'s tokens (teacher
  forcing, so near-tied random logits cannot send the methods down different paths): with a budget that holds
  every token, the largest logit difference to `full` (must be float32 rounding); at K = L/8, that its logits are
  finite and where its cache lies (`kv_bytes_by_device`); `refreshkv` with `full_cache="offload"` against the dense
  one (its C_f in pinned host memory: the only path that needs a GPU).
- `decode-attention.jsonl`: one query over 8K-32K keys in each model's head layout, float32 and bfloat16, as
  `decode_attention` computes it on a GPU (the query heads of a group packed into rows of their KV head, then SDPA)
  against SDPA over the unpacked heads (`enable_gqa`) and the explicit products: median microseconds of 50 calls
  and the largest difference to the packed output (the first GPU run found `full`'s float32 step slow at 8K).
- `bench-*.json`: `refreshkv bench --device cuda` on both shapes (bfloat16 and float32), then compiled at 8K
  (on an H200 its compiling round had not finished after 280 s: give the run 10 minutes or more).
"""

import argparse
import itertools
import json
import shutil
import subprocess
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


def check_methods(model_dir: Path, out: Path, prompt_length: int = 2048, new_tokens: int = 32) -> None:
    import refreshkv
    from refreshkv.measure.bench import bench_prompt

    model, tokenizer = refreshkv.load_model(model_dir, device="cuda")
    ids = bench_prompt(tokenizer, prompt_length).cuda()
    full = refreshkv.generate(model, ids, method="full", max_new_tokens=new_tokens, return_logits=True, eos_token_id=[])
    forced = torch.tensor(full.tokens, device="cuda")
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
            rows.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)


def decode_variants(query, keys, values) -> dict:
    """One query's attention over a KV-head-sized cache, three ways, each returning (1, query heads, 1, dim)."""
    import torch.nn.functional as F

    from refreshkv.core.attention_math import _explicit_attention, pack_queries

    heads, kv_heads, dim = query.shape[1], keys.shape[1], query.shape[-1]
    scale, packed = dim**-0.5, pack_queries(query, kv_heads)
    return {
        "packed_sdpa": lambda: F.scaled_dot_product_attention(packed, keys, values, scale=scale).reshape(query.shape),
        "gqa_sdpa": lambda: F.scaled_dot_product_attention(query, keys, values, scale=scale, enable_gqa=True),
        "explicit": lambda: _explicit_attention(packed, keys, values, scale, None).reshape(1, heads, 1, dim),
    }


def median_us(call, repeats: int = 50) -> float:
    call()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(1000 * start.elapsed_time(end))
    return sorted(times)[repeats // 2]


def time_decode_attention(out: Path) -> None:
    shapes = {"smollm2-135m": (9, 3, 64), "gemma3-270m": (4, 1, 256)}  # query heads, KV heads, head dimension
    with out.open("w") as rows:
        for (model, (heads, kv_heads, dim)), dtype, n in itertools.product(
            shapes.items(), (torch.float32, torch.bfloat16), (8192, 32768)
        ):
            query = torch.randn(1, heads, 1, dim, device="cuda", dtype=dtype)
            keys, values = (torch.randn(1, kv_heads, n, dim, device="cuda", dtype=dtype) for _ in range(2))
            variants = decode_variants(query, keys, values)
            reference = variants["packed_sdpa"]().float()
            for name, call in variants.items():
                row = {"model": model, "dtype": str(dtype).removeprefix("torch."), "keys": n, "variant": name}
                row["us"] = round(median_us(call), 1)
                row["max_diff"] = (call().float() - reference).abs().max().item()
                rows.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)


def bench(model_dir: Path, out: Path, lengths: str, budget: int, dtype: str, methods: str, *options: str) -> None:
    """`refreshkv bench` in a process of its own (as a user runs it), stopped after 5 minutes."""
    command = [sys.executable, "-m", "refreshkv", "bench", "--model", str(model_dir), "--device", "cuda"]
    command += ["--dtype", dtype, "--lengths", lengths, "--budget", str(budget), "--methods", methods]
    command += ["--new-tokens", "64", "--json", str(out), *options]
    print(" ".join(command[1:]), flush=True)
    started = time.perf_counter()
    try:
        subprocess.run(command, check=False, timeout=300)
    except subprocess.TimeoutExpired:
        print(f"{out.name}: stopped after 300 s", flush=True)
    print(f"{out.name}: {time.perf_counter() - started:.0f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=["shapes", "check"])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--out", type=Path, default=Path("cuda-check"))
    parser.add_argument("--models", type=Path, default=Path("/tmp/cuda-check-models"))
    args = parser.parse_args()
    if args.step == "shapes":
        save_shapes(args.folder)
        return
    if not torch.cuda.is_available():
        sys.exit("cuda_check.py check: no CUDA GPU here")
    args.out.mkdir(parents=True, exist_ok=True)
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    time_decode_attention(args.out / "decode-attention.jsonl")
    smollm2 = random_model(args.folder / "smollm2-135m", args.models / "smollm2-135m")
    gemma = random_model(args.folder / "gemma3-270m", args.models / "gemma3-270m")
    check_methods(smollm2, args.out / "methods.jsonl")
    speed = "transformers,full,refreshkv,recycled,quest,snapkv,streamingllm,h2o"
    bench(smollm2, args.out / "bench-smollm2-bf16.json", "1024,4096,8192", 1024, "bfloat16", speed, "--rounds", "3")
    bench(gemma, args.out / "bench-gemma-bf16.json", "16384,32768", 2048, "bfloat16", speed, "--rounds", "2")
    bench(smollm2, args.out / "bench-smollm2-fp32.json", "1024,8192", 1024, "float32", speed, "--rounds", "2")
    # last, as it may run out of time: decode steps compiled with the GPU backend (a first round compiles, untimed)
    compiled = "full,refreshkv,recycled"
    bench(smollm2, args.out / "bench-smollm2-bf16-compiled.json", "8192", 1024, "bfloat16", compiled, "--compile")


if __name__ == "__main__":
    main()
