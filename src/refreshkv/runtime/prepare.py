"""What every command does before it works: check the runtime options, then load the model with them.

`check_runtime` refuses bad options (dtype, device, weight layout, a compiler that does not work) in one line before
anything loads; `load_checked` then sets torch's CPU threads, loads the model and stores its weights in the layout
asked for. The CLI's commands (generate, demo, bench, profile, eval, sweep, train) all go through these two.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable

import torch

from ..core.policy import Policy, check_budget_fits
from .compiled import check_compile_works
from .models import named_context
from .packed_linear import packing_problem
from .weight_layout import check_weight_layout, set_weight_layout

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEVICES = ("cpu", "cuda")


@dataclasses.dataclass(frozen=True)
class Runtime:
    """Checked runtime options: the torch dtype, the device, compiled decode steps, weight layout, CPU threads."""

    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    compile: bool = False
    weight_layout: str = "stored"
    threads: int | None = None


def check_runtime(
    dtype: str = "float32",
    device: str = "cpu",
    compile: bool = False,
    weight_layout: str = "stored",
    threads: int | None = None,
) -> Runtime:
    """The options checked: the dtype known, the device present here, the weight layout known, torch.compile
    working (if asked), CPU threads no more than the cores this process may run on (more only make the threads
    wait for each other, and thousands of them brought a machine to a halt)."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype '{dtype}'; choose from: {', '.join(DTYPES)}")
    if device not in DEVICES:
        raise ValueError(f"unknown device '{device}'; choose from: {', '.join(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA GPU is available")
    check_weight_layout(weight_layout)
    if weight_layout == "packed" and (problem := packing_problem(device, DTYPES[dtype])) is not None:
        raise ValueError(problem)
    if threads is not None and not 1 <= threads <= usable_cores():
        raise ValueError(f"threads must be 1 to {usable_cores()} (the CPU cores this process may use), got {threads}")
    if compile:
        check_compile_works()
    return Runtime(DTYPES[dtype], device, compile, weight_layout, threads)


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity where the system has one, else all of them)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def load_checked(model, runtime: Runtime, policies: Iterable[Policy] = ()):
    """(model, tokenizer, layout) for checked options: torch's CPU threads set, the model loaded (`model`: a name,
    a folder or a .gguf; None = the default), its weights stored in the runtime's layout (`layout`: the choices
    `set_weight_layout` made, None for the stored layout). The `policies` the command will run are held to the
    model's context (`check_budget_fits`): a named model's before it loads, any other's once it has."""
    from .loading import load_model

    policies = list(policies)
    for policy in policies:
        check_budget_fits(policy, named_context(model))
    if runtime.threads is not None:
        torch.set_num_threads(runtime.threads)
    lm, tokenizer = load_model(model, dtype=runtime.dtype, device=runtime.device)
    for policy in policies:
        check_budget_fits(policy, lm.config.max_position_embeddings)
    return lm, tokenizer, set_weight_layout(lm, runtime.weight_layout)
