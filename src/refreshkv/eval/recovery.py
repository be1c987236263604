"""Attention-mass recovery (recycled-attention.txt §2.2, Fig. 2), measured under `full` with teacher forcing.

Task `recovery`: each example is a window of real text (built like `ppl`'s): the first `length` tokens are prefilled,
then the next tokens are fed one at a time under full attention. The first fed token is step t (its query sees the
t + 1 keys 0..t); the following `steps` tokens are steps t+1 .. t+S. At step t each query head's top-K keys are
taken from its own attention probabilities; at every step t+i (offset i = 0..S) the row records, per layer, the
share of that head's attention mass that falls on

- `topk`: step t's top-K tokens plus the tokens decoded after step t (what Recycled Attention attends to at
  step t+i: the recycled top-K and the tokens appended since), and
- `streaming`: StreamingLLM's cache of the same size K at step t+i: `sinks` (4) initial tokens + the K - sinks most
  recent tokens, i.e. what StreamingLLM attends to (sinks capped at K - 1 as the method does).

Both are means over query heads, in every layer that runs the method (`layers`: on Gemma 3 the global layers; a
sliding-window layer whose window bites attends only to its window, so neither cache is its question). With
K >= t + 1 both caches hold every token and recover 1.0; at offset 0 the top-K set is the optimal set of size K,
so its recovery is >= StreamingLLM's.

Only the current query's probabilities are computed (`attention_probs`, never L x L): `RecoveryProbe` is `full`
with a decode hook that measures after attending; the measurements live in each layer's store.

Options: `paths` (UTF-8 text files; default: the bundled Pride and Prejudice opening), `budget` (K in tokens) or
`budget_ratio` (K = ceil(ratio * length), default 1/8 as in the seeds), `steps` (S, default 10), `sinks` (4).
Score: mean `topk` recovery over layers and offsets 1..S.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
from collections.abc import Sequence

import torch

from ..core.attention_math import attention_probs
from ..core.kvstore import FullStore
from ..core.policy import PolicyError, resolve_budget
from ..methods.full import Full
from ..methods.streamingllm import effective_sinks, sink_clamps
from .tasks.base import Example, example_id
from .tasks.ppl import PerplexityTask

BOOK = "pride-and-prejudice-opening.txt"


def default_paths() -> list[str]:
    return [str(importlib.resources.files("refreshkv.texts") / BOOK)]


def resolve_k(length: int, budget: int | None, budget_ratio: float | None) -> int:
    """K for a prefix of `length` tokens, by the methods' rule (`resolve_budget`)."""
    try:
        return resolve_budget(length, budget, budget_ratio)
    except PolicyError as error:
        raise ValueError(f"task 'recovery': {error}") from None


class RecoveryTask:
    name = "recovery"

    def build(
        self,
        tokenizer,
        length: int,
        num_examples: int,
        seed: int,
        paths: Sequence[str] | str | None = None,
        budget: int | None = None,
        budget_ratio: float | None = None,
        steps: int = 10,
        sinks: int = 4,
    ) -> list[Example]:
        resolve_k(length, budget, budget_ratio)
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"task 'recovery': steps must be an integer >= 1, got {steps!r}")
        if not isinstance(sinks, int) or sinks < 0:
            raise ValueError(f"task 'recovery': sinks must be an integer >= 0, got {sinks!r}")
        # steps t .. t+S are fed, and the last token of a ppl window is never fed: S + 2 target tokens
        windows = PerplexityTask().build(
            tokenizer, length, num_examples, seed, paths=paths or default_paths(), target_tokens=steps + 2
        )
        for index, window in enumerate(windows):
            window["task"] = self.name
            window["id"] = example_id(self.name, length, seed, index)
        return windows

    def score(self, prediction: str, example: Example) -> float:
        raise NotImplementedError("recovery examples are scored from attention: see refreshkv.eval.recovery")


class RecoveryStore(FullStore):
    """`full`'s store plus what the probe measures in this layer (the probe object itself holds no run state)."""

    def __init__(self, like: torch.Tensor, capacity: int):
        super().__init__(like, capacity)
        self.chosen: torch.Tensor | None = None  # (query heads, n0) bool: step t's top-K
        self.topk: list[float] = []  # recovery at offsets 0..steps
        self.streaming: list[float] = []


@dataclasses.dataclass
class RecoveryProbe(Full):
    """`full` attention that also measures attention-mass recovery at decode steps 0..steps (batch of one)."""

    top_k: int = 1
    steps: int = 10
    sinks: int = 4

    def clamps(self, length: int, budget: int) -> list[str]:
        """The streaming comparison keeps at most K - 1 sinks, as streamingllm does (`effective_sinks`)."""
        return super().clamps(length, budget) + [f"recovery's {note}" for note in sink_clamps(self.sinks, self.top_k)]

    def store_prompt(self, layer, query, key, value, scaling):
        layer.state = RecoveryStore(key, layer.cache.capacity())
        layer.state.append(key, value)

    def decode(self, layer, query, key, value, scaling):
        output = super().decode(layer, query, key, value, scaling)
        offset = layer.cache.step - 1
        if offset > self.steps:
            return output
        if query.shape[0] != 1:
            raise ValueError("recovery is measured one example at a time")
        store: RecoveryStore = layer.state
        keys, _ = store.view()
        n = keys.shape[2]
        probs = attention_probs(query, keys, scaling)[0].reshape(-1, n)  # (query heads, n), float32
        if offset == 0:
            store.chosen = torch.zeros_like(probs, dtype=torch.bool)
            store.chosen.scatter_(1, probs.topk(min(self.top_k, n), dim=-1).indices, True)
        chosen = store.chosen
        decoded_since = probs[:, chosen.shape[1] :].sum(-1)
        topk = (probs[:, : chosen.shape[1]] * chosen).sum(-1) + decoded_since
        sinks = effective_sinks(self.sinks, self.top_k)
        keep = torch.zeros(n, dtype=torch.bool, device=probs.device)
        keep[:sinks] = True
        keep[max(sinks, n - (self.top_k - sinks)) :] = True
        streaming = (probs * keep).sum(-1)
        store.topk.append(float(topk.mean()))
        store.streaming.append(float(streaming.mean()))
        return output

    def result(self, cache) -> dict:
        """The measurements of one teacher-forced run, read from the cache's layers that ran the probe."""
        layers = cache.method_layers()
        if not layers:
            raise ValueError("recovery needs a layer that attends to the whole context; every layer here is windowed")
        topk = [layer.state.topk for layer in layers]
        streaming = [layer.state.streaming for layer in layers]
        if len(topk[0]) != self.steps + 1:
            raise ValueError(f"recovery needs {self.steps + 1} decode steps, measured {len(topk[0])}")
        return {
            "k": self.top_k,
            "steps": self.steps,
            "sinks": self.sinks,
            "layers": [layer.layer_idx for layer in layers],
            "topk": topk,
            "streaming": streaming,
        }


def recovery_score(result: dict) -> float:
    """Mean top-K recovery over layers and offsets 1..S."""
    values = [value for layer in result["topk"] for value in layer[1:]]
    return sum(values) / len(values)


def probe_for(length: int, options: dict) -> RecoveryProbe:
    return RecoveryProbe(
        top_k=resolve_k(length, options.get("budget"), options.get("budget_ratio")),
        steps=options.get("steps", 10),
        sinks=options.get("sinks", 4),
    )
