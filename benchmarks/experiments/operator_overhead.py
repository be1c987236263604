"""What a compiled step pays to reach the refresh's C: one `refresh_partial` call timed through the Python function
the eager step calls (`native_selection._refresh`: the arguments, then ctypes), through the operator a compiled step
calls (`torch.ops.refreshkv`, defined on a torch.library.Library), and through the same function defined with
torch.library.custom_op (as it was before), alternating, under inference mode, on SmolLM2's shapes without the model
(caches hot).

    ATEN_CPU_CAPABILITY=avx2 python benchmarks/experiments/operator_overhead.py --length 8192 --threads 2

Question it answered (commit f258299, AMD EPYC with AVX-512 restricted to AVX2 kernels, 2 threads): what does a
compiled step pay per call to reach the C? Answer: 142.3 us eager, 147.7 through the Library's operator, 204.2
through custom_op; so the operators are defined on a Library (core/native_selection.py).
"""

import argparse
import statistics
import time

import torch

from refreshkv.core import native_selection


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=15, help="alternations; each times 50 calls of every way")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    heads, group, dim, n, k = 3, 3, 64, args.length, args.budget
    per_head = torch.rand(1, heads, group, n).softmax(-1)
    keys, values = (torch.randn(1, heads, n + 64, dim)[:, :, :n] for _ in range(2))  # a view of a longer C_f
    store = (torch.empty(1, heads, k + 1, dim), torch.empty(1, heads, k + 1, dim))
    store += (torch.empty(1, heads, k + 1, dtype=torch.long), torch.empty(1, heads, k + 1))
    words = torch.arange(n - 64).unsqueeze(0) // 2
    arguments = (per_head, False, 3, 3, words, None, k, keys, values, *store)
    if not native_selection.refresh_partial(per_head, False, (3, 3), words, None, k, keys, values, store):
        raise SystemExit("the C path is not available here")
    operator = torch.ops.refreshkv.refresh_partial.default
    schema = str(operator._schema).removeprefix("refreshkv::refresh_partial")  # "(Tensor per_head, ...) -> ()"
    mutated = ("key_out", "value_out", "positions", "scores")
    custom = torch.library.custom_op(
        "refreshkv_overhead::refresh_partial", native_selection._refresh, mutates_args=mutated, schema=schema
    )
    ways = {
        "the C through its Python wrapper (eager)": lambda: native_selection._refresh(*arguments),
        "operator on a torch.library.Library (compiled)": lambda: operator(*arguments),
        "operator from torch.library.custom_op (before)": lambda: custom(*arguments),
    }
    times = {name: [] for name in ways}
    with torch.inference_mode():
        for _ in range(args.blocks):
            for name, call in ways.items():
                start = time.perf_counter()
                for _ in range(50):
                    call()
                times[name].append((time.perf_counter() - start) / 50 * 1e6)
    for name, values_us in times.items():
        print(f"{name}: {statistics.median(values_us):.1f} us per call (median of {args.blocks} blocks of 50)")


if __name__ == "__main__":
    main()
