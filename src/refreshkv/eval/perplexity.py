"""Teacher-forced decoding under a KV method: per-token losses of a known continuation.

The method manages its caches exactly as in generation (refreshkv.txt §3, Fig. 3): the context is prefilled once
through a `PolicyCache`, then each true token is fed one step at a time with its explicit position, as the decode
loop of `generate` does; only the token fed is the reference token instead of the model's own choice. The loss of
target token j is the cross-entropy (nats) of the logits computed from tokens < j.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..attention import ATTENTION_NAME
from ..cache import PolicyCache
from ..generate import check_length, synchronize
from ..policy import Policy


@dataclasses.dataclass
class TeacherForced:
    losses: list[float]  # one per target token, in nats
    prefill_s: float
    decode_s: float
    cache: PolicyCache

    @property
    def decode_ms_per_token(self) -> float:
        return 1000 * self.decode_s / self.cache.step if self.cache.step else 0.0


@torch.inference_mode()
def teacher_forced(model, input_ids: Sequence[int] | torch.Tensor, target_start: int, policy: Policy) -> TeacherForced:
    """Losses of `input_ids[target_start:]` given everything before, decoded under `policy` (batch of one)."""
    ids = torch.as_tensor(input_ids, dtype=torch.long).flatten().to(model.device)
    total = ids.shape[0]
    if not 1 <= target_start < total:
        raise ValueError(f"target_start must be in [1, {total - 1}] for {total} tokens, got {target_start}")
    if model.config._attn_implementation != ATTENTION_NAME:
        model.set_attn_implementation(ATTENTION_NAME)
    targets = total - target_start
    check_length(model, target_start, targets - 1)
    cache = PolicyCache(policy, model.config, targets)
    device = ids.device

    start = time.perf_counter()
    logits = model(
        ids[None, :target_start],
        position_ids=torch.arange(target_start, device=device)[None],
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    ).logits[:, -1]
    synchronize(device)
    prefill_s = time.perf_counter() - start

    losses = [F.cross_entropy(logits.float(), ids[target_start : target_start + 1])]
    start = time.perf_counter()
    for position in range(target_start, total - 1):
        logits = model(
            ids[None, position : position + 1],
            position_ids=torch.tensor([[position]], device=device),
            past_key_values=cache,
            use_cache=True,
        ).logits[:, -1]
        losses.append(F.cross_entropy(logits.float(), ids[position + 1 : position + 2]))
    synchronize(device)
    decode_s = time.perf_counter() - start
    return TeacherForced(losses=torch.stack(losses).tolist(), prefill_s=prefill_s, decode_s=decode_s, cache=cache)


@torch.inference_mode()
def plain_losses(model, input_ids: Sequence[int] | torch.Tensor, target_start: int) -> list[float]:
    """The same losses from one ordinary forward over the whole sequence (no KV method): the reference."""
    ids = torch.as_tensor(input_ids, dtype=torch.long).flatten().to(model.device)
    logits = model(ids[None]).logits[0, target_start - 1 : -1].float()
    return F.cross_entropy(logits, ids[target_start:], reduction="none").tolist()
