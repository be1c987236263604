"""The checks of what a generation is given, written once for the Python API and the command line.

`generate`, `generate_many` and `PolicyCache` refuse bad input here with one `ValueError` line that names what is
allowed, before any forward pass: token ids (integers within the vocabulary, a (batch, length) tensor), the attention
mask (the ids' shape, 0/1, a real token in every row), counts (integers >= 1) and the sampling settings. The CLI
builds the same `SamplingSettings` before it loads a model, so its options follow the same rules.
"""

from __future__ import annotations

import dataclasses

import torch

from ..core.policy import check_positive, is_number, shorten


def check_model(model, name: str = "model") -> None:
    """A transformers causal language model (what `load_model` gives): a torch module with a config and an input
    embedding. Anything else fails deep inside the first call that reads it."""
    if not (isinstance(model, torch.nn.Module) and hasattr(model, "config") and hasattr(model, "get_input_embeddings")):
        raise ValueError(
            f"{name} must be a transformers causal language model, e.g. the first of refreshkv.load_model(), got "
            f"{type(model).__name__} {shorten(model)}"
        )


def vocabulary_size(model) -> int:
    """Token ids the model's input embedding has rows for."""
    embedding = model.get_input_embeddings()
    return embedding.num_embeddings if embedding is not None else model.config.vocab_size


def check_token_ids(name: str, ids, vocabulary: int) -> None:
    """`ids` is a non-empty (batch, length) integer tensor of ids in [0, vocabulary)."""
    if not isinstance(ids, torch.Tensor):
        lengths = sorted({len(row) for row in ids if hasattr(row, "__len__")}) if isinstance(ids, (list, tuple)) else []
        if len(lengths) > 1:  # rows of a batch decode in step: shorter ones need left padding and a mask
            raise ValueError(
                f"{name} must be a torch tensor of token ids, got prompts of unequal lengths ({lengths[0]} to "
                f"{lengths[-1]} tokens): left-pad them to one length and pass attention_mask (0 at the padding), "
                "e.g. tokenizer(texts, padding=True, padding_side='left', return_tensors='pt')"
            )
        raise ValueError(f"{name} must be a torch tensor of token ids, got {type(ids).__name__}")
    if ids.dtype not in (torch.long, torch.int32):  # what the embedding takes; uint8, int16 fail deep inside it
        raise ValueError(
            f"{name} must hold integer token ids as torch.long (or torch.int32), got {ids.dtype}"
            + ("" if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex() else ": pass ids.long()")
        )
    if ids.ndim != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError(f"{name} must be a non-empty (batch, length) tensor, got shape {tuple(ids.shape)}")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocabulary:
        bad = low if low < 0 else high
        raise ValueError(f"{name} holds token id {bad}; ids must be in [0, {vocabulary}) for this model's vocabulary")


def check_attention_mask(mask, input_ids: torch.Tensor) -> torch.Tensor:
    """The mask (ones where None): the ids' shape, only 0 and 1, at least one real token per row."""
    if mask is None:
        return torch.ones_like(input_ids)
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"attention_mask must be a torch tensor, got {type(mask).__name__}")
    if tuple(mask.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"attention_mask has shape {tuple(mask.shape)}; it must have input_ids' shape {tuple(input_ids.shape)}"
        )
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (real tokens)")
    if not bool(mask.bool().any(dim=-1).all()):
        raise ValueError("every row of attention_mask needs a real token (a row of zeros is an empty prompt)")
    return mask.long()


def check_bool(name: str, value) -> None:
    """True or False, nothing else (a string such as "no" is truthy)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def check_eos(eos_token_id) -> None:
    """None, an int, or a list of ints."""
    ids = eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]
    if eos_token_id is not None and not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"eos_token_id must be a token id >= 0 or a list of them, got {eos_token_id!r}")


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    """How each step picks its token: greedy (`do_sample=False`, no other setting given) or sampled."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self):
        check_bool("do_sample", self.do_sample)
        if not (is_number(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature!r}")
        check_positive("top_k", self.top_k, allow_none=True)
        if self.top_p is not None and not (is_number(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        given = [
            name
            for name, value, default in (
                ("temperature", self.temperature, 1.0),
                ("top_k", self.top_k, None),
                ("top_p", self.top_p, None),
            )
            if value != default
        ]
        if given and not self.do_sample:
            raise ValueError(
                f"{', '.join(given)} apply only when sampling: set do_sample=True (--sample) or leave "
                "them out for greedy decoding"
            )


def check_new_tokens(max_new_tokens) -> None:
    check_positive("max_new_tokens", max_new_tokens)
