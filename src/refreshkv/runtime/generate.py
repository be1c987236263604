"""The decode loop: prefill the prompt once, then one token per step through the method's cache.

`generate` runs one method; `generate_many` runs several on the same prompt with one shared prefill
(engine/shared_prefill.py). Both are `prefill` followed by `decode`, the loop below.

Rows of a batch are left-padded; each row gets its own positions (0 at its first real token), so a row's output
equals running it alone (for greedy decoding; sampling draws from one generator for the whole batch).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from ..core.policy import Policy, check_method_given, check_positive, make_policy, policy_of
from ..engine.cache import PolicyCache
from ..engine.cache_argument import with_cache
from ..engine.join_rows import join_caches
from ..engine.shared_prefill import SharedPrefill
from .compiled import check_compile_works, compiled_forward, runs_eagerly
from .fidelity import fidelity as fidelity_to
from .generation_settings import SETTINGS, DecodeSettings, GenerationSettings
from .inputs import (
    check_attention_mask,
    check_bool,
    check_eos,
    check_model,
    check_new_tokens,
    check_token_ids,
    vocabulary_size,
)


@dataclasses.dataclass
class GenerationOutput:
    tokens: list[list[int]]  # new tokens per row, up to and including the end-of-sequence token
    prompt_tokens: list[int]
    prefill_s: float
    decode_s: float
    decode_steps: int
    cache: PolicyCache
    step_s: list[float] = dataclasses.field(default_factory=list)  # wall time of each decode forward
    logits: list[torch.Tensor] | None = None  # per step (B, vocab), if asked for
    prefill_shared_by: int = 1  # methods prefilled by the same forward pass (generate_many)
    fidelity: dict | None = None  # to the first method's answer (`generate_many(..., fidelity=True)`; fidelity.py)

    @property
    def decode_ms_per_token(self) -> float:
        return 1000 * self.decode_s / self.decode_steps if self.decode_steps else 0.0

    def stats(self) -> dict:
        """The numbers `refreshkv generate --json` reports (sizes in bytes, summed over layers)."""
        per_layer = self.cache.nbytes_per_layer()
        return {
            "new_tokens": [len(t) for t in self.tokens],
            "prompt_tokens": self.prompt_tokens,
            "prefill_s": round(self.prefill_s, 4),
            "prefill_shared_by": self.prefill_shared_by,
            "decode_ms_per_token": round(self.decode_ms_per_token, 3),
            "full_step_fraction": round(self.cache.full_step_fraction(), 4),
            "kv_bytes_full": sum(per_layer),
            "kv_bytes_per_layer": per_layer,
            "kv_bytes_by_device": self.cache.nbytes_by_device(),
            "kv_bytes_attended_mean": round(self.cache.attended_bytes_mean()),
            "budget": self.cache.budget,
        }


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer:
    """Wall time of each decode forward without making the host wait for the device at each step: CUDA events,
    read once at the end; the host clock on the CPU, where a forward has finished when it returns."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """Seconds between marks 0 and 1, 2 and 3, ..."""
        starts, ends = self.marks[0::2], self.marks[1::2]
        if self.cuda:
            torch.cuda.synchronize()
            return [start.elapsed_time(end) / 1000 for start, end in zip(starts, ends)]
        return [end - start for start, end in zip(starts, ends)]


def _next_token(logits, settings: DecodeSettings, generator) -> torch.Tensor:
    if not settings.do_sample:
        return logits.argmax(dim=-1)
    logits = logits.float() / settings.temperature
    if settings.top_k is not None:
        kth = logits.topk(min(settings.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if settings.top_p is not None:
        ordered, order = logits.sort(dim=-1, descending=True)
        drop = (
            ordered.softmax(-1).cumsum(-1) - ordered.softmax(-1) > settings.top_p
        )  # keep the token that crosses top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


def check_length(model, prompt_length: int, max_new_tokens: int) -> None:
    config = model.config
    total = prompt_length + max_new_tokens
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and total > limit:
        raise ValueError(
            f"prompt ({prompt_length} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context of "
            f"{limit} tokens"
        )


@torch.inference_mode()
def generate(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    method: str | Policy = "full",
    settings: GenerationSettings | None = None,
    **keywords,
) -> GenerationOutput:
    """Generate with a KV method, e.g. `generate(model, ids, method="refreshkv", budget=1024, max_new_tokens=32)`, or a
    method object (`method=make_policy("refreshkv", budget=1024)`), which takes no parameters beside it (PolicyError).

    `keywords`: the fields of `GenerationSettings` (overriding `settings`'s) and the method's parameters.
    """
    check_model(model)
    policy = policy_of(method, **{name: value for name, value in keywords.items() if name not in SETTINGS})
    given = {name: value for name, value in keywords.items() if name in SETTINGS}
    return generate_many(model, input_ids, attention_mask, methods=[policy], settings=settings, **given)[0]


@torch.inference_mode()
def generate_many(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    methods: Sequence[str | Policy],
    fidelity: bool = False,
    settings: GenerationSettings | None = None,
    **keywords,
) -> list[GenerationOutput]:
    """`generate` under several methods for the price of one prefill, e.g.
    `generate_many(model, ids, methods=["full", "snapkv", make_policy("refreshkv", qc_stride=5)])`; `settings` and
    `keywords` as for `generate` (`GenerationSettings`).

    The methods that share their prefill (all built-in ones) are prefilled by one forward pass; each then decodes
    on its own, so every output equals what `generate` gives for that method alone (sampling included: each decode
    draws from its own generator seeded with `seed`). Their caches exist together: memory grows with the number of
    methods. A method that computes its own prefill (`shares_prefill = False`) is prefilled alone.

    `fidelity=True` (greedy, one row): every method after the first also gets a second cache, prefilled by the same
    forward, that is fed the first method's answer (teacher forcing); its output's `fidelity` compares the two
    next-token distributions step by step (runtime/fidelity.py). The first method is the reference, named in the
    KL's key (`kl_to_full` where it is `full`).
    """
    check_model(model)
    settings = GenerationSettings.of(settings, **keywords)
    max_new_tokens, eos_token_id, forced_tokens = settings.max_new_tokens, settings.eos_token_id, settings.forced_tokens
    if isinstance(methods, (str, Policy)) or not isinstance(methods, Sequence):
        raise ValueError(
            f"methods must be a list of methods, e.g. methods=['full', 'snapkv'], got {type(methods).__name__} "
            f"{methods!r}"[:200]
        )
    if not methods:
        raise ValueError("methods must name at least one method")
    check_bool("fidelity", fidelity)
    for index, method in enumerate(methods):
        check_method_given(f"methods[{index}]", method)
    policies = [m if isinstance(m, Policy) else make_policy(m) for m in methods]
    vocabulary = vocabulary_size(model)
    check_token_ids("input_ids", input_ids, vocabulary)
    if settings.do_sample and settings.top_k is not None and settings.top_k > vocabulary:
        warnings.warn(
            f"top_k {settings.top_k} is above the vocabulary: samples from all {vocabulary} tokens", stacklevel=3
        )
    if forced_tokens is not None:
        check_token_ids("forced_tokens", forced_tokens, vocabulary)
        max_new_tokens, eos_token_id = forced_tokens.shape[1], []
    check_new_tokens(max_new_tokens)
    check_positive("prefill_rows", settings.prefill_rows, allow_none=True)
    decode_rows = check_decode_rows(settings.decode_rows, input_ids.shape[0])
    decoding = settings.decoding(input_ids.device)
    attention_mask = check_attention_mask(attention_mask, input_ids)
    check_length(model, int(attention_mask.sum(-1).max()), max_new_tokens)
    check_eos(eos_token_id)
    if eos_token_id is None:
        eos_token_id = model.generation_config.eos_token_id
    eos = torch.tensor([] if eos_token_id is None else eos_token_id, device=input_ids.device).flatten()
    if settings.compile:
        check_compile_works()

    if fidelity and (settings.do_sample or forced_tokens is not None or decode_rows != 1 or len(policies) < 2):
        raise ValueError(
            "fidelity compares greedy answers of one prompt (a batch of 1) with the first method's: "
            "give two methods or more, no sampling, no forced tokens"
        )
    caches = [PolicyCache(policy, model, max_new_tokens) for policy in policies]
    followers = [PolicyCache(policy, model, max_new_tokens) for policy in policies[1:]] if fidelity else []
    shared = [cache for cache in caches + followers if cache.policy.shares_prefill]
    groups = [shared] if len(shared) > 1 else []  # a lone method prefills through its own cache, as in `generate`
    groups += [[cache] for cache in caches + followers if not (len(shared) > 1 and cache.policy.shares_prefill)]
    follows = dict(zip(map(id, followers), caches[1:]))  # a follower cache -> the method's own cache
    groups.sort(key=lambda group: caches[0] not in group)  # the reference answers before anyone follows it
    outputs: dict[int, GenerationOutput] = {}  # by id of the cache
    for group in groups:
        logits, prefill_s = prefill_in_groups(model, input_ids, attention_mask, group, settings.prefill_rows)
        logits, mask, repeat_s = repeat_rows(group, logits, attention_mask, decode_rows)
        prefill_s += repeat_s
        for cache in group:
            if id(cache) in follows:  # fed the reference's answer, compared with it, then dropped
                reference = outputs[id(caches[0])]
                forced = torch.tensor(reference.tokens, device=input_ids.device)
                out = decode(
                    model,
                    cache,
                    logits,
                    mask,
                    forced.shape[1],
                    decoding,
                    eos[:0],
                    forced,
                    True,
                    settings.progress,
                )
                assert reference.logits is not None and out.logits is not None  # both decoded with return_logits
                outputs[id(follows[id(cache)])].fidelity = fidelity_to(
                    reference.logits, out.logits, reference.tokens[0], caches[0].policy.name
                )
                continue
            out = decode(
                model,
                cache,
                logits,
                mask,
                max_new_tokens,
                decoding,
                eos,
                forced_tokens,
                settings.return_logits or (fidelity and cache is caches[0]),
                settings.progress,
            )
            # the methods that shared the prefill (a teacher-forced second cache is no method of its own)
            out.prefill_s, out.prefill_shared_by = prefill_s, sum(id(c) not in follows for c in group)
            outputs[id(cache)] = out
    return [outputs[id(cache)] for cache in caches]


def prefill(model, input_ids, attention_mask, cache) -> tuple[torch.Tensor, float]:
    """One forward over the (left-padded) prompt into `cache`: the last position's logits and the seconds it took."""
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    padded = bool((attention_mask == 0).any())
    start = time.perf_counter()
    logits = model(
        input_ids,
        attention_mask=attention_mask if padded else None,
        position_ids=positions,
        **with_cache(model, cache),
        use_cache=True,
        logits_to_keep=1,
    ).logits[:, -1]
    synchronize(input_ids.device)
    return logits, time.perf_counter() - start


def prefill_in_groups(model, input_ids, attention_mask, caches, rows: int | None) -> tuple[torch.Tensor, float]:
    """`prefill` into `caches` (one method, or several sharing each forward) at most `rows` rows per forward (None:
    all at once). Rows after the first group go into new caches of the same methods, joined into `caches` at the end
    (engine/join_rows.py), so that the prefill's transient is one group's while decoding stays one batched step.
    The seconds count every forward and the join."""
    batch = input_ids.shape[0]
    rows = batch if rows is None else min(rows, batch)
    groups, logits, seconds = [], [], 0.0
    for start in range(0, batch, rows):
        group = caches if start == 0 else [PolicyCache(cache.policy, model, cache.max_new_tokens) for cache in caches]
        chosen = slice(start, start + rows)
        out, spent = prefill(
            model, input_ids[chosen], attention_mask[chosen], group[0] if len(group) == 1 else SharedPrefill(group)
        )
        groups.append(group)
        logits.append(out)
        seconds += spent
    if len(groups) > 1:
        joining = time.perf_counter()
        for parts in zip(*groups):  # one method's caches, one per row group
            join_caches(list(parts))
        seconds += time.perf_counter() - joining
    return torch.cat(logits), seconds


def check_decode_rows(decode_rows: int | None, prompts: int) -> int:
    """Rows to decode (None: the prompt's), refused below the prompt's rows, which each decode at least once."""
    check_positive("decode_rows", decode_rows, allow_none=True)
    if decode_rows is not None and decode_rows < prompts:
        raise ValueError(
            f"decode_rows ({decode_rows}) is fewer than the prompt's {prompts} rows; give at least {prompts}"
        )
    return prompts if decode_rows is None else decode_rows


def copied_rows(prompts: int, rows: int, device) -> torch.Tensor:
    """(rows,): the prompt row that each of `rows` decoded rows copies, the prompts in turn (row r copies r mod
    `prompts`), so that `rows` needs no multiple of `prompts`."""
    return torch.arange(rows, device=device) % prompts


def repeat_rows(caches, logits, attention_mask, rows: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """`caches`, the prompt's last logits and its mask, prefilled for N rows, repeated to `rows` (`copied_rows`):
    each cache one layer at a time (`batch_select_indices`), every copy its own tensors. Returns the logits, the mask
    and the seconds it took (nothing done where `rows` is N)."""
    if rows == logits.shape[0]:
        return logits, attention_mask, 0.0
    start = time.perf_counter()
    copies = copied_rows(logits.shape[0], rows, logits.device)
    for cache in caches:
        cache.batch_select_indices(copies)
    logits, attention_mask = logits[copies], attention_mask[copies]
    synchronize(logits.device)
    return logits, attention_mask, time.perf_counter() - start


def decode(
    model,
    cache: PolicyCache,
    logits,
    attention_mask,
    max_new_tokens,
    settings: DecodeSettings,
    eos,
    forced_tokens,
    return_logits: bool,
    progress: bool,
) -> GenerationOutput:
    """The decode loop from the prompt's last logits: one token per step through `cache` until EOS or the limit."""
    device = logits.device
    generator = None if settings.seed is None else torch.Generator(device).manual_seed(settings.seed)
    batch = logits.shape[0]
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    position = attention_mask.long().sum(-1, keepdim=True) - 1
    steps, chosen, all_logits = [], [], []
    timer = StepTimer(device)
    forward = compiled_forward(model) if settings.compile else model
    bar = tqdm(total=max_new_tokens, desc=f"{cache.policy.name}: decode", unit="tok", disable=not progress, leave=False)
    first_step = cache.step  # a cache carried over (a conversation's next turn) has counted earlier steps
    start = time.perf_counter()
    for step in range(max_new_tokens):
        bar.update()
        if return_logits:
            all_logits.append(logits.float().cpu())
        if forced_tokens is None:
            token = _next_token(logits, settings, generator)
        else:
            token = forced_tokens[:, step]
        chosen.append(token)
        steps.append(finished.clone())
        finished |= torch.isin(token, eos)
        if step == max_new_tokens - 1 or (step + 1) % settings.eos_check_every == 0 and bool(finished.all()):
            break
        position = position + 1
        timer.mark()
        run = model if settings.compile and runs_eagerly(cache.policy, cache.step + 1, device) else forward
        logits = run(token[:, None], position_ids=position, **with_cache(model, cache), use_cache=True).logits[:, -1]
        timer.mark()
    synchronize(device)
    decode_s = time.perf_counter() - start
    bar.close()

    tokens = torch.stack(chosen, dim=1).tolist()
    done_before = torch.stack(steps, dim=1).tolist()
    rows = [[t for t, done in zip(row, dones) if not done] for row, dones in zip(tokens, done_before)]
    return GenerationOutput(
        tokens=rows,
        prompt_tokens=attention_mask.sum(-1).tolist(),
        prefill_s=0.0,
        decode_s=decode_s,
        decode_steps=cache.step - first_step,
        cache=cache,
        step_s=timer.seconds(),
        logits=all_logits if return_logits else None,
    )
