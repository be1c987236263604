"""A conversation over one cache: a long context prefilled once, then questions asked one after another.

Each question's tokens go through the method's cache in one forward (a multi-token step, `Policy.extend`: every
method says in its docstring what it does with a block of new tokens; refreshkv and recycled attend fully and
rebuild C_p from the question, the eviction methods apply their own rule token by token), then the answer is
decoded by the same loop as `generate`. No turn prefills the context again: a turn costs its question's tokens and
its answer's decode.

Two modes, both measurable:
- question-agnostic (default): the context is prefilled alone, before any question (as kvpress compresses a
  context); an eviction method then decides what to keep without having seen any question;
- question-aware (`question_aware=True`): the first question is prefilled together with the context, so prefill-time
  selections see it; later questions are appended.
Answers stay in the context (`keep_answers=True`) or are forgotten before the next question, which only methods
that can forget their last tokens allow (`crop`). `TurnFormat` wraps the parts in the model's chat template (a chat
model) or in plain text (a base model).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch

from ..core.policy import Policy, PolicyError, croppable_methods, policy_of
from ..engine.cache import PolicyCache
from ..engine.cache_argument import with_cache
from ..engine.shared_prefill import SharedPrefill
from .generate import check_length, decode, prefill, synchronize
from .generation_settings import DecodeSettings
from .inputs import check_eos, check_new_tokens, check_token_ids, vocabulary_size


@dataclasses.dataclass
class Turn:
    """One question and its answer, with what the turn cost."""

    question_tokens: int
    tokens: list[int]  # the answer, up to and including its end-of-sequence token
    time_to_first_token_s: float  # the question's forward (and, question-aware, the context's prefill on turn 1)
    decode_ms_per_token: float
    kv_bytes_held: int  # after the turn
    kv_bytes_read_per_step: float  # keys and values read per decode step of this turn


def check_can_forget(policy: Policy) -> None:
    """Refuse, in one line, a method that cannot forget its answers (`keep_answers=False`)."""
    if type(policy).crop is Policy.crop:
        raise PolicyError(
            f"method '{policy.name}' cannot forget its answers (keep_answers=False); methods that can: "
            f"{', '.join(croppable_methods())}"
        )


class Conversation:
    """Questions over one prefilled context, under one KV method; see the module docstring.

    `context_ids`: (1, n) token ids. `eos_token_id`: where answers end (default: the model's). `method`: a name with
    its `params`, or a method object alone.
    """

    def __init__(
        self,
        model,
        context_ids: torch.Tensor,
        method: str | Policy = "refreshkv",
        *,
        question_aware: bool = False,
        keep_answers: bool = True,
        eos_token_id: int | list[int] | None = None,
        **params,
    ):
        policy = policy_of(method, **params)
        check_token_ids("context_ids", context_ids, vocabulary_size(model))
        if context_ids.shape[0] != 1:
            raise ValueError(f"a conversation takes one context (a batch of 1), got {context_ids.shape[0]} rows")
        if not keep_answers:
            check_can_forget(policy)
        check_length(model, context_ids.shape[1], 1)  # before the prefill: a context with no room for an answer
        check_eos(eos_token_id)
        self.model, self.policy = model, policy
        self.keep_answers = keep_answers
        eos = model.generation_config.eos_token_id if eos_token_id is None else eos_token_id
        self.eos = torch.tensor([] if eos is None else eos, device=context_ids.device).flatten()
        self.cache = PolicyCache(policy, model)  # no announced length: stores grow turn by turn
        # tokens not yet through the cache (the context, then each answer's last token)
        self.pending: torch.Tensor | None = context_ids
        self.context_prefill_s = 0.0
        self.turns: list[Turn] = []
        if not question_aware:
            _, self.context_prefill_s = self._prefill(self.cache)

    @classmethod
    def several(cls, model, context_ids: torch.Tensor, methods, **options) -> list[Conversation]:
        """One question-agnostic conversation per method over the same context, prefilled by one shared forward
        (methods that compute their own prefill prefill alone). `options`: as for one conversation."""
        conversations = [cls(model, context_ids, method, question_aware=True, **options) for method in methods]
        shares = [c for c in conversations if c.policy.shares_prefill]
        if len(shares) > 1:
            _, seconds = shares[0]._prefill(SharedPrefill([c.cache for c in shares]))
            for conversation in shares:
                conversation.pending, conversation.context_prefill_s = None, seconds
        for conversation in conversations:
            if conversation.pending is not None:
                _, conversation.context_prefill_s = conversation._prefill(conversation.cache)
        return conversations

    @property
    def tokens_held(self) -> int:
        """Tokens that have gone through the cache (context, questions and answers)."""
        return self.cache.get_seq_length()

    @torch.inference_mode()  # without it autograd keeps every layer's activations of the context (GBs at 4K)
    def _prefill(self, cache) -> tuple[torch.Tensor, float]:
        """The pending tokens through `cache` as a prompt: (last logits, seconds)."""
        ids, self.pending = self.pending, None
        assert ids is not None, "a prefill takes the tokens pending"
        return prefill(self.model, ids, torch.ones_like(ids), cache)

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        """New tokens through the cache after what it holds: the last position's logits."""
        start = self.tokens_held
        positions = torch.arange(start, start + ids.shape[1], device=ids.device)[None]
        out = self.model(
            ids, position_ids=positions, **with_cache(self.model, self.cache), use_cache=True, logits_to_keep=1
        )
        return out.logits[:, -1]

    @torch.inference_mode()
    def ask(self, question_ids: torch.Tensor, max_new_tokens: int = 64) -> Turn:
        """Append a question (1, q) and decode its answer greedily. A turn that would take the conversation past the
        model's context is refused before anything changes."""
        check_new_tokens(max_new_tokens)
        check_token_ids("question_ids", question_ids, vocabulary_size(self.model))
        pending = question_ids if self.pending is None else torch.cat([self.pending, question_ids], dim=1)
        check_length(self.model, self.tokens_held + pending.shape[1], max_new_tokens)
        start = time.perf_counter()
        if self.tokens_held == 0:  # question-aware: the context and the first question in one prefill
            self.pending = pending
            logits, _ = self._prefill(self.cache)
        else:
            logits = self._forward(pending)
        synchronize(question_ids.device)
        first_token_s = time.perf_counter() - start
        self.pending = None
        held_before, read_before = self.tokens_held, self.cache.stats.attended_bytes()
        out = decode(
            self.model,
            self.cache,
            logits,
            torch.ones(1, held_before, dtype=torch.long, device=question_ids.device),
            max_new_tokens,
            DecodeSettings(),
            self.eos,
            None,
            False,
            False,
        )
        answer = out.tokens[0]
        if self.keep_answers:
            self.pending = torch.tensor([answer[-1:]], device=question_ids.device)  # chosen, not yet fed
        elif self.tokens_held > held_before:
            self.cache.crop(held_before - self.tokens_held)
        turn = Turn(
            question_tokens=question_ids.shape[1],
            tokens=answer,
            time_to_first_token_s=first_token_s,
            decode_ms_per_token=out.decode_ms_per_token,
            kv_bytes_held=sum(self.cache.nbytes_per_layer()),
            kv_bytes_read_per_step=(self.cache.stats.attended_bytes() - read_before) / out.decode_steps
            if out.decode_steps
            else 0.0,
        )
        self.turns.append(turn)
        return turn


class TurnFormat:
    """The text around a conversation's parts: the model's chat template (the document and the first question in
    one user message, later questions as new user turns), or plain `Question: ... Answer:` text for a base model."""

    def __init__(self, tokenizer, chat: bool = True):
        self.tokenizer = tokenizer
        self.chat = chat and getattr(tokenizer, "chat_template", None) is not None
        if self.chat:
            doc, question, answer, later = "\x00D\x00", "\x00Q\x00", "\x00A\x00", "\x00L\x00"
            first = self._render([{"role": "user", "content": doc + "\n\nQuestion: " + question}])
            self.before_context, rest = first.split(doc)
            self.first_question = rest.replace(question, "{question}")
            second = self._render(
                [
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": later},
                ]
            )
            self.next_question = second.split(answer, 1)[1].replace(later, "{question}")
        else:
            self.before_context = ""
            self.first_question = "\n\nQuestion: {question}\nAnswer:"
            self.next_question = "\nQuestion: {question}\nAnswer:"

    def _render(self, messages) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def context(self, document: str) -> torch.Tensor:
        if self.chat:
            return torch.tensor([self.tokenizer.encode(self.before_context + document, add_special_tokens=False)])
        return torch.tensor([self.tokenizer.encode(document)])  # a base model's BOS first

    def question(self, text: str, first: bool, after: Sequence[int] = (), answer_prefix: str = "") -> torch.Tensor:
        """A question's tokens, then the answer's opening words if given; `after`, the previous answer, whose
        end-of-sequence token already closes its turn."""
        if not text.strip():
            raise ValueError("the question is empty")
        frame = self.first_question if first else self.next_question
        opening = (answer_prefix if self.chat else " " + answer_prefix) if answer_prefix else ""
        rendered = frame.replace("{question}", text) + opening
        eos = getattr(self.tokenizer, "eos_token", None)
        if after and eos and after[-1] == self.tokenizer.eos_token_id and rendered.startswith(eos):
            rendered = rendered[len(eos) :]
        return torch.tensor([self.tokenizer.encode(rendered, add_special_tokens=False)])
