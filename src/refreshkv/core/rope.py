"""Undoing rotary position embeddings, for methods that compare queries by content rather than by position.

RoPE rotates each pair of dimensions (i, i + D/2) by position * inv_freq[i]; the rotation is the same for every
head at a position, so it commutes with averaging over heads, and a rotation by minus that angle gives the query
before RoPE (up to the constant factor some RoPE variants apply, which no cosine similarity sees).
"""

from __future__ import annotations

import torch


def inverse_frequencies(model_or_config, layer_type: str | None = None) -> torch.Tensor | None:
    """The RoPE inverse frequencies (D/2,) of a layer type: the rotary module's buffer (`inv_freq`, or
    `<layer_type>_inv_freq` where layer types rotate differently, as Gemma 3's local and global layers), else from the
    config for plain RoPE. None when neither says, or when RoPE turns only part of the head (partial rotary)."""
    config = model_or_config.config if hasattr(model_or_config, "modules") else model_or_config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    found = None
    if hasattr(model_or_config, "modules"):
        names = ([f"{layer_type}_inv_freq"] if layer_type else []) + ["inv_freq"]
        buffers = (getattr(module, name, None) for name in names for module in model_or_config.modules())
        found = next((buffer.float() for buffer in buffers if isinstance(buffer, torch.Tensor)), None)
    if found is None:
        rope = getattr(config, "rope_parameters", None) or {}
        rope = rope.get(layer_type, rope) if layer_type else rope  # per layer type (Gemma 3) or one for all
        if rope.get("rope_type", "default") == "default" and "rope_theta" in rope:
            found = 1.0 / rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    return found if found is not None and 2 * found.numel() == dim else None


def unrotate(vectors: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """(B, D) vectors rotated at `positions` (B,) -> the same vectors before RoPE."""
    angles = positions.float()[:, None] * inv_freq.to(vectors.device)[None]  # (B, D/2)
    cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
    first, second = vectors.float().chunk(2, dim=-1)
    rotated_half = torch.cat([-second, first], dim=-1)
    return vectors.float() * cos - rotated_half * sin


def rotate_by(vectors: torch.Tensor, steps: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Vectors (..., D) already rotated at some positions, rotated `steps` positions further (RoPE's rotations add:
    R(p + s) = R(s) R(p)), in float32."""
    angles = steps * inv_freq.to(vectors.device).float()  # (D/2,)
    cos, sin = angles.cos().repeat(2), angles.sin().repeat(2)
    first, second = vectors.float().chunk(2, dim=-1)
    rotated_half = torch.cat([-second, first], dim=-1)
    return vectors.float() * cos + rotated_half * sin
