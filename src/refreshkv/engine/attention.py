"""The attention function registered with transformers under the name "refreshkv".

With a `PolicyCache`, each layer's attention is computed by the cache's method (see cache.py; the layer comes by
handoff.py). A forward given a training pattern by keyword (`partial_pattern=`, train/pattern.py) attends with that
pattern. Otherwise (plain forward, `use_cache=False`, another cache class) it is exactly transformers' SDPA attention,
and masks are built as for SDPA, so a model loaded with this implementation behaves like an SDPA model everywhere
else.
"""

from __future__ import annotations

from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..core.attention_math import SoftCapped, prompt_attention
from .handoff import ATTENTION_NAME, take_handoff

PATTERN_ARGUMENT = "partial_pattern"  # model(..., partial_pattern=PartialPattern(...)) reaches every layer's attention
TRAINING_UNSUPPORTED = (
    "the RefreshKV training pattern needs attention layers without soft-capping and without a "
    "sliding window shorter than L + S"
)


def policy_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    pattern = kwargs.pop(PATTERN_ARGUMENT, None)
    if pattern is not None:
        window = kwargs.get("sliding_window")
        if (window is not None and window < key.shape[2]) or kwargs.get("softcap") is not None:
            raise ValueError(TRAINING_UNSUPPORTED)
        return pattern.attend(query, key, value, query.shape[-1] ** -0.5 if scaling is None else scaling), None
    layer = take_handoff(key)
    softcap = kwargs.get("softcap")
    if layer is None and softcap is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if softcap is not None:  # Gemma 2: SDPA cannot soft-cap, attention_math's explicit path does
        scaling = SoftCapped(scaling, softcap)
    if layer is None:
        return prompt_attention(query, key, value, attention_mask, scaling), None
    return layer.attend(module, query, key, value, attention_mask, scaling, kwargs.get("sliding_window")), None


AttentionInterface.register(ATTENTION_NAME, policy_attention)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
