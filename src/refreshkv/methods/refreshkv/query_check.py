"""`refreshkv`'s query check (the dynamic schedule, policy.py): every `qc_stride` steps a layer compares the
head-averaged query of its newest token, before RoPE by default (`compared_query`), with the one of its last full
step, and attends fully where the cosine similarity is below the model family's threshold (`default_threshold`)."""

from __future__ import annotations

import torch
from torch import Tensor

from ...core.policy import PolicyError
from ...core.rope import unrotate
from .partial_cache import RefreshLayer

DEFAULT_QC_STRIDE = 10
LLAMA_THRESHOLD = 0.85  # A.4: chosen for Llama-3.1-8B; used for every family without a value of its own
# A.4: 0.95 chosen for Qwen2-7B. Gemma 3 (not in the paper), chosen here as A.4 chose, per family: its normalized
# queries stay closer to the last full step's, and at 0.85 a global layer kept reading its prefill selection while a
# number was read (docs/failure-analysis.md); 0.9 kept perplexity at 16K level and cost 1% per token at 8K.
FAMILY_THRESHOLDS = {"qwen2": 0.95, "gemma3_text": 0.9}
QUERY_SPACES = ("pre_rope", "post_rope")


def default_threshold(model_type: str) -> float:
    return FAMILY_THRESHOLDS.get(model_type, LLAMA_THRESHOLD)


def compared_query(layer: RefreshLayer, query: Tensor, space: str, width: int = 1) -> Tensor:
    """(B, D) head-averaged query of the newest token, before RoPE with `space="pre_rope"`; with `width` > 1 the
    mean of the last `width` tokens' (each before RoPE; a short row's left pads left out)."""
    heads = layer.mean_over_heads(query[:, :, -width:])  # (B, width, D), over every head on every TP rank
    if space == "post_rope":
        return heads[:, -1]
    inv_freq = layer.rope_inv_freq
    if inv_freq is None:
        raise PolicyError(
            "query='pre_rope' needs a model with plain RoPE (or give the model to PolicyCache); use query='post_rope'"
        )
    newest = layer.positions(query.device)
    if heads.shape[1] == 1:
        return unrotate(heads[:, 0], newest, inv_freq)
    offsets = torch.arange(heads.shape[1] - 1, -1, -1, device=query.device)
    positions = (newest.view(-1, 1) - offsets).expand(heads.shape[:2])
    unrotated = unrotate(heads.flatten(0, 1), positions.flatten(), inv_freq).view(heads.shape)
    real = (positions >= 0).unsqueeze(-1)
    return (unrotated * real).sum(dim=1) / real.sum(dim=1).clamp(min=1)
