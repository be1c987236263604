"""What a refresh costs inside the model, in one process: full steps of `recycled` (stride 2) against `full`'s steps
and against the same `recycled` with its decode-time refreshes skipped, the C call's time per layer, and with
`--overlap` how much of C_p two refreshes share (the same tokens; the same tokens in the same slots: read in Python
around every C call, which then weighs on the full steps' times).

    ATEN_CPU_CAPABILITY=avx2 python benchmarks/perf/refresh_in_model.py --length 8192 --threads 2 [--compile]
    ATEN_CPU_CAPABILITY=avx2 python benchmarks/perf/refresh_in_model.py --length 8192 --threads 2 --overlap

On the embedded model, K = 1024, 48 new tokens; `--rounds` rounds after an untimed first one (which compiles, with
`--compile`). Prints one line per round and method, then the ratios of the median full steps over the timed rounds.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import statistics
import time

import torch

from refreshkv.core import native_library
from refreshkv.measure.bench import bench_prompt
from refreshkv.measure.bench_round import split_steps
from refreshkv.methods.refreshkv import Recycled, SelectionRule
from refreshkv.runtime.generate import generate
from refreshkv.runtime.loading import load_model


class PrefillOnly(SelectionRule):
    """The selection rule at the prompt alone: a later refresh keeps C_p as it is."""

    def refresh(self, layer, *arguments, **options):
        return super().refresh(layer, *arguments, **options) if layer.step == 0 else 0


@dataclasses.dataclass
class WithoutRefreshes(Recycled):
    """`recycled` that fills C_p at prefill and never again: its full steps are attention over C_f alone."""

    def selection_rule(self, layer):
        return PrefillOnly(**dataclasses.asdict(super().selection_rule(layer)))


class Watched:
    """The C library, timing each `refresh_partial` call and noting how C_p's positions change at each refresh."""

    def __init__(self, library, overlap: bool):
        self.library, self.overlap, self.seconds, self.same_slot, self.same_tokens = library, overlap, [], [], []

    def __getattr__(self, name):
        function = getattr(self.library, name)
        return self._refresh if name == "refresh_partial" else function

    def _refresh(self, *arguments):
        positions_pointer, heads, slots, k = arguments[19], arguments[2], arguments[16], arguments[11]
        before = self._positions(positions_pointer, heads * slots).clone() if self.overlap else None
        start = time.perf_counter()
        failed = self.library.refresh_partial(*arguments)
        self.seconds.append(time.perf_counter() - start)
        if before is None:
            return failed
        after = self._positions(positions_pointer, heads * slots)
        if before.max() >= 0:  # not the first fill
            old, new = before.view(heads, slots), after.view(heads, slots)[:, :k]
            self.same_slot.append((old[:, :k] == new).float().mean().item())
            shared = [len(set(o.tolist()) & set(n.tolist())) / k for o, n in zip(old, new)]
            self.same_tokens.append(statistics.fmean(shared))
        return failed

    @staticmethod
    def _positions(pointer: int, count: int) -> torch.Tensor:
        return torch.frombuffer((ctypes.c_int64 * count).from_address(pointer), dtype=torch.long)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds, after an untimed first one")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--overlap", action="store_true", help="how much of C_p two refreshes share (slows them)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    watched = Watched(native_library._library(), args.overlap)
    native_library._library = lambda: watched  # every C call of this process goes through it
    model, tokenizer = load_model()
    ids = bench_prompt(tokenizer, args.length - 48)
    methods = {"full": "full", "recycled@s2": Recycled(budget=1024, stride=2)}
    methods["without refreshes"] = WithoutRefreshes(budget=1024, stride=2)
    steps = {name: [] for name in methods}
    for round in range(args.rounds + 1):
        for name, method in methods.items():
            watched.seconds.clear()
            out = generate(model, ids, method=method, max_new_tokens=48, eos_token_id=[], compile=args.compile)
            layers = [layer.layer_idx for layer in out.cache.method_layers()]
            full, _ = split_steps(out.step_s, out.cache.stats.per_step(out.cache.step, layers), len(layers))
            if round:
                steps[name] += full
            c_call = f", C call {statistics.median(watched.seconds) * 1e6:.0f} us per layer" if watched.seconds else ""
            print(f"round {round} {name}: full step {statistics.median(full) * 1e3:.1f} ms{c_call}", flush=True)
    full_step = statistics.median(steps["full"])
    for name in ("recycled@s2", "without refreshes"):
        print(f"{name}: full step / full's step {statistics.median(steps[name]) / full_step:.3f}")
    if args.overlap:
        print(
            f"between refreshes: {statistics.fmean(watched.same_tokens):.1%} of the kept tokens stay, "
            f"{statistics.fmean(watched.same_slot):.1%} in the same slot"
        )


if __name__ == "__main__":
    main()
