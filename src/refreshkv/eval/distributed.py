"""Data-parallel sweeps on an existing launcher: `torchrun --nproc-per-node N -m refreshkv sweep study.yaml`
(or `accelerate launch`, or any launcher that sets RANK / WORLD_SIZE / LOCAL_RANK and MASTER_ADDR / MASTER_PORT).

Each rank takes every N-th example (with all its configurations, so one shared prefill still serves them) and
appends its rows to its own file, `<out stem>.rank<r><suffix>`, under the usual resume rules; a rank skips the
rows already in any of the sweep's files (`out` itself and every rank file), so a sweep can be resumed with another
number of processes. `refreshkv report out.jsonl` reads the rank files beside it. Before anything runs, the ranks
compare their sweeps (the sweep identity, which hashes the whole configuration) and stop with one line if they
differ.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path


class LaunchError(ValueError):
    """A launch whose ranks disagree or whose environment is malformed; one line."""


@dataclasses.dataclass(frozen=True)
class Launch:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_distributed(self) -> bool:
        return self.world > 1


def current_launch(environ=os.environ) -> Launch:
    """The rank of this process as the launcher's environment states it (one process without a launcher)."""
    values = {}
    for name, default in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", None)):
        text = environ.get(name, default if default is not None else environ.get("RANK", "0"))
        if not text.isdigit():
            raise LaunchError(f"environment variable {name}={text!r} must be a non-negative integer")
        values[name] = int(text)
    if not 0 <= values["RANK"] < max(values["WORLD_SIZE"], 1):
        raise LaunchError(f"RANK={values['RANK']} must be below WORLD_SIZE={values['WORLD_SIZE']}")
    return Launch(values["RANK"], max(values["WORLD_SIZE"], 1), values["LOCAL_RANK"])


def rank_file(out: Path, launch: Launch) -> Path:
    """The file this rank appends to: `out` itself for a single process."""
    return out if not launch.is_distributed else out.with_name(f"{out.stem}.rank{launch.rank}{out.suffix}")


def sweep_files(out: Path) -> list[Path]:
    """`out` (if present) and the rank files beside it, i.e. every file a run of this sweep may have written."""
    pattern = re.compile(re.escape(out.stem) + r"\.rank\d+" + re.escape(out.suffix) + "$")
    ranks = sorted(p for p in out.parent.glob(f"{out.stem}.rank*{out.suffix}") if pattern.match(p.name))
    return [p for p in [out, *ranks] if p.is_file()]


def agree(launch: Launch, identity: str, device: str) -> None:
    """Stop (LaunchError, on every rank) unless every rank has the same `identity`."""
    if not launch.is_distributed:
        return
    import torch.distributed as dist

    dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    try:
        identities = [None] * launch.world
        dist.all_gather_object(identities, identity)
    finally:
        dist.destroy_process_group()
    differing = [rank for rank, other in enumerate(identities) if other != identities[0]]
    if differing:
        raise LaunchError(
            f"rank {differing[0]} has {identities[differing[0]]} but rank 0 has {identities[0]}: launch every "
            "rank with the same sweep file and options"
        )


def my_share(index: int, launch: Launch) -> bool:
    """Whether the example at `index` (in the sweep's order) is this rank's."""
    return index % launch.world == launch.rank
