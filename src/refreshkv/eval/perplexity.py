"""Teacher-forced decoding under a KV method: per-token losses of a known continuation.

The method manages its caches exactly as in generation (refreshkv.txt §3, Fig. 3): the context is prefilled once
through a `PolicyCache`, then each true token is fed one step at a time with its explicit position, as the decode
loop of `generate` does (it is that loop, with `forced_tokens`); the token fed is the reference token instead of the
model's own choice. The loss of
target token j is the cross-entropy (nats) of the logits computed from tokens < j.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..core.policy import Policy
from ..engine.cache import PolicyCache
from ..runtime.generate import generate_many


@dataclasses.dataclass
class TeacherForced:
    losses: list[float]  # one per target token, in nats
    prefill_s: float
    decode_s: float
    cache: PolicyCache
    prefill_shared_by: int = 1

    @property
    def decode_ms_per_token(self) -> float:
        return 1000 * self.decode_s / self.cache.step if self.cache.step else 0.0


def teacher_forced(model, input_ids: Sequence[int] | torch.Tensor, target_start: int, policy: Policy) -> TeacherForced:
    """Losses of `input_ids[target_start:]` given everything before, decoded under `policy` (batch of one)."""
    return teacher_forced_many(model, input_ids, target_start, [policy])[0]


def teacher_forced_many(
    model, input_ids: Sequence[int] | torch.Tensor, target_start: int, policies: Sequence[Policy]
) -> list[TeacherForced]:
    """`teacher_forced` under several methods with one shared prefill (`generate_many`)."""
    ids = torch.as_tensor(input_ids, dtype=torch.long).flatten().to(model.device)
    total = ids.shape[0]
    if not 1 <= target_start < total:
        raise ValueError(f"target_start must be in [1, {total - 1}] for {total} tokens, got {target_start}")
    targets = ids[None, target_start:]
    outs = generate_many(model, ids[None, :target_start], methods=policies, forced_tokens=targets, return_logits=True)
    return [
        TeacherForced(
            losses=F.cross_entropy(torch.cat(out.logits), targets[0].cpu(), reduction="none").tolist(),
            prefill_s=out.prefill_s,
            decode_s=out.decode_s,
            cache=out.cache,
            prefill_shared_by=out.prefill_shared_by,
        )
        for out in outs
    ]


@torch.inference_mode()
def plain_losses(model, input_ids: Sequence[int] | torch.Tensor, target_start: int) -> list[float]:
    """The same losses from one ordinary forward over the whole sequence (no KV method): the reference."""
    ids = torch.as_tensor(input_ids, dtype=torch.long).flatten().to(model.device)
    logits = model(ids[None]).logits[0, target_start - 1 : -1].float()
    return F.cross_entropy(logits, ids[target_start:], reduction="none").tolist()
