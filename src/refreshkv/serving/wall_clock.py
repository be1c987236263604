"""A batch of requests through an in-process vLLM engine, timed by the wall clock: what a user waits for.

`timed_run` adds every request at once and steps the engine until all are done, timing every step. The prefill
phase lasts until every request has its first token (its steps may decode the requests already prefilled); the
decode phase is every step after it, none left out: decode tokens/s is the tokens decoded in that phase over its
wall time, from the end of the prefill phase to the end of the last step (a median step is a latency, never a
throughput). Beside it: each step's seconds, the time to each request's first and second token, and the share of
request-layer steps that read the whole cache.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

from vllm import SamplingParams
from vllm.inputs import TokensPrompt

from .vllm_rows import COUNTS


@dataclasses.dataclass
class TimedRun:
    decode_seconds: float  # wall time of the decode phase, every step counted
    decoded_tokens: int  # tokens the decode phase produced, over all requests
    step_seconds: list[float]  # each decode-phase step
    prefill_step_seconds: list[float]  # each step of the prefill phase (chunks, with or without decodes beside)
    first_token_seconds: list[float]  # per request: from its arrival to its first token
    second_token_seconds: list[float]  # per request: from its first token to its second
    layer_steps: int  # the plugin's request-layer decode steps in the decode phase (0: vLLM's own attention)
    full_layer_steps: float  # of them, the ones that read the whole cache

    @property
    def tokens_per_s(self) -> float:
        return self.decoded_tokens / self.decode_seconds

    def summary(self) -> dict[str, float]:
        steps = sorted(self.step_seconds)
        return {
            "tokens_per_s": round(self.tokens_per_s, 2),
            "decode_s": round(self.decode_seconds, 3),
            "decoded_tokens": self.decoded_tokens,
            "step_ms_mean": round(1000 * statistics.fmean(steps), 2),
            "step_ms_median": round(1000 * statistics.median(steps), 2),
            "step_ms_p90": round(1000 * steps[min(len(steps) - 1, int(0.9 * len(steps)))], 2),
            "step_ms_max": round(1000 * steps[-1], 2),
            "prefill_step_ms_max": round(1000 * max(self.prefill_step_seconds, default=0.0), 2),
            "first_token_s_mean": round(statistics.fmean(self.first_token_seconds), 3),
            "second_token_s_mean": round(statistics.fmean(self.second_token_seconds), 3),
            "full_step_share": round(self.full_layer_steps / self.layer_steps, 4) if self.layer_steps else 1.0,
        }


def timed_run(engine, prompts: list[list[int]], settings: dict, new_tokens: int, tag: str) -> TimedRun:  # type: ignore[no-untyped-def]
    """Decode `new_tokens` greedy tokens for each prompt (token ids), all requests added at once with the plugin's
    `settings` (`{"method": "full"}`: vLLM's own attention)."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, extra_args={"refreshkv": settings})
    added = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", TokensPrompt(prompt_token_ids=prompt), params)
    produced: dict[str, int] = {}
    first: dict[str, float] = {}
    second: dict[str, float] = {}
    prefill_steps: list[float] = []
    steps: list[float] = []
    decode_start = None
    at_decode_start = 0
    layer_steps = full_layer_steps = 0.0
    while engine.has_unfinished_requests():
        started = time.perf_counter()
        outputs = engine.step()
        ended = time.perf_counter()
        (prefill_steps if decode_start is None else steps).append(ended - started)
        for output in outputs:
            count = len(output.outputs[0].token_ids)
            produced[output.request_id] = count
            if count >= 1:
                first.setdefault(output.request_id, ended - added)
            if count >= 2:
                second.setdefault(output.request_id, ended - added - first[output.request_id])
        if decode_start is None and len(first) == len(prompts):
            decode_start, at_decode_start = ended, sum(produced.values())
            layer_steps, full_layer_steps = COUNTS.layer_steps, COUNTS.full_layer_steps
    if decode_start is None or not steps:
        raise RuntimeError("the engine finished every request in its prefill: give more than one new token")
    return TimedRun(
        decode_seconds=time.perf_counter() - decode_start,
        decoded_tokens=sum(produced.values()) - at_decode_start,
        step_seconds=steps,
        prefill_step_seconds=prefill_steps,
        first_token_seconds=list(first.values()),
        second_token_seconds=list(second.values()),
        layer_steps=int(COUNTS.layer_steps - layer_steps),
        full_layer_steps=COUNTS.full_layer_steps - full_layer_steps,
    )
