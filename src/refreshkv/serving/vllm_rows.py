"""The plugin's view of vLLM's persistent batch: a logits processor (vLLM's `vllm.logits_processors` plugin point)
that leaves the logits as they are and, before each forward pass, applies the engine's batch changes to
batch_rows.py's `ROWS`: a new request becomes a `Request` with the engine's method (or its own, from
`extra_args={"refreshkv": {...}}` in its sampling parameters); one that leaves is parked, and taken back if it
returns (preempted, or skipped for a step).
A request's own settings are checked when it arrives (`validate_params`): one it cannot serve fails alone, with
HTTP 400 on an OpenAI server, and the others go on.
"""

from __future__ import annotations

import functools
import weakref

import torch
from vllm import SamplingParams
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_gather
from vllm.exceptions import VLLMValidationError
from vllm.logger import init_logger
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from ..core.policy import Policy, PolicyError
from ..core.rope import inverse_frequencies
from .batch_rows import ROWS
from .heap import HEAP
from .plugin_config import CONFIG_KEY, served_policy
from .request_layer import ModelFacts, Request, StepCounts, tokens_left

LOG = init_logger("vllm.refreshkv")  # under vLLM's logger: its handlers print it
COUNTS = StepCounts()  # this worker's decode layer-steps, summed over requests


class Unserved:
    """Why this worker's model runs no method (its attention has what the plugin does not handle), or None."""

    reason: str | None = None


UNSERVED = Unserved()


def engine_policy(vllm_config: VllmConfig) -> Policy | None:
    """The method of `--additional-config`'s "refreshkv" key, None without it (vLLM runs as without the plugin)."""
    settings = (vllm_config.additional_config or {}).get(CONFIG_KEY)
    if settings is None:
        return None
    return served_policy(settings, vllm_config.model_config.max_model_len)


@functools.cache
def word_spans(tokenizer_folder: str) -> object:
    from transformers import AutoTokenizer

    from ..engine.spans import WordTable

    return WordTable.of(AutoTokenizer.from_pretrained(tokenizer_folder))


def sum_over_tp_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of `tensor` over the tensor-parallel ranks, the same bits on every rank: each rank's part gathered,
    then added in rank order (an all-reduce may add them in another order on each rank)."""
    parts = tensor_model_parallel_all_gather(tensor.unsqueeze(0), dim=0)
    return parts.sum(dim=0)


def model_facts(vllm_config: VllmConfig, policy: Policy) -> ModelFacts:
    text = vllm_config.model_config.hf_text_config
    layer_types = getattr(text, "layer_types", None) or [None] * text.num_hidden_layers
    spans = word_spans(vllm_config.model_config.tokenizer) if policy.uses_word_spans() else None
    ranks = get_tensor_model_parallel_world_size()
    return ModelFacts(
        text.model_type,
        [inverse_frequencies(text, kind) for kind in layer_types],
        spans,
        sum_over_tp_ranks if ranks > 1 else None,
        ranks,
    )


class RequestRows(LogitsProcessor):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self.config = vllm_config
        self.policy = engine_policy(vllm_config)
        self.facts: dict[str, ModelFacts] = {}
        ROWS.rows.clear()
        if self.policy is not None:
            LOG.info("refreshkv plugin on: %s, on the layers without a sliding window", self.policy)

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """A request's own settings, checked where it arrives (the OpenAI server's process: HTTP 400 with this one
        line). That process is not told the model's context: a budget above it is said in the worker's log."""
        settings = (sampling_params.extra_args or {}).get(CONFIG_KEY)
        if settings is not None:
            try:
                served_policy(settings)
            except PolicyError as error:
                raise VLLMValidationError(f"{CONFIG_KEY}: {error}", parameter=CONFIG_KEY) from None

    def is_argmax_invariant(self) -> bool:
        return True

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        added = [
            (index, self._request(params, prompt or [], output)) for index, params, prompt, output in batch_update.added
        ]
        moved = [(a, b, way == MoveDirectionality.SWAP) for a, b, way in batch_update.moved]
        held = ROWS.holders()
        ROWS.update(list(batch_update.removed), added, moved)
        holding = ROWS.holders()
        if len(holding) != len(held):  # what a leak check reads (benchmarks/perf/vllm_load.py)
            LOG.debug("refreshkv: %d requests hold plugin state (%d parked)", len(holding), len(ROWS.parked))
        HEAP.after_update(len(held - holding), len(holding))

    def _request(self, params: SamplingParams, prompt: list[int], output: list[int]) -> Request | None:
        resumed = ROWS.resume(params, output)
        if resumed is not None:  # back after a preemption or a skipped step: its own C_p and schedule
            COUNTS.resumed += 1
            return resumed
        settings = (params.extra_args or {}).get(CONFIG_KEY)
        if settings is None and self.policy is None:
            return None  # vLLM's own attention
        policy = self.policy if settings is None else served_policy(settings)
        assert policy is not None  # the request's own or the engine's
        context = self.config.model_config.max_model_len
        if UNSERVED.reason is not None:
            LOG.warning("refreshkv: a request's %s runs as vLLM's own attention: %s", policy.name, UNSERVED.reason)
            return None
        budget = getattr(policy, "budget", None)
        if isinstance(budget, int) and budget > context:
            LOG.warning(
                "refreshkv: a request's budget %d is above the model's context of %d tokens: it keeps every token "
                "(vLLM's own attention)",
                budget,
                context,
            )
        new_tokens = tokens_left(params.max_tokens, context, len(prompt), len(output))
        facts = self.facts.get(policy.name + str(policy.uses_word_spans()))
        if facts is None:
            facts = self.facts[policy.name + str(policy.uses_word_spans())] = model_facts(self.config, policy)
        # an answer so far without a parked state: its request was parked past PARKED_AT_MOST; what vLLM prefills
        # again, the prompt and the answer so far, is its question
        request = Request(policy, [*prompt, *output], new_tokens, facts, COUNTS)
        request.owner, request.answer, request.prompt_length = weakref.ref(params), output, len(prompt)
        return request if request.served else None
