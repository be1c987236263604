"""What bounds a decode step of B rows on the CPU, and so the tokens/s ratio of a K-token method to `full` (issue 48).

A step is the model's products (the weights, read once for all rows), the attention (every row's keys and values)
and everything else (transformers' small operators and Python). This times, in one process on the embedded model in
float32 with packed weights:
- the step's 211 products on B rows, each module once in order (the weights are read from memory, not from the CPU's
  caches), against the floating-point rate of a large matrix product (the CPU's peak for these products) and the
  weights' bytes at the copy bandwidth `bench` uses for its floor;
- the C attention of one query over K and over L tokens against a plain read of the same bytes (`torch.sum` of the
  keys and the values), as decode_attention.py times them: 30 layers of distinct caches, alternating, best of rounds.
From them: the ratio `full` / K-token step if nothing else took time, and the most that everything else may take for
a ratio of `--target`. `bench --batch` measures the real steps (docs/benchmark.md).

    python benchmarks/perf/batch_step_bound.py --batch 8 --length 8192 --budget 1024 --threads 2
"""

import argparse

import torch
from decode_attention import best_ms, compare, kv_bytes  # this folder's: the scripts run from it

from refreshkv import load_model
from refreshkv.measure.bench import cpu_facts, memory_bandwidth
from refreshkv.runtime.packed_linear import PackedLinear, pack_linear_weights


def peak_gflops() -> float:
    """GFLOP/s of a 2048^3 float32 matrix product: what these threads compute at best."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    return 2 * 2048**3 / best_ms(lambda: a @ b) / 1e6


def products(model, batch: int) -> tuple[float, int, int]:
    """ms of one step's products on `batch` rows, their weight bytes and multiply-adds."""
    modules = [m for m in model.modules() if isinstance(m, PackedLinear)]
    inputs = [torch.randn(batch, m.in_features) for m in modules]

    def step():
        for module, x in zip(modules, inputs, strict=True):
            module(x)

    weights = sum(m.in_features * m.out_features for m in modules)
    return best_ms(step), 4 * weights, batch * weights


def attention(batch: int, tokens: int) -> tuple[float, float, int]:
    """ms of the C attention over `tokens` tokens in every layer, ms of a plain read of those bytes, and the bytes."""
    times = compare(tokens, torch.float32, batch, ("c", "read"))
    return times["c"], times["read"], kv_bytes(tokens, batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--target", type=float, default=3.3, help="a ratio to `full` to work out the slack for")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model()
    pack_linear_weights(model)
    facts = cpu_facts()
    with torch.inference_mode():
        bandwidth = memory_bandwidth(torch.device("cpu")) / 1e9
        peak = peak_gflops()
        product_ms, weight_bytes, multiply_adds = products(model, args.batch)
        full_ms, full_read_ms, full_bytes = attention(args.batch, args.length)
        kept_ms, kept_read_ms, kept_bytes = attention(args.batch, args.budget)
    print(f"{facts['cpu']} ({facts['kernels']}), {args.threads} threads, float32, packed weights, B = {args.batch}")
    print(f"copy bandwidth {bandwidth:.1f} GB/s; a 2048^3 product {peak:.0f} GFLOP/s")
    print(
        f"products: {product_ms:.1f} ms ({weight_bytes / 1e6:.0f} MB: {weight_bytes / product_ms / 1e6:.1f} GB/s; "
        f"{2 * multiply_adds / product_ms / 1e6:.0f} GFLOP/s). Bounds: bytes at the copy bandwidth "
        f"{weight_bytes / bandwidth / 1e6:.1f} ms, work at the peak rate {2 * multiply_adds / peak / 1e6:.1f} ms"
    )
    for name, tokens, attend_ms, read_ms, size in (
        ("full", args.length, full_ms, full_read_ms, full_bytes),
        ("K-token", args.budget, kept_ms, kept_read_ms, kept_bytes),
    ):
        print(
            f"{name} attention over {tokens} tokens: {attend_ms:.1f} ms ({size / attend_ms / 1e6:.1f} GB/s); "
            f"a plain read of its {size / 1e6:.0f} MB {read_ms:.1f} ms ({size / read_ms / 1e6:.1f} GB/s)"
        )
    ceiling = (product_ms + full_ms) / (product_ms + kept_ms)
    slack = (full_ms - args.target * kept_ms) / (args.target - 1)
    print(
        f"ratio full / K-token step with nothing but these products and attentions: {ceiling:.2f}x; for "
        f"{args.target:g}x, products plus everything else besides attention must take at most {slack:.1f} ms"
    )


if __name__ == "__main__":
    main()
