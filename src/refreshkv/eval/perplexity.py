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


def continuation_losses(
    model, context: Sequence[int], continuations: Sequence[Sequence[int]], policy: Policy
) -> list[tuple[list[float], list[bool]]]:
    """Per continuation of one `context`, the losses of its tokens and whether each token is the greedy choice,
    teacher-forced under `policy` with one prefill for all: the context is prefilled once and copied to one decode
    row per continuation (`decode_rows`), each row fed its own tokens; a shorter continuation is padded with its last
    token, and the steps past its end are not read (a row's steps see only the tokens before them)."""
    if not context or not continuations or not all(continuations):
        raise ValueError("continuation_losses needs a context and continuations of at least one token each")
    longest = max(len(tokens) for tokens in continuations)
    forced = torch.tensor(
        [list(tokens) + [tokens[-1]] * (longest - len(tokens)) for tokens in continuations], device=model.device
    )
    ids = torch.as_tensor(list(context), dtype=torch.long, device=model.device)[None]
    out = generate_many(
        model, ids, methods=[policy], forced_tokens=forced, decode_rows=len(continuations), return_logits=True
    )[0]
    logits = torch.stack(out.logits, dim=1)  # (rows, steps, vocab)
    results = []
    for row, tokens in enumerate(continuations):
        scored, targets = logits[row, : len(tokens)], forced[row, : len(tokens)].cpu()
        losses = F.cross_entropy(scored, targets, reduction="none").tolist()
        results.append((losses, (scored.argmax(-1) == targets).tolist()))
    return results


@torch.inference_mode()
def plain_losses(model, input_ids: Sequence[int] | torch.Tensor, target_start: int) -> list[float]:
    """The same losses from one ordinary forward over the whole sequence (no KV method): the reference."""
    ids = torch.as_tensor(input_ids, dtype=torch.long).flatten().to(model.device)
    logits = model(ids[None]).logits[0, target_start - 1 : -1].float()
    return F.cross_entropy(logits, ids[target_start:], reduction="none").tolist()
