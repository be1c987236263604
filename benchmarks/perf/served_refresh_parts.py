"""Where a served decode step's time goes inside vLLM: the plugin's attention layers, the C calls inside them and the
host work around those, against the rest of the model, for steps where the batch refreshes and steps where it
does not, beside vLLM's own attention on the same batch.

    VLLM_CPU_KVCACHE_SPACE=8 python benchmarks/perf/served_refresh_parts.py --batch 16 --method recycled   # vLLM's venv

(vLLM's default KV space does not hold 16 prompts of 8K tokens: the engine would run fewer of them at a time.)

One in-process engine (as `vllm_serving.py`'s) prefills `--batch` prompts of `--length` tokens (book passages) once,
untimed; then vLLM's own attention and the method each decode `--new-tokens` tokens for them (found in the prefix
cache). Every engine step is timed, and inside it the plugin's attention layers (`RefreshKVImpl.forward`, which runs
vLLM's own kernel for the rows it does not serve) and each C call of the plugin (timed around the library's
functions). A step is a refresh where at least half of its request-layer steps read the whole cache. Prints, per
kind of step, the median step and its parts in ms: the rest of the model (the step less the attention layers), the C
calls by name, and host work (the plugin's layers less their C calls, the timers' own microsecond a call in it);
for vLLM's own, its attention layers.
"""

import argparse
import collections
import os
import statistics
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: its layers timed here

from call_timer import timed_call  # noqa: E402
from vllm_serving import book_tokens, serving_engine  # noqa: E402

from refreshkv.core import native_attention, native_selection  # noqa: E402
from refreshkv.serving import vllm_backend  # noqa: E402
from refreshkv.serving.vllm_rows import COUNTS  # noqa: E402
from refreshkv.serving.wall_clock import timed_run  # noqa: E402

spent: dict[str, float] = collections.defaultdict(float)  # seconds per part, summed since the start


class TimedKernels:
    """The C library, each of its functions timed under its own name."""

    def __init__(self, library):
        self.library = library

    def __getattr__(self, name: str):
        return timed_call(getattr(self.library, name), "C " + name, spent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=8056)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--method", default="recycled")
    parser.add_argument("--new-tokens", type=int, default=41)
    args = parser.parse_args()
    engine = serving_engine(args.length + args.new_tokens + 8, args.batch)
    kernels = TimedKernels(native_attention.kernels())
    native_attention.kernels = native_selection.kernels = lambda: kernels
    layers = vllm_backend.RefreshKVImpl
    layers.forward = timed_call(layers.forward, "attention layers", spent)
    steps: list[tuple[float, float, dict[str, float]]] = []  # (seconds, share of full request-layers, parts)
    engine_step = engine.step

    def step():
        before, full, layer_steps = dict(spent), COUNTS.full_layer_steps, COUNTS.layer_steps
        start = time.perf_counter()
        outputs = engine_step()
        seconds = time.perf_counter() - start
        taken = COUNTS.layer_steps - layer_steps
        share = (COUNTS.full_layer_steps - full) / taken if taken else 1.0
        steps.append((seconds, share, {name: total - before.get(name, 0.0) for name, total in spent.items()}))
        return outputs

    engine.step = step
    book = book_tokens(engine.get_tokenizer())
    rows = [book[(args.length + 7) * i : (args.length + 7) * i + args.length] for i in range(args.batch)]
    settings = {"method": args.method, "budget": args.budget}
    timed_run(engine, rows, settings, 2, "prefill")  # untimed: every later run finds the prompts in the prefix cache
    print(f"{args.batch} requests of {args.length} tokens, K = {args.budget}, ms per step (median)")
    for label, run_settings in (("vLLM's own", {"method": "full"}), (args.method, settings)):
        steps.clear()
        run = timed_run(engine, rows, run_settings, args.new_tokens, label)
        decode = steps[len(run.prefill_step_seconds) :]
        if run_settings["method"] == "full":
            kinds = {"all": decode}
        else:
            kinds = {"refresh": [s for s in decode if s[1] >= 0.5], "other": [s for s in decode if s[1] < 0.5]}
        for kind, chosen in kinds.items():
            if chosen:
                own = run_settings["method"] == "full"
                print(f"{label}, {kind} steps ({len(chosen)}): " + ", ".join(step_parts(chosen, own)))


def step_parts(chosen: list[tuple[float, float, dict[str, float]]], own: bool) -> list[str]:
    """The median step of `chosen` and the median of each part, in ms (`own`: vLLM's own attention's steps)."""
    step_ms = statistics.median(1e3 * seconds for seconds, _, _ in chosen)
    names = sorted({name for _, _, parts in chosen for name in parts})
    part_ms = {name: statistics.median(1e3 * parts.get(name, 0.0) for _, _, parts in chosen) for name in names}
    layers_ms = part_ms.pop("attention layers", 0.0)
    shown = [f"step {step_ms:.0f} (max {1e3 * max(chosen)[0]:.0f})", f"rest of the model {step_ms - layers_ms:.0f}"]
    if own:
        return shown + [f"vLLM's attention {layers_ms:.0f}"]
    shown += [f"{name} {ms:.0f}" for name, ms in sorted(part_ms.items(), key=lambda item: -item[1]) if ms >= 1]
    return shown + [f"host {layers_ms - sum(part_ms.values()):.0f}"]


if __name__ == "__main__":
    main()
