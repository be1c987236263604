"""Undoing rotary position embeddings, for methods that compare queries by content rather than by position.

RoPE rotates each pair of dimensions (i, i + D/2) by position * inv_freq[i]; the rotation is the same for every
head at a position, so it commutes with averaging over heads, and a rotation by minus that angle gives the query
before RoPE (up to the constant factor some RoPE variants apply, which no cosine similarity sees).
"""

from __future__ import annotations

import torch


def inverse_frequencies(model_or_config) -> torch.Tensor | None:
    """The model's RoPE inverse frequencies (D/2,): its rotary module's buffer, or from the config for plain RoPE."""
    if hasattr(model_or_config, "modules"):
        for module in model_or_config.modules():
            if isinstance(getattr(module, "inv_freq", None), torch.Tensor):
                return module.inv_freq.float()
        model_or_config = model_or_config.config
    config = model_or_config.get_text_config() if hasattr(model_or_config, "get_text_config") else model_or_config
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default" or "rope_theta" not in rope:
        return None
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 1.0 / rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)


def unrotate(vectors: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """(B, D) vectors rotated at `positions` (B,) -> the same vectors before RoPE."""
    angles = positions.float()[:, None] * inv_freq.to(vectors.device)[None]  # (B, D/2)
    cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
    first, second = vectors.float().chunk(2, dim=-1)
    rotated_half = torch.cat([-second, first], dim=-1)
    return vectors.float() * cos - rotated_half * sin
