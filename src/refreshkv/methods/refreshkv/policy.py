"""`refreshkv` (RefreshKV, dynamic schedule) and `recycled` (Recycled Attention, fixed stride): the parameters, the
schedule and the hooks of the method protocol.

Each layer keeps the full cache C_f and a partial cache C_p of K tokens per KV head (refreshkv.txt §2.2, Fig. 2;
recycled-attention.txt §2.3, §6):
- prefill: full attention; C_p = top-K tokens by the attention of the last `window` prompt tokens (32 by default,
  SnapKV's observation window, so that a question is read whole; the papers' 1, A.1), max-pooled over positions
  (`kernel`) and aggregated over the query heads of a GQA group (`aggregation`, max by default, A.3);
- partial step: attend to C_p plus the new token. `refreshkv` keeps every token decoded since the question beside
  the K (`keep_decoded`: C_p holds K + t, as snapkv's cache holds K + T; a refresh selects its K before the answer and
  keeps the answer so far); `recycled` and the papers let the new token take the slot of the lowest-scored entry, so
  C_p keeps K entries besides the newest token;
- full step: attend to all of C_f and rebuild C_p from the current query's attention (as the papers), where each
  token C_p holds scores at least `carry` x its score there (0.5; the papers' 0) and each token the question's window
  selected at least `question_floor` x its score there until the next question (the family's: 4, Gemma 3 1; the
  papers' 0): a refresh's one query attends more peakily than the window's mean, so an answer that lists several
  values would lose the question's marginal ones (docs/methods.md gives the measurements behind each default).
  `recycled` keeps the papers' rule: carry 0, no floor, a fixed-size C_p.
The rule that rebuilds C_p is partial_cache.py's, the step static decoding replays on the device device_step.py's.
C_f is read only at full steps, so it can be held in few bits or off the GPU (`full_cache`: dense, int8, int4, int2,
offload; core/full_cache.py), or be a serving engine's own paged blocks (refreshkv.serving). The prefill's selection
uses the prompt's exact keys.
Schedules: `stride` S = a full step every S decode steps (Recycled Attention). Otherwise dynamic: every `qc_stride`
steps each layer compares its head-averaged query with the one of its last full step (the prefill's last token at
first; with `anchor="window"` the mean of the window's queries) and attends fully when the cosine similarity is below
`threshold`.

Choices where the papers are silent (and partial_cache.py's):
- C_f receives every token as it is decoded (one in-place write) instead of in a batch at the next full step: the
  result is the same and no separate buffer is needed.
- Pooling keeps whole words by default (`pooling="span"`, engine/spans.py): the papers' centred kernel of 7 cuts a
  number that the tokenizer spells digit by digit (docs/results.md); `preset="paper"` is the papers'.
- Decode steps are counted from 1 after the prompt, so with `stride` S steps S, 2S, ... are full.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

from ...core import native_attention
from ...core.attention_math import (
    AGGREGATIONS,
    POOLINGS,
    Scaling,
    attend_with_probs,
    attention_probs,
    decode_attention,
)
from ...core.device_steps import DeviceLayer
from ...core.full_cache import DEFAULT_GROUP_SIZE, FullCacheStore, check_full_cache, check_group_size
from ...core.kvstore import FullStore, LayerState
from ...core.policy import (
    BudgetPolicy,
    PolicyError,
    check_choice,
    check_kernel,
    check_positive,
    is_number,
    register,
)
from ...core.selection import APPENDED, SelectionState
from .device_step import runs_on_device as dense_with_partial
from .device_step import step as step_on_device
from .device_step import step_kind
from .partial_cache import RefreshLayer, RefreshState, SelectionRule, hold_answer
from .query_check import (
    DEFAULT_QC_STRIDE,
    FAMILY_THRESHOLDS,
    LLAMA_THRESHOLD,
    QUERY_SPACES,
    compared_query,
    default_threshold,
)

# A refresh scores by one query, whose attention is peakier than the question window's mean
# over its queries, so the question's selection weighs 4x at a refresh; Gemma 3 keeps 1 (at 4 its three global layers
# kept the prompt's selection through a long continuation: perplexity at 16K 1.040 of `full`'s against 1.026).
QUESTION_FLOOR = 4.0
FAMILY_QUESTION_FLOORS = {"gemma3_text": 1.0}
ANCHORS = ("last", "window", "answer")


def default_question_floor(model_type: str) -> float:
    return FAMILY_QUESTION_FLOORS.get(model_type, QUESTION_FLOOR)


@register
@dataclasses.dataclass
class RefreshKV(BudgetPolicy[RefreshState]):
    """RefreshKV: the full cache C_f plus a partial cache C_p of the top K tokens, refreshed by a full-attention step
    when a layer's query drifts (or every `stride` steps).

    Parameters: `budget`: K tokens per KV head (or `budget_ratio`: K as a share of the longest prompt, 1/8 by
    default); `stride` a full step every S decode steps (fixed schedule; excludes the next two);
    `qc_stride` (10) steps between query checks and `threshold` (0.85; Qwen2 0.95, Gemma 3 0.9) the cosine below which a
    layer refreshes (dynamic schedule); `kernel` (7) max-pooling kernel and `pooling` (span: centred, then whole
    words, engine/spans.py; centered: the papers'; forward: 1 token before a peak and kernel - 2 after), `window` (32)
    last prompt tokens whose attention selects at prefill (a longer window takes the whole prompt), `carry` (0.5) the
    share of its score in C_p that a kept token keeps at a refresh, `question_floor` (4; Gemma 3 1) the share of its
    score in the question's selection that a token keeps at every refresh until the next question, `aggregation` (max)
    over a GQA group; `query` (pre_rope) the space the check compares queries in; `anchor` (last) what a question's
    first check compares with: its last token's query (the papers'), the mean of its `window` queries (window), or
    nothing: that check takes the answer's query as the anchor (answer); `keep_decoded` (true; the papers' false)
    decoded tokens kept in C_p beside its K instead of each evicting a selected one; `full_cache` (dense) how C_f is
    held (int8/int4/int2, offload) and `group_size` (32) its quantization groups.
    """

    name = "refreshkv"
    no_compression = (
        "it keeps the whole cache C_f for its full steps; its partial cache C_p is bounded to K + 1 with "
        "keep_decoded=false"
    )
    summary = "full cache + top-K partial cache, refreshed when the query drifts (or every `stride` steps)"
    # refreshkv.txt A.1, A.4 (recycled-attention.txt §3.2 for `recycled`): the selection of the papers' runs
    presets = {
        "paper": {
            "kernel": 7,
            "pooling": "centered",
            "window": 1,
            "carry": 0.0,
            "question_floor": 0.0,
            "aggregation": "max",
            "query": "pre_rope",
            "anchor": "last",
            "keep_decoded": False,
        }
    }

    stride: int | None = None
    qc_stride: int | None = None
    threshold: float | None = None
    kernel: int = 7
    pooling: str = "span"  # the papers' is "centered" (preset "paper"); span keeps whole words
    window: int = 32  # the papers' is 1 (preset "paper"): a question is read whole
    carry: float = 0.5  # the papers' is 0 (preset "paper"); 1 cost perplexity at 16K
    question_floor: float | None = None  # the family's (4; Gemma 3 1); the papers' 0 (preset "paper")
    aggregation: str = "max"
    query: str = "pre_rope"
    full_cache: str = "dense"
    group_size: int = DEFAULT_GROUP_SIZE
    anchor: str = "last"
    keep_decoded: bool = True  # the papers' is a fixed-size C_p (preset "paper"); snapkv keeps K + T

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("stride", self.stride, allow_none=True)
        check_positive("qc_stride", self.qc_stride, allow_none=True)
        if self.threshold is not None and not (is_number(self.threshold) and -1 <= self.threshold <= 1):
            raise PolicyError(f"threshold must be a cosine similarity in [-1, 1], got {self.threshold!r}")
        if self.stride is not None and (self.qc_stride is not None or self.threshold is not None):
            raise PolicyError("stride (fixed schedule) excludes qc_stride and threshold (dynamic schedule)")
        check_kernel(self.kernel)
        check_choice("pooling", self.pooling, POOLINGS)
        check_positive("window", self.window)
        if not (is_number(self.carry) and 0 <= self.carry <= 1):
            raise PolicyError(f"carry must be a share in [0, 1], got {self.carry!r}")
        floor = self.question_floor
        if floor is not None and not (is_number(floor) and 0 <= floor < float("inf")):
            raise PolicyError(f"question_floor must be a finite number >= 0, got {self.question_floor!r}")
        check_choice("aggregation", self.aggregation, AGGREGATIONS)
        check_choice("query", self.query, QUERY_SPACES)
        check_choice("anchor", self.anchor, ANCHORS)
        if not isinstance(self.keep_decoded, bool):
            raise PolicyError(f"keep_decoded must be true or false, got {self.keep_decoded!r}")
        if self.anchor == "window" and self.query == "post_rope":
            raise PolicyError("anchor='window' averages queries before RoPE: use query='pre_rope'")
        check_full_cache(self.full_cache, self.group_size)

    @classmethod
    def parameters(cls) -> dict[str, object]:
        params = super().parameters()
        if params["stride"] is None:  # what the dynamic schedule uses when qc_stride / threshold are not given
            tuned = ", ".join(f"{value} for {family}" for family, value in FAMILY_THRESHOLDS.items())
            params.update(qc_stride=DEFAULT_QC_STRIDE, threshold=f"{tuned}, {LLAMA_THRESHOLD} otherwise")
        if params["question_floor"] is None:
            tuned = ", ".join(f"{value} for {family}" for family, value in FAMILY_QUESTION_FLOORS.items())
            params.update(question_floor=f"{tuned}, {QUESTION_FLOOR} otherwise")
        return params

    def compared_query(self, layer: RefreshLayer, query: Tensor, width: int = 1) -> Tensor:
        """(B, D) head-averaged query of the newest token in the `query` space (query_check.py)."""
        return compared_query(layer, query, self.query, width)

    def question_anchor(self, layer: RefreshLayer, query: Tensor) -> Tensor | None:
        """What a question's first query check compares with: the compared query of its last token (the papers'),
        or with `anchor="window"` the mean of its window's, the queries its selection came from; with
        `anchor="answer"` nothing (None): that check takes the answer's query as the anchor and attends partially."""
        if self.anchor == "answer":
            return None
        width = min(self.window, query.shape[2]) if self.anchor == "window" else 1
        return self.compared_query(layer, query, width)

    def _empty_partial(self, layer: RefreshLayer, key: Tensor) -> SelectionState:
        """C_p's store: K slots and one for the newest token, with `keep_decoded` room for every announced token."""
        room = layer.expected_new_tokens() if self.keep_decoded else 1
        return SelectionState.empty_like(key, layer.budget + max(room, 1))

    # -- prefill ---------------------------------------------------------------------------------------------------
    def store_prompt(self, layer: RefreshLayer, query: Tensor, key: Tensor, value: Tensor, scaling: Scaling) -> None:
        length = key.shape[2]
        check_group_size(self.full_cache, self.group_size, key.shape[-1])
        full = layer.full_store(key, self.full_cache, self.group_size)
        full.append(key, value)
        anchor = self.question_anchor(layer, query) if self.stride is None else None
        if layer.budget >= layer.capacity():  # K holds the prompt and every announced token: C_p would copy C_f
            layer.state = RefreshState(full, None, anchor, answer_start=length)
            return
        partial = self._empty_partial(layer, key)
        layer.state = RefreshState(full, partial, anchor, answer_start=length)
        valid = layer.valid_positions(length, key.device)
        probs = attention_probs(query[:, :, -self.window :], key, scaling, valid, causal_tail=True)
        self.selection_rule(layer).select_for_question(layer, probs, valid, (key, value))

    # -- decode ----------------------------------------------------------------------------------------------------
    def decode(self, layer: RefreshLayer, query: Tensor, key: Tensor, value: Tensor, scaling: Scaling) -> Tensor:
        state: RefreshState = layer.state
        state.full.append(key, value)
        if state.partial is None:  # K holds every token: a step of `full`, no second copy, no selection
            if state.full.length <= layer.budget + 1:
                layer.record(1.0, state.full.attended_bytes())
                keys, values = state.full.view()
                return decode_attention(
                    query, keys, values, scaling, layer.valid_positions(state.full.length, key.device)
                )
            # more tokens came than were announced: from here on a partial cache, first filled by a full step
            state.partial = self._empty_partial(layer, key)
            output, read = self.full_step(layer, query, scaling)
            layer.record(1.0, read)
            return output
        need = self.needs_full(layer, query)
        if need is False:
            output, read = self.partial_step(layer, query, key, value, scaling)
            layer.record(0.0, read)
            return output
        if need is True:
            output, read = self.full_step(layer, query, scaling)
            layer.record(1.0, read)
            return output
        # Rows of the batch disagree: compute both and keep each row's own result. A refreshed row carries the scores
        # of C_p as it was before this step's token took a slot, as it would alone.
        held = (state.partial.store.positions.clone(), state.partial.scores.clone()) if self.carry > 0 else None
        partial_out, partial_read = self.partial_step(layer, query, key, value, scaling)
        full_out, read = self.full_step(layer, query, scaling, rows=need, held=held)
        layer.record(need.float().mean(), partial_read + read)
        return torch.where(need.view(-1, 1, 1, 1), full_out, partial_out)

    def extend(self, layer: RefreshLayer, query: Tensor, key: Tensor, value: Tensor, scaling: Scaling) -> Tensor:
        """A block of new tokens (a conversation's next question) is one full step: appended to C_f, attended over
        all of C_f (each token causally), and C_p rebuilt from the last `window` of them as at prefill, so the next
        answer is read from a selection made for the new question."""
        state: RefreshState = layer.state
        state.full.append(key, value)
        state.answer_start = state.full.length
        keys, values = state.full.view()
        valid = layer.valid_positions(state.full.length, keys.device)
        layer.record(1.0, state.full.attended_bytes())
        output = decode_attention(query, keys, values, scaling, valid)
        if state.partial is None:
            if state.full.length <= layer.budget + 1:
                return output
            state.partial = self._empty_partial(layer, key)
        probs = attention_probs(query[:, :, -self.window :], keys, scaling, valid, causal_tail=True)
        self.selection_rule(layer).select_for_question(layer, probs, valid, (keys, values))
        if self.stride is None:
            state.anchor = self.question_anchor(layer, query)
        return output

    def read_a_question(self, layer: RefreshLayer) -> bool:
        return layer.state.partial is not None  # `extend` rebuilt C_p (while K holds every token, it only appends)

    def crop(self, layer: RefreshLayer, tokens: int) -> None:
        """Forget the last `tokens` tokens: from C_f (dense only) and from C_p, whose emptied slots decoded tokens
        fill first."""
        state: RefreshState = layer.state
        if not isinstance(state.full, FullStore) or type(state.full).crop is not FullStore.crop:
            raise PolicyError(f"method '{self.name}' forgets tokens only with full_cache='dense'")
        state.full.crop(tokens)
        partial = state.partial
        if partial is None:
            return
        for positions, scores in (
            (partial.store.positions, partial.scores),
            (state.question_positions, state.question_scores),
        ):
            if positions is not None and scores is not None:
                gone = positions >= state.full.length
                positions.masked_fill_(gone, -1)
                scores.masked_fill_(gone, float("-inf"))
        partial.filled = 0  # some slots are empty now: mask until refilled
        partial.empty = int((partial.store.positions < 0).sum(-1).min())

    def selection(self, layer: RefreshLayer, query: Tensor, scaling: Scaling) -> Tensor | None:
        """C_p (after a full step, the refreshed one); None while K holds every token."""
        partial = layer.state.partial
        return None if partial is None else partial.kept(layer.pads)

    def scheduled(self, step: int) -> bool:
        """A full step of the fixed schedule, or a QC step of the dynamic one."""
        return step % (self.stride or self.qc_stride or DEFAULT_QC_STRIDE) == 0

    def decides_on_host(self, step: int) -> bool:
        return self.stride is None and self.scheduled(step)

    def needs_full(self, layer: RefreshLayer, query: Tensor) -> bool | Tensor:
        """True / False for the whole batch, or a (B,) bool tensor when rows may disagree.

        The schedule's step test is a host integer test (never a device read; under torch.compile it selects one
        of two compiled graphs). The dynamic schedule's decision at QC steps is read on the host once per layer (on
        a GPU the host waits for the device there), so that a step computes only the path it takes. `compile=True`
        runs QC steps eagerly on a CPU (`decides_on_host`). Compiled (on a GPU) the decision is not read: a QC step
        computes both paths at every layer and each row keeps its own, which keeps the step one graph without a host
        sync (on the CPU that made a QC step cost 2-3x `full`'s step; docs/benchmark.md)."""
        if not self.scheduled(layer.step):  # a branch, not a value: under torch.compile a guard
            return False
        if self.stride is not None:
            return True
        need = self.drifted(layer, query)
        if torch.compiler.is_compiling():
            return need
        count = int(need.sum())
        return True if count == need.numel() else False if count == 0 else need

    def drifted(self, layer: RefreshLayer, query: Tensor) -> Tensor:
        """(B,) bool: the rows whose compared query has drifted from their last full step's (cosine below the
        threshold), the dynamic schedule's decision at a QC step."""
        anchor = layer.state.anchor
        if anchor is None:  # anchor="answer": the question's selection stands until the answer's own query drifts
            layer.state.anchor = self.compared_query(layer, query)
            return torch.zeros(query.shape[0], dtype=torch.bool, device=query.device)
        threshold = default_threshold(layer.model_type) if self.threshold is None else self.threshold
        return F.cosine_similarity(self.compared_query(layer, query), anchor.float(), dim=-1) < threshold

    def partial_step(
        self, layer: RefreshLayer, query: Tensor, key: Tensor, value: Tensor, scaling: Scaling
    ) -> tuple[Tensor, int]:
        """Attend to C_p with the new token in it: the output and the bytes of C_p read."""
        partial = layer.state.partial
        assert partial is not None  # a partial step has C_p
        self.make_room(layer)
        # The new token takes an empty slot first, then the lowest-scored recycled token's.
        partial.put(partial.scores, key, value, layer.state.full.length - 1, APPENDED + layer.step)
        return layer.attend_held(partial, query, scaling)

    def make_room(self, layer: RefreshLayer) -> None:
        """With `keep_decoded`, C_p holds K and the whole answer so far: where more tokens were decoded than were
        announced (its room), the room grows instead of a selected token or the answer's first ones being evicted.
        Not under torch.compile, whose steps keep their stores' sizes (static decoding holds the announced tokens)."""
        partial, full = layer.state.partial, layer.state.full
        assert partial is not None  # a step with C_p
        short = layer.budget + full.length - layer.state.answer_start - partial.store.slots
        if self.keep_decoded and short > 0 and not torch.compiler.is_compiling():
            partial.grow(short + layer.expected_new_tokens())

    def full_step(
        self,
        layer: RefreshLayer,
        query: Tensor,
        scaling: Scaling,
        rows: Tensor | None = None,
        held: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, int]:
        """Attend over C_f and refresh C_p (only `rows`, (B,) bool, if given): the output and the bytes of C_f read.
        Where the C can (eager, on the CPU), only the rows that refresh read C_f; elsewhere every row does."""
        state: RefreshState = layer.state
        full = state.full
        self.make_room(layer)
        valid = layer.valid_positions(full.length, query.device)
        # C_f read where it lies: a quantized one from its codes, a serving engine's in its blocks, a dense one as it
        # is; each, where the C can, for `rows` alone.
        source: FullCacheStore | tuple[Tensor, Tensor] = full
        attended = full.attend(query, scaling, valid, rows)
        read_rows = rows
        if attended is None:
            keys, values = source = full.view()
            if rows is not None:
                attended = native_attention.attend_rows(query, keys, values, scaling, valid, rows)
            if attended is None:
                read_rows = None  # every row read C_f
                attended = attend_with_probs(query, keys, values, scaling, valid)
        read = full.attended_bytes()
        if read_rows is not None:
            read = read * int(read_rows.sum()) // read_rows.numel()
        output, probs = attended
        before = state.answer_start if self.keep_decoded else None
        kept = self.selection_rule(layer).refresh(
            layer, probs.unsqueeze(3), valid, source, rows, held=held, before=before
        )
        if self.keep_decoded:
            hold_answer(layer, kept, rows)
        if self.stride is None:
            current = self.compared_query(layer, query)
            if rows is not None and state.anchor is not None:  # the other rows keep theirs
                current = torch.where(rows[:, None], current, state.anchor)
            state.anchor = current
        return output, read

    # -- static decoding's steps on the device (device_step.py) --------------------------------------------------
    def device_step_kind(self, step: int) -> str:
        return step_kind(self, step)

    def runs_on_device(self, states: list[LayerState]) -> bool:
        return dense_with_partial(states)

    def device_step(
        self, layer: DeviceLayer[RefreshState], query: Tensor, key: Tensor, value: Tensor, scaling: float
    ) -> Tensor:
        return step_on_device(self, layer, query, key, value, scaling)

    def selection_rule(self, layer: RefreshLayer) -> SelectionRule:
        """The selection parameters a refresh of `layer` scores by (partial_cache.py), the family's floor resolved."""
        return SelectionRule(self.kernel, self.pooling, self.aggregation, self.carry, self.floor_share(layer))

    def floor_share(self, layer: RefreshLayer) -> float:
        """`question_floor`, or the model family's where it is not given."""
        return default_question_floor(layer.model_type) if self.question_floor is None else self.question_floor


@register
@dataclasses.dataclass
class Recycled(RefreshKV):
    """Recycled Attention: `refreshkv` on a fixed schedule, a full step every `stride` (10) decode steps for all layers.

    Parameters: as `refreshkv` (`budget`: K tokens per KV head (or `budget_ratio`: K as a share of the longest
    prompt, 1/8 by default); `stride`; `qc_stride` and `threshold` unused unless `stride` is None;
    `kernel`, `pooling`, `window`, `carry` (0 here), `question_floor` (0 here), `aggregation`, `query`, `anchor`
    (unused unless `stride` is None), `keep_decoded` (false here), `full_cache`, `group_size`).
    """

    name = "recycled"
    summary = "Recycled Attention: refreshkv with a full step every `stride` steps for all layers"

    stride: int | None = 10
    carry: float = 0.0  # refreshkv's 0.5 was measured on the dynamic schedule only
    question_floor: float | None = 0.0  # likewise
    keep_decoded: bool = False  # likewise
