"""The opt-in compiled decode step: `generate(..., compile=True)`, `refreshkv generate/bench --compile`.

The model's forward is compiled whole (`torch.compile(fullgraph=True)`) and used for decode steps; the prompt
runs eagerly (its length changes with every prompt, and it runs once). The graphs are kept by dynamo per code object,
so every generation of a process reuses those whose guards still hold (new ones appear with new methods or prompt
lengths). What lets a step compile whole, for every registered method (tests/test_method_contract.py
compiles each with fullgraph and compares it with eager):
- the per-step integers (decode step, tokens seen, store lengths) are plain Python ints that dynamo makes symbolic
  after the second step (one recompile), so the full cache's growing length is a dynamic shape, not a recompile;
- a schedule's test on the step count (`recycled`'s stride, `refreshkv`'s QC steps) is a branch, which dynamo turns
  into a guard: each side is its own graph, picked on the host without reading the device;
- statistics are accumulated in device tensors (engine/decode_stats.py), scalars written into tensors are
  tensors, and `refreshkv`'s per-row decision at QC steps is applied with `torch.where` instead of read on the host;
- on the CPU, one query's float32 attention (core/native_selection.py `attend_rows`) and the packed weights'
  products (packed_linear.py) are operators of their own, which the compiler calls as they are: its own products
  and softmax over an eviction store took 3x the C's time at 8 rows; an eviction store's new token is written by
  `index_put_`, which the compiler writes in place, where a `scatter_` made it copy the whole store every step.
A step at which a method decides from device values (`Policy.decides_on_host`: `refreshkv`'s QC steps) runs eagerly
where reading them costs nothing (`HOST_READS_FREE`: the CPU), so that it computes only the path each layer takes:
compiled, a QC step computes the partial and the full path at every layer (2-3x `full`'s step on the CPU).
Each new graph (the first steps, the first full step of a schedule) costs a compilation: on the embedded model with 2
CPU threads about 1 minute for `full` and 4-6 for `recycled`, for a step 0-22% faster than eager depending on the
dtype, the weight layout and the run (9-17% with packed weights at 8K; docs/benchmark.md).
"""

from __future__ import annotations

import torch

_works: list[str] = []  # why compiling failed on this machine ("" = it works), checked once per process
HOST_READS_FREE = ("cpu",)  # device types where the host reads a device value without waiting for queued work
RECOMPILE_LIMIT = 64  # graphs per compiled forward: a sweep meets new guards with new prompt lengths and methods


class CompileUnavailable(ValueError):
    """torch.compile cannot run here; the message is one line saying why and how to run without it."""


def check_compile_works() -> None:
    """Compile a tiny function once per process; raise CompileUnavailable (one line) if the compiler fails (no C++
    compiler, an unsupported platform or Python version)."""
    if not _works:
        try:
            torch.compile(lambda x: (x * 2).sum(), fullgraph=True)(torch.ones(4))
            _works.append("")
        except Exception as error:  # any failure of the toolchain: report it in one line
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            _works.append(f"{type(error).__name__}: {reason}"[:200])
    if _works[0]:
        raise CompileUnavailable(
            f"torch.compile does not work on this machine ({_works[0]}); run without --compile "
            "(compile=False, the default)"
        )


def compiled_forward(model):
    """The model's forward compiled whole, for decode steps. Past dynamo's limit of graphs for it, a call raises
    CompileUnavailable (one line) instead of dynamo's traceback."""
    check_compile_works()
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    compiled = torch.compile(model.forward, fullgraph=True)

    def forward(*args, **kwargs):
        try:
            return compiled(*args, **kwargs)
        except torch._dynamo.exc.FailOnRecompileLimitHit as error:
            raise CompileUnavailable(
                f"torch.compile reached its limit of {torch._dynamo.config.recompile_limit} graphs for the model's "
                "decode step (each new method, prompt length or schedule compiles its own); run fewer methods or "
                "lengths per process, or without --compile"
            ) from error

    return forward


def runs_eagerly(policy, step: int, device: torch.device) -> bool:
    """Whether decode step `step` of a compiled generation runs eagerly (see the module doc)."""
    return device.type in HOST_READS_FREE and policy.decides_on_host(step)
