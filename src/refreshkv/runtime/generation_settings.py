"""What a generation takes besides the model, the prompt and the methods (`GenerationSettings`, checked when made),
and what the decode loop reads of it (`DecodeSettings`); the decode loop itself is generate.py."""

from __future__ import annotations

import dataclasses

import torch

from ..core.policy import check_positive, shorten
from .inputs import SamplingSettings, check_bool, check_eos


def default_eos_check_every(device: torch.device) -> int:
    """Every step on the CPU, where reading a tensor costs nothing; elsewhere every 8 steps (a guess: it makes the
    host wait for the device once per 8 steps, and costs at most 7 steps after the last row ends; not measured, no
    GPU was available to this project)."""
    return 1 if device.type == "cpu" else 8


@dataclasses.dataclass(frozen=True)
class DecodeSettings(SamplingSettings):
    """How each step picks its token (checked by `SamplingSettings`), how often the loop checks whether every row
    has ended, and whether decode steps are compiled."""

    eos_check_every: int = 1
    compile: bool = False

    def __post_init__(self):
        super().__post_init__()
        check_positive("eos_check_every", self.eos_check_every)
        check_bool("compile", self.compile)


@dataclasses.dataclass(frozen=True)
class GenerationSettings(SamplingSettings):
    """What `generate` and `generate_many` take besides the model, the prompt and the methods, checked when made:
    `settings=GenerationSettings(max_new_tokens=32, do_sample=True, seed=0)`, or the same names as keywords, which
    override the settings' (`generate(model, ids, max_new_tokens=32)`).

    `max_new_tokens`; sampling (`do_sample`, `temperature`, `top_k`, `top_p`, `seed`: `SamplingSettings`);
    `eos_token_id` (None: the model's generation config); `return_logits` (each step's (B, vocab) logits);
    `progress` (a progress bar per decode).
    `forced_tokens` (B, N): the loop feeds those tokens instead of its own choices (teacher forcing, for perplexity):
    N steps, no end-of-sequence stop; the method manages its caches exactly as in generation.
    `eos_check_every` N: stop when every row has ended, checked every N steps (reading the check makes the host wait
    for the device; None: `default_eos_check_every`). The tokens returned do not depend on N: a row's tokens after its
    end-of-sequence token are dropped; only the steps decoded (and their statistics) do.
    `compile=True`: decode steps run the model's forward under torch.compile (compiled.py); greedy tokens equal the
    eager ones, the first steps (and a schedule's first full step) pay for compilation.
    `prefill_rows` N: prefill at most N rows per forward (`prefill_in_groups`), for a batch whose one prefill would
    not fit in memory; decoding is the same one batched step, and the methods still share each group's forward.
    """

    max_new_tokens: int = 64
    eos_token_id: int | list[int] | None = None
    return_logits: bool = False
    progress: bool = False
    forced_tokens: torch.Tensor | None = None
    eos_check_every: int | None = None
    compile: bool = False
    prefill_rows: int | None = None
    decode_rows: int | None = None

    def __post_init__(self):
        super().__post_init__()
        for name in ("return_logits", "progress", "compile"):
            check_bool(name, getattr(self, name))
        check_positive("max_new_tokens", self.max_new_tokens)
        check_eos(self.eos_token_id)
        for name in ("eos_check_every", "prefill_rows", "decode_rows"):
            check_positive(name, getattr(self, name), allow_none=True)
        if self.forced_tokens is not None and not isinstance(self.forced_tokens, torch.Tensor):
            raise ValueError(
                f"forced_tokens must be a (batch, N) torch tensor of token ids, got {type(self.forced_tokens).__name__}"
            )

    @classmethod
    def of(cls, settings: GenerationSettings | None = None, **keywords) -> GenerationSettings:
        """`settings` (None: the defaults) with `keywords` in place of its fields; an unknown name is a TypeError,
        settings of another type a ValueError, each one line naming what is allowed."""
        if settings is not None and not isinstance(settings, GenerationSettings):
            raise ValueError(
                f"settings must be a GenerationSettings, e.g. settings=GenerationSettings(max_new_tokens=32), or "
                f"None with the same names as keywords (max_new_tokens=32), got {type(settings).__name__} "
                f"{shorten(settings)}"
            )
        unknown = sorted(set(keywords) - SETTINGS)
        if unknown:
            raise TypeError(
                f"unknown setting {', '.join(unknown)}; the settings: {', '.join(sorted(SETTINGS))} (a method's "
                "parameters go to its method: make_policy(name, budget=...))"
            )
        return dataclasses.replace(settings if settings is not None else cls(), **keywords)

    def decoding(self, device: torch.device) -> DecodeSettings:
        """What the decode loop reads: the sampling, the end-of-sequence check (per device by default), compile."""
        every = default_eos_check_every(device) if self.eos_check_every is None else self.eos_check_every
        return DecodeSettings(self.do_sample, self.temperature, self.top_k, self.top_p, self.seed, every, self.compile)


SETTINGS = frozenset(field.name for field in dataclasses.fields(GenerationSettings))
