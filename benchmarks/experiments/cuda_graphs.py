"""Decode steps replayed as CUDA graphs, on random weights in the shapes of the papers' 8B models (issue 48, item 4).

    PYTHONPATH=src python3 benchmarks/experiments/cuda_graphs.py --out OUT            # on a GPU
    PYTHONPATH=src python benchmarks/experiments/cuda_graphs.py --out OUT --quick     # here: a tiny shape, no graphs

Llama-3.1-8B and Qwen2-7B configs are written out below (no weights travel: a step's time does not depend on the
weights' values, except through how often `refreshkv`'s query check refreshes, which is reported). bfloat16. Rows go
to OUT/*.jsonl as soon as they are measured, so a run cut at its time limit keeps what it finished:

- `kernel.jsonl`: core/triton_decode.py against PyTorch's attention on random inputs (largest difference, by mode),
  and its launch shapes timed on a full cache of 32K and 128K keys, with SDPA over the same keys beside them; the
  fastest shape is used from then on.
- `tokens.jsonl`: on a 4-layer cut of the Llama shape at 4K, two distinct rows, 40 new tokens: each method's tokens
  replayed from graphs against the same steps run eagerly (must be equal) and against the package's eager
  `generate` (other kernels: the first step where they part, and the largest logit difference before it).
- `steps.jsonl`: per shape, length and batch, each method from one prefill: median replayed step by kind, ms per
  step over its schedule, tokens/s, the share of layer-steps that read C_f, KV bytes per row and the HBM floor
  (weights + KV read, over the copy bandwidth measured here); stock transformers (StaticCache, the step captured as
  a graph, not compiled) beside them; at 128K also `refreshkv` with its refresh as a conditional graph node, and
  with a threshold that no query falls below (what a query check costs where nothing drifts), each both ways. A
  run that fails writes its whole traceback to `errors.txt`.
- `--compiled`: the same steps compiled (torch.compile, fullgraph), then captured, each after the same method
  uncompiled, tokens compared.
"""

import argparse
import functools
import inspect
import json
import statistics
import time
import traceback
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from refreshkv import generate, make_policy
from refreshkv.core import triton_decode
from refreshkv.core.attention_math import attend_with_probs
from refreshkv.engine.cache_argument import with_cache
from refreshkv.measure.bench import memory_bandwidth
from refreshkv.runtime.generate import StepTimer, prefill
from refreshkv.runtime.static_decode import StaticCache, StaticDecoder

SHAPES = {
    "llama-3.1-8b": (
        LlamaForCausalLM,
        LlamaConfig,
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=128256,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
    ),
    "qwen2-7b": (
        Qwen2ForCausalLM,
        Qwen2Config,
        dict(
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            vocab_size=152064,
            max_position_embeddings=131072,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
    ),
}
BUDGET = 2048  # the paper's K (refreshkv.txt: Llama-3.1-8B at 16K)
SELECTION = {"budget": BUDGET, "pooling": "centered"}  # no tokenizer beside random weights: no word spans
# label: (method, its parameters, StaticDecoder's options)
METHODS = {
    "full": ("full", {}, {}),
    "refreshkv": ("refreshkv", SELECTION, {}),
    "recycled": ("recycled", SELECTION, {}),
    "snapkv": ("snapkv", SELECTION, {}),
    # a query check's refresh as a conditional graph node, skipped on the device where no row drifted; on random
    # weights every check drifts, so also a threshold no query falls below (the check step with nothing to refresh)
    "refreshkv-conditional": ("refreshkv", SELECTION, {"conditional": True}),
    "refreshkv-no-drift-conditional": ("refreshkv", {**SELECTION, "threshold": -1.0}, {"conditional": True}),
    "refreshkv-no-drift": ("refreshkv", {**SELECTION, "threshold": -1.0}, {}),
}
PAPER_METHODS = ["full", "refreshkv", "recycled", "snapkv"]
# (shape, length, batch), most wanted first: the targets are full at 32K and refreshkv at 128K
EVERY = ["transformers", *PAPER_METHODS]
RUNS = [
    ("llama-3.1-8b", 32768, 1, EVERY),
    (
        "llama-3.1-8b",
        131072,
        1,
        [*EVERY, "refreshkv-conditional", "refreshkv-no-drift", "refreshkv-no-drift-conditional"],
    ),
    ("llama-3.1-8b", 16384, 1, EVERY),
    ("llama-3.1-8b", 32768, 8, EVERY),
    ("llama-3.1-8b", 16384, 8, EVERY),
    ("qwen2-7b", 32768, 1, EVERY),
    ("qwen2-7b", 131072, 1, EVERY),
    ("qwen2-7b", 32768, 8, EVERY),
]
# compiling costs minutes per kind of step on the 8B shape: the two targets only
COMPILED_RUNS = [
    ("llama-3.1-8b", 32768, 1, ["full"]),
    ("llama-3.1-8b", 131072, 1, ["full", "refreshkv", "snapkv"]),
]
CHOSEN_TUNING = (128, 512, 8)  # what the first run chose on an H200 (docs/results/cuda-h200/graphs/kernel.jsonl)
TUNINGS = [(64, 1024, 4), (128, 1024, 4), (64, 2048, 4), (128, 512, 8), (64, 4096, 4)]


class _NotAsked(Exception):
    pass


class Rows:
    def __init__(self, out: Path):
        self.out = out
        out.mkdir(parents=True, exist_ok=True)

    def write(self, name: str, row: dict) -> None:
        with open(self.out / f"{name}.jsonl", "a") as file:
            file.write(json.dumps(row) + "\n")
        print(name, json.dumps(row), flush=True)


def build(shape: str, device: str, layers: int | None = None, **sizes):
    model_class, config_class, fields = SHAPES[shape]
    fields = {**fields, **sizes, "attn_implementation": "refreshkv"}
    if layers is not None:
        fields["num_hidden_layers"] = layers
    torch.manual_seed(0)
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if device == "cuda" else torch.float32)
    try:
        with torch.device(device):
            model = model_class(config_class(**fields))
    finally:
        torch.set_default_dtype(dtype)
    return model.eval()


def timed(function, repeats: int = 30) -> float:
    """Median milliseconds of `function` after one untimed call (CUDA events)."""
    function()
    timer = StepTimer(torch.device("cuda"))
    for _ in range(repeats):
        timer.mark()
        function()
        timer.mark()
    return 1000 * statistics.median(timer.seconds())


def check_kernel(rows: Rows, device: str) -> None:
    """Triton against PyTorch on fresh random inputs, and the launch shapes timed; keeps the fastest."""
    torch.manual_seed(1)
    for batch, query_heads, kv_heads, n in ((1, 32, 8, 5000), (3, 28, 4, 3000), (2, 4, 1, 700)):
        query = torch.randn(batch, query_heads, 1, 128, device=device, dtype=torch.bfloat16)
        keys = torch.randn(batch, kv_heads, n, 128, device=device, dtype=torch.bfloat16)
        values = torch.randn_like(keys)
        length = torch.tensor([n - 37], device=device)
        positions = torch.where(torch.rand(batch, kv_heads, n, device=device) < 0.2, -1, 5)
        flags = torch.arange(batch, device=device) % 2 == 0
        for mode, where in (("length", {"length": length}), ("positions", {"positions": positions})):
            out, probs = triton_decode.one_query_attention(
                query, keys, values, 0.088, **where, rows=flags, keep_logits=True
            )
            valid = (torch.arange(n, device=device) < length).view(1, 1, n) if mode == "length" else positions >= 0
            reference, reference_probs = attend_with_probs(query.float(), keys.float(), values.float(), 0.088, valid)
            chosen = flags.nonzero()[:, 0]
            error = (out[chosen].float() - reference[chosen]).norm() / reference[chosen].norm()
            prob_error = (probs[chosen] - reference_probs[chosen]).abs().max()
            rows.write(
                "kernel",
                {
                    "check": mode,
                    "batch": batch,
                    "heads": [query_heads, kv_heads],
                    "keys": n,
                    "relative_error": float(error),
                    "largest_prob_difference": float(prob_error),
                },
            )
    best = {}
    for n in (32768, 131072):
        query = torch.randn(1, 32, 1, 128, device=device, dtype=torch.bfloat16)
        keys = torch.randn(1, 8, n + 256, 128, device=device, dtype=torch.bfloat16)
        values = torch.randn_like(keys)
        length = torch.tensor([n], device=device)
        read = 2 * n * 8 * 128 * 2
        exact = (query, keys[:, :, :n], values[:, :, :n])
        sdpa = timed(functools.partial(torch.nn.functional.scaled_dot_product_attention, *exact, enable_gqa=True))
        rows.write("kernel", {"time": "sdpa_exact_length", "keys": n, "us": sdpa * 1000, "GBps": read / sdpa / 1e6})
        for block_n, programs, warps in TUNINGS:
            triton_decode.TUNING = triton_decode.Tuning(block_n, programs, warps)
            attention = functools.partial(triton_decode.one_query_attention, query, keys, values, 0.088, length=length)
            ms = timed(attention)
            rows.write(
                "kernel",
                {
                    "time": "triton",
                    "keys": n,
                    "tuning": [block_n, programs, warps],
                    "us": ms * 1000,
                    "GBps": read / ms / 1e6,
                },
            )
            best.setdefault((block_n, programs, warps), 0.0)
            best[(block_n, programs, warps)] += ms
    choice = min(best, key=best.get)
    triton_decode.TUNING = triton_decode.Tuning(*choice)
    rows.write("kernel", {"chosen": list(choice)})


def decode_static(
    model, name: str, prompt: torch.Tensor, batch: int, new_tokens: int, graphs: bool, compile: bool = False
):
    method, params, options = METHODS[name]
    cache = StaticCache(make_policy(method, **params), model, max_new_tokens=new_tokens)
    with torch.inference_mode():
        logits, prefill_s = prefill(model, prompt, torch.ones_like(prompt), cache)
        if batch > prompt.shape[0]:  # copies of the prompt's rows, each its own tensors
            copies = torch.arange(batch, device=prompt.device) % prompt.shape[0]
            cache.batch_select_indices(copies)
            logits = logits[copies]
        decoder = StaticDecoder(model, cache, logits, new_tokens, keep_logits=not graphs, compile=compile, **options)
        out = decoder.run(graphs=graphs)
    kv_bytes = sum(cache.nbytes_per_layer()) // batch
    return out, prefill_s, kv_bytes


def check_tokens(rows: Rows, device: str, compile: bool = False) -> None:
    """Graphs against eager steps of the same code (equal uncompiled), and against the package's eager decoding."""
    model = build("llama-3.1-8b", device, layers=4)
    generator = torch.Generator().manual_seed(2)
    prompt = torch.randint(100, model.config.vocab_size - 100, (2, 4096), generator=generator).to(device)
    for name in [*PAPER_METHODS, "refreshkv-conditional"]:
        replayed, _, _ = decode_static(model, name, prompt, 2, 40, graphs=device == "cuda", compile=compile)
        stepped, _, _ = decode_static(model, name, prompt, 2, 40, graphs=False)
        with torch.inference_mode():
            eager = generate(
                model,
                prompt,
                method=make_policy(METHODS[name][0], **METHODS[name][1]),
                max_new_tokens=40,
                return_logits=True,
                eos_token_id=[],
            )
        parted = next((i for i in range(40) if any(a[i] != b[i] for a, b in zip(eager.tokens, stepped.tokens))), None)
        upto = 40 if parted is None else parted
        difference = (torch.stack(eager.logits)[:upto] - stepped.logits[:upto]).abs().max()
        rows.write(
            "tokens",
            {
                "method": name,
                "compiled": compile,
                "graphs_equal_eager_steps": replayed.tokens == stepped.tokens,
                "graphs": replayed.graphs,
                "first_step_parting_from_generate": parted,
                "largest_logit_difference_before": float(difference),
                "full_share_graphs": replayed.full_share,
                "full_share_generate": eager.cache.full_step_fraction(),
            },
        )
    del model
    if device == "cuda":
        torch.cuda.empty_cache()


def schedule_ms(out) -> tuple[float, dict]:
    """Median replayed ms per kind, and ms per step over the run's own mix of kinds."""
    by_kind: dict[str, list[float]] = {}
    for kind, ms, replayed in zip(out.kinds, out.step_ms, out.replayed):
        if replayed:
            by_kind.setdefault(kind, []).append(ms)
    medians = {kind: statistics.median(times) for kind, times in by_kind.items()}
    counts = {kind: out.kinds.count(kind) for kind in medians}
    return sum(medians[kind] * counts[kind] for kind in medians) / sum(counts.values()), medians


def stock_step_ms(model, length: int, batch: int, new_tokens: int) -> float:
    """Stock transformers: StaticCache of length + new tokens, its step captured as one graph. Timed at positions
    from `length` on after a 16-token prefill (the step attends over the whole StaticCache with a mask, so its time
    does not depend on what the cache holds)."""
    from transformers import StaticCache as StockCache

    model.set_attn_implementation("sdpa")
    device = next(model.parameters()).device
    cache = StockCache(config=model.config, max_cache_len=length + new_tokens + 8)
    takes_position = "cache_position" in inspect.signature(type(model).forward).parameters
    short = torch.randint(100, 1000, (batch, 16), device=device)
    extra = {"cache_position": torch.arange(16, device=device)} if takes_position else {}
    with torch.inference_mode():
        out = model(
            short,
            position_ids=torch.arange(16, device=device)[None].expand(batch, -1),
            use_cache=True,
            **with_cache(model, cache),
            **extra,
        )
        for layer in cache.layers:  # jump to `length`: the write position lives on the device
            if hasattr(layer, "cumulative_length"):
                layer.cumulative_length.fill_(length)
        token = out.logits[:, -1:].argmax(-1)
        position = torch.full((batch, 1), length, device=device)
        cache_position = torch.full((1,), length, device=device)

        def step():
            extra = {"cache_position": cache_position} if takes_position else {}
            logits = model(token, position_ids=position, use_cache=True, **with_cache(model, cache), **extra).logits
            token.copy_(logits[:, -1:].argmax(-1))
            position.add_(1)
            cache_position.add_(1)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        ms = timed(graph.replay, repeats=min(new_tokens, 30))
    model.set_attn_implementation("refreshkv")
    return ms


def run_steps(
    rows: Rows,
    shape: str,
    length: int,
    batch: int,
    new_tokens: int,
    bandwidth: float,
    deadline: float,
    methods: list[str],
    compile: bool = False,
):
    model = build(shape, "cuda")
    config = model.config
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * 128 * 2  # K and V, bfloat16
    generator = torch.Generator().manual_seed(3)
    prompt = torch.randint(100, config.vocab_size - 100, (1, length), generator=generator).to("cuda")
    base = {
        "shape": shape,
        "length": length,
        "batch": batch,
        "new_tokens": new_tokens,
        "device": torch.cuda.get_device_name(),
        "tuning": list(vars(triton_decode.TUNING).values()),
    }
    full_kv = batch * per_token * (length + new_tokens // 2)
    try:
        if "transformers" not in methods:
            raise _NotAsked
        ms = stock_step_ms(model, length, batch, new_tokens)
        floor = (weights + batch * per_token * (length + new_tokens + 8)) / bandwidth * 1000
        rows.write(
            "steps",
            {
                **base,
                "method": "transformers",
                "ms_per_step": ms,
                "tokens_per_s": batch * 1000 / ms,
                "floor_ms": floor,
                "over_floor": ms / floor,
            },
        )
    except _NotAsked:
        pass
    except Exception as error:  # report and go on: the methods below do not need it
        rows.write("steps", {**base, "method": "transformers", "error": f"{type(error).__name__}: {error}"[:300]})
    for name in [name for name in METHODS if name in methods]:
        uncompiled = None  # compiled runs follow the same method uncompiled, on the same machine, tokens compared
        for compiled in [False, True] if compile else [False]:
            if time.time() > deadline:
                rows.write("steps", {**base, "method": name, "compiled": compiled, "skipped": "time budget"})
                continue
            torch.cuda.reset_peak_memory_stats()
            try:
                started = time.time()
                out, prefill_s, kv_bytes = decode_static(model, name, prompt, batch, new_tokens, True, compiled)
            except Exception as error:
                row = {**base, "method": name, "compiled": compiled, "error": f"{type(error).__name__}: {error}"[:300]}
                rows.write("steps", row)
                with open(rows.out / "errors.txt", "a") as file:  # the whole of it: a worker's cause comes last
                    file.write(f"{json.dumps(row)}\n{traceback.format_exc()}\n")
                torch.cuda.empty_cache()
                continue
            ms, medians = schedule_ms(out)
            partial_kv = batch * per_token * (BUDGET + 1 if name != "snapkv" else BUDGET + new_tokens // 2)
            read = full_kv if name == "full" else out.full_share * full_kv + (1 - out.full_share) * partial_kv
            floor = (weights + read) / bandwidth * 1000
            row = {
                **base,
                "method": name,
                "compiled": compiled,
                "ms_per_step": ms,
                "median_ms_by_kind": medians,
                "tokens_per_s": batch * 1000 / ms,
                "full_share": out.full_share,
                "floor_ms": floor,
                "over_floor": ms / floor,
                "kv_mb_per_row": kv_bytes / 2**20,
                "peak_gb": torch.cuda.max_memory_allocated() / 2**30,
                "prefill_s": prefill_s,
                "graphs": out.graphs,
                "seconds": time.time() - started,
            }
            if uncompiled is not None:
                parted = [i for i, pair in enumerate(zip(uncompiled.tokens[0], out.tokens[0])) if pair[0] != pair[1]]
                row["tokens_equal_uncompiled"] = uncompiled.tokens == out.tokens
                row["first_step_parting_from_uncompiled"] = parted[0] if parted else None
            rows.write("steps", row)
            uncompiled = out
            torch.cuda.empty_cache()
    del model
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, default=330.0, help="stop starting runs after this many seconds")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="on the CPU: the token check on a tiny cut, no graphs")
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="instead: the steps compiled (torch.compile, then captured) for COMPILED_RUNS, with the launch shape "
        "the first run chose",
    )
    args = parser.parse_args()
    start = time.time()
    rows = Rows(args.out)
    if args.quick:
        global SHAPES
        SHAPES = {
            name: (m, c, {**f, "hidden_size": 256, "intermediate_size": 512, "vocab_size": 4096})
            for name, (m, c, f) in SHAPES.items()
        }
        check_tokens(rows, "cpu")
        return
    if args.compiled:
        triton_decode.TUNING = triton_decode.Tuning(*CHOSEN_TUNING)
        torch._inductor.config.compile_threads = 16
    else:
        check_kernel(rows, "cuda")
        check_tokens(rows, "cuda")
    bandwidth = memory_bandwidth(torch.device("cuda"), megabytes=4096, repeats=10)
    rows.write(
        "steps",
        {
            "copy_bandwidth_GBps": bandwidth / 1e9,
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "seconds_so_far": time.time() - start,
        },
    )
    for shape, length, batch, methods in COMPILED_RUNS if args.compiled else RUNS:
        if time.time() - start > args.budget_s:
            rows.write("steps", {"shape": shape, "length": length, "batch": batch, "skipped": "time budget"})
            continue
        deadline = start + args.budget_s + 60
        run_steps(rows, shape, length, batch, args.new_tokens, bandwidth, deadline, methods, args.compiled)
    print("done in", round(time.time() - start), "s")


if __name__ == "__main__":
    main()
