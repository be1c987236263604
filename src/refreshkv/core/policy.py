"""The protocol every KV method implements, its parameters, and the registry by name.

A method is a dataclass of its parameters (validated in `__post_init__`) with two hooks called by the attention
function for each layer: `store_prompt` (the prompt: set `layer.state` to a `LayerState`; the prompt's attention
output is plain causal attention, computed once by the caller) and `decode` (one new token; must call
`layer.record` once). Because every method's prompt output is the same, one forward pass can prefill several
methods at once (engine/shared_prefill.py); a future method whose prompt output differs (e.g. chunked prefill over
a compressed cache) overrides `prefill` instead and sets `shares_prefill = False`, so it always runs alone.
Everything a generation accumulates lives on the layer the hook receives (a `MethodLayer`, contract.py: its `state`)
or on its cache, never on the policy object, so one policy object serves all layers of a cache and any number of
generations, interleaved or not. docs/adding-a-method.md states the rest of the contract.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeGuard

from torch import Tensor

from .attention_math import Scaling, pool_window, prompt_attention
from .contract import MethodLayer, State
from .kvstore import LayerState

if TYPE_CHECKING:
    from .device_steps import DeviceLayer

DEFAULT_BUDGET_RATIO = 1 / 8  # the seeds' setting: K = L / 8


class PolicyError(ValueError):
    """Invalid method name or parameter; the message is one line naming the allowed values."""


@dataclasses.dataclass
class Policy(Generic[State]):
    """A KV method: its parameters are the dataclass's fields, its hooks receive each layer as a `MethodLayer[State]`
    whose `state` (what the method keeps: a `LayerState`, `State`) the method sets at the prompt and reads after.

    Shapes: `query` (B, Hq, q, D), `key`/`value` (B, Hkv, q, D), `mask` transformers' boolean (B, 1, L, L) padding
    mask or None; `scaling` the layer's logit scale (`Scaling`). Outputs are (B, q, Hq, D).
    """

    name: ClassVar[str]
    summary: ClassVar[str]
    shares_prefill: ClassVar[bool] = True  # the prompt's output is plain causal attention (see the module doc)
    # A plugin's class that sets this replaces a registered method of the same name (never `full`).
    replaces: ClassVar[bool] = False
    # A quality reference that reads the whole cache to choose (`oracle`): labelled so by bench and report.
    ceiling: ClassVar[bool] = False
    # Named parameter sets (`preset=NAME`, listed by `refreshkv methods`): e.g. "paper", the seed paper's settings,
    # which stay reproducible by name whatever the defaults become.
    presets: ClassVar[dict[str, dict]] = {}
    # The parameters that set how much the method keeps: a budget frontier varies them and nothing else.
    budget_parameters: ClassVar[tuple[str, ...]] = ()
    # Why the method takes no `compress_every` (eviction methods' compression during decoding, core/selection.py).
    no_compression: ClassVar[str] = "it does not evict tokens during decoding"

    def store_prompt(
        self, layer: MethodLayer[State], query: Tensor, key: Tensor, value: Tensor, scaling: Scaling
    ) -> None:
        """Keep what the method needs of the prompt in `layer.state` (key/value: (B, Hkv, L, D), left-padded)."""
        raise NotImplementedError

    def prefill(
        self,
        layer: MethodLayer[State],
        query: Tensor,
        key: Tensor,
        value: Tensor,
        mask: Tensor | None,
        scaling: Scaling,
    ) -> Tensor:
        """The prompt's attention output; store the prompt. Override only together with `shares_prefill = False`."""
        self.store_prompt(layer, query, key, value, scaling)
        return prompt_attention(query, key, value, mask, scaling)

    def decode(self, layer: MethodLayer[State], query: Tensor, key: Tensor, value: Tensor, scaling: Scaling) -> Tensor:
        raise NotImplementedError

    def extend(self, layer: MethodLayer[State], query: Tensor, key: Tensor, value: Tensor, scaling: Scaling) -> Tensor:
        """Several new tokens after the prompt in one forward (a conversation's next question, drafted tokens):
        their attention outputs (B, q, Hq, D). By default they go through `decode` one at a time, each seeing the
        ones before it, exactly as if they had been decoded one per step (the method's own rule applies to each:
        StreamingLLM slides, H2O accumulates, SnapKV appends). A method that treats a block of new tokens otherwise
        overrides this and says so in its docstring (refreshkv: one full step that rebuilds C_p)."""
        return layer.decode_each(self.decode, query, key, value, scaling)

    def read_a_question(self, layer: MethodLayer[State]) -> bool:
        """Whether the block of new tokens `extend` just took was read as a new question (refreshkv rebuilt C_p from
        it), not as tokens decoded one by one: then assisted decoding, which drafts a block and forgets some of it,
        is refused (the cache's `crop`)."""
        return False

    def selection(self, layer: MethodLayer[State], query: Tensor, scaling: Scaling) -> Tensor | None:
        """(B, Hkv, m) positions of the tokens a step that does not attend to everything attends to (-1: none), for
        analysis (`refreshkv trace`), read after a decode step with its query: the tokens held, by default (what an
        eviction method attends to); a method with a partial cache gives it, one that chooses per step recomputes
        that step's choice; None where every step attends to every token."""
        return layer.state.kept(layer.pads)

    def decides_on_host(self, step: int) -> bool:
        """Whether decode step `step` (counted from 1) takes a decision from device values (`refreshkv`'s QC steps).
        Under `compile=True` on a CPU, where reading them costs nothing, such a step runs eagerly (compiled.py)."""
        return False

    def device_step_kind(self, step: int) -> str:
        """The kind of decode step `step` (counted from 1) is under static decoding (runtime/static_decode.py), from
        its number alone: each kind is captured as its own CUDA graph. "plain": every step alike."""
        return "plain"

    def runs_on_device(self, states: list[LayerState]) -> bool:
        """Whether `device_step` can decode from these prefilled layer states (static decoding refuses otherwise)."""
        return False

    def device_step(
        self, layer: DeviceLayer[State], query: Tensor, key: Tensor, value: Tensor, scaling: float
    ) -> Tensor:
        """One decode step with every per-step number on the device (core/device_steps.py): the new token's key and
        value written at `layer.counters`' position; returns its attention output (B, 1, Hq, D); calls
        `layer.record_full_share` once."""
        raise PolicyError(f"method '{self.name}' has no device step")

    def budget_for(self, prompt_length: int) -> int:
        """K for a batch whose longest prompt has `prompt_length` tokens (`MethodLayer.budget`); 0: no budget."""
        return 0

    def uses_word_spans(self) -> bool:
        """Whether the method reads the prompt's word spans (`MethodLayer.prompt_spans`, engine/spans.py): the cache
        then needs the model's tokenizer and the prompt's token ids. Methods with `pooling="span"` do."""
        return getattr(self, "pooling", None) == "span"

    def check_prompt(self, shortest: int) -> None:
        """Refuse (PolicyError) a batch whose shortest real prompt has `shortest` tokens if the method cannot work
        on it (e.g. a window longer than the prompt); called once per generation, before any layer's prefill."""

    def clamps(self, length: int, budget: int) -> list[str]:
        """What this generation uses in place of a parameter it cannot use as given (clamped rather than refused),
        one line each naming the parameter, the value given and the value used; the cache warns with each once per
        generation. `length`: the prompt's tokens (padding included), `budget`: K. By default: a pooling `kernel`
        wider than the prompt pools as the widest that fits (attention_math.pool)."""
        kernel = getattr(self, "kernel", None)
        if not isinstance(kernel, int) or kernel <= 1:
            return []
        before, after = pool_window(kernel, getattr(self, "pooling", "centered"))
        used = min(before, length - 1) + min(after, length - 1) + 1
        if used >= kernel:
            return []
        return [
            f"kernel {kernel} is wider than the prompt ({length} tokens): it pools as kernel {used}, the widest"
            " that fits"
        ]

    def check_layers(self, layers: int) -> None:
        """Refuse (PolicyError) a model of `layers` layers if the method cannot work on it (e.g. no layer left to
        select in); called once, when the cache is built."""

    def crop(self, layer: MethodLayer[State], tokens: int) -> None:
        """Forget the last `tokens` tokens (assisted decoding, a conversation that drops its answers); only a method
        that keeps every token can."""
        raise PolicyError(
            f"method '{self.name}' cannot forget its last tokens (it drops tokens as it goes); methods "
            f"that can: {', '.join(croppable_methods())}"
        )

    @classmethod
    def keep_everything(cls, context: int) -> dict[str, object]:
        """Parameters under which the method keeps and attends to every token of a model whose context is `context`
        tokens (prompt and answer together), so it must equal `full`."""
        return {}

    @classmethod
    def parameters(cls) -> dict[str, object]:
        """Parameter names and defaults, for `refreshkv methods` and validation."""
        return {f.name: f.default for f in dataclasses.fields(cls)}


@dataclasses.dataclass
class BudgetPolicy(Policy[State]):
    """A method that keeps (or attends to) K tokens: `budget` tokens, or `budget_ratio` of the prompt length.

    With both unset the ratio is 1/8, the seeds' setting. For a batch the ratio applies to the longest prompt.
    """

    budget_parameters: ClassVar[tuple[str, ...]] = ("budget", "budget_ratio")

    budget: int | None = None
    budget_ratio: float | None = None

    def __post_init__(self) -> None:
        check_budget(self.budget, self.budget_ratio)

    @classmethod
    def keep_everything(cls, context: int) -> dict[str, object]:
        return {"budget": context}  # the most a budget may be (`check_budget_fits`); a generation holds no more

    def budget_for(self, prompt_length: int) -> int:
        return resolve_budget(prompt_length, self.budget, self.budget_ratio)


def check_budget(budget: object, budget_ratio: object, names: tuple[str, str] = ("budget", "budget_ratio")) -> None:
    """The one rule for a budget's parameters (methods, `refreshkv train`, the recovery task): `budget` an integer
    >= 1 or `budget_ratio` a number in (0, 1], not both. `names`: how the caller's user spells the two."""
    budget_name, ratio_name = names
    if budget is not None and budget_ratio is not None:
        raise PolicyError(f"give either {budget_name} or {ratio_name}, not both")
    check_positive(budget_name, budget, allow_none=True)
    if budget_ratio is not None and not (is_number(budget_ratio) and 0 < budget_ratio <= 1):
        raise PolicyError(f"{ratio_name} must be a number in (0, 1], got {budget_ratio!r}")


def check_budget_fits(policy: Policy, context: object) -> None:
    """The one rule for a budget against a model (the Python API's caches, the command line before and after the
    model loads, lm-eval's model_args): `budget` at most the model's context of `context` tokens (None: not known).
    A larger K could never be reached: a prompt and its answer fit in the context, so it would keep everything."""
    budget = getattr(policy, "budget", None)
    if is_number(context) and isinstance(budget, int) and not isinstance(budget, bool) and budget > context:
        raise PolicyError(
            f"budget ({budget}) is above the model's context of {int(context)} tokens; give a budget of at most "
            f"{int(context)} tokens, or a budget_ratio in (0, 1]"
        )


def ratio_or_default(budget_ratio: float | None) -> float:
    """The share of the prompt that K is when no `budget` is given: `budget_ratio`, 1/8 (the seeds') if unset."""
    return DEFAULT_BUDGET_RATIO if budget_ratio is None else budget_ratio


def resolve_budget(prompt_length: int, budget: int | None = None, budget_ratio: float | None = None) -> int:
    """K for a prompt of `prompt_length` tokens (a batch's longest): `budget`, else ceil(ratio * prompt_length) and
    at least 1 (`ratio_or_default`). Refuses what `check_budget` refuses."""
    check_budget(budget, budget_ratio)
    if budget is not None:
        return budget
    return max(1, math.ceil(ratio_or_default(budget_ratio) * prompt_length))


def is_number(value: object) -> TypeGuard[int | float]:
    """A finite int or float (not a bool, not text)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_window(name: str, window: int, prompt_length: int) -> None:
    """The one rule for observation windows: every row's prompt must hold the whole window."""
    if window > prompt_length:
        raise PolicyError(f"{name} ({window}) is larger than the prompt ({prompt_length} tokens)")


def check_positive(name: str, value: object, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PolicyError(f"{name} must be an integer >= 1, got {value!r}")


def check_kernel(value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1 or value % 2 == 0:
        raise PolicyError(f"kernel must be an odd integer >= 1, got {value!r}")


def check_choice(name: str, value: object, choices: Collection[str]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise PolicyError(f"unknown {name} '{value}'; choose from: {', '.join(choices)}")


METHODS: dict[str, type[Policy]] = {}
PROVIDERS: dict[str, str] = {}  # method name -> the package that provides it ("refreshkv" for the built-in ones)
BUILT_IN = "refreshkv"
REFERENCE_METHOD = "full"  # every "vs full" figure is computed against it: never replaced


def register(cls: type[Policy], provider: str = BUILT_IN) -> type[Policy]:
    """Add a method to the registry under `cls.name`. A name already taken is refused (PolicyError), unless the class
    says `replaces = True` (a plugin replacing a built-in, recorded in PROVIDERS); `full` is never replaced."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise PolicyError(f"{cls.__name__} has no method name (a class attribute `name`)")
    registered = METHODS.get(name)
    if registered is not None and registered is not cls:
        if name == REFERENCE_METHOD:
            raise PolicyError(
                f"method '{name}' is the reference of every comparison and cannot be replaced "
                f"({cls.__module__}.{cls.__qualname__} from {provider})"
            )
        if not cls.replaces:
            raise PolicyError(
                f"method '{name}' is already registered (from {PROVIDERS.get(name, BUILT_IN)}); "
                f"{cls.__module__}.{cls.__qualname__} from {provider} must set `replaces = True` to "
                "replace it"
            )
    METHODS[name] = cls
    PROVIDERS[name] = provider
    return cls


def label_notes(name: str, provider: str | None = None) -> str:
    """What tables add to a method's name: ` (ceiling)` for a quality reference that reads the whole cache to choose
    (oracle), ` (from PACKAGE)` where another package provides it (a plugin, e.g. one that replaced a built-in
    method). `provider`: as a result row records it; None: this process's registry."""
    cls = METHODS.get(name)
    provider = PROVIDERS.get(name, BUILT_IN) if provider is None else provider
    notes = ["ceiling"] if cls is not None and cls.ceiling else []
    notes += [f"from {provider}"] if provider != BUILT_IN else []
    return "".join(f" ({note})" for note in notes)


def croppable_methods(drafts: bool = False) -> list[str]:
    """The registered methods that can forget their last tokens (`crop`); with `drafts`, of them those that take a
    block of new tokens as tokens decoded one by one (what assisted decoding needs)."""
    return sorted(
        name
        for name, cls in METHODS.items()
        if cls.crop is not Policy.crop and not (drafts and cls.read_a_question is not Policy.read_a_question)
    )


def accepted_parameters(cls: type[Policy]) -> set[str]:
    """What `make_policy` takes for a method: its parameters, and `preset` where it has presets."""
    return set(cls.parameters()) | ({"preset"} if cls.presets else set())


def make_policy(name: str, preset: str | None = None, **params: object) -> Policy:
    """Build a method by name; parameters set to None are left at their defaults (or at `preset`'s values, which
    parameters given beside it override). A name or preset that is not a string is refused in one line."""
    if not isinstance(name, str):
        raise PolicyError(
            f"method must be a method name (a string), got {type(name).__name__} {shorten(name)}; choose from: "
            f"{', '.join(sorted(METHODS))}"
        )
    if name not in METHODS:
        raise PolicyError(f"unknown method '{name}'; choose from: {', '.join(sorted(METHODS))}")
    cls = METHODS[name]
    allowed = cls.parameters()
    given = {k: v for k, v in params.items() if v is not None}
    if preset is not None:
        if not isinstance(preset, str) or preset not in cls.presets:
            raise PolicyError(
                f"method '{name}' has no preset {shorten(preset)}; its presets: {', '.join(cls.presets) or 'none'}"
            )
        given = {**cls.presets[preset], **given}
    unknown = sorted(set(given) - set(allowed))
    if "compress_every" in unknown:
        takers = ", ".join(sorted(n for n, c in METHODS.items() if "compress_every" in c.parameters()))
        raise PolicyError(
            f"method '{name}' cannot compress during decoding (compress_every): {cls.no_compression}; methods that "
            f"can: {takers}"
        )
    if unknown:
        names = ", ".join(allowed) or "none"
        raise PolicyError(f"method '{name}' has no parameter {', '.join(unknown)}; its parameters: {names}")
    return cls(**given)


def shorten(value: object, limit: int = 60) -> str:
    """`repr(value)` in at most `limit` characters, on one line (for a refusal that quotes what it was given)."""
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_method_given(name: str, method: object) -> None:
    """`method` (the argument `name`) is a method name or a method object: anything else is one line."""
    if not isinstance(method, (str, Policy)):
        raise PolicyError(
            f"{name} must be a method name or a make_policy(...) object, got {type(method).__name__} "
            f"{shorten(method)}; the methods: {', '.join(sorted(METHODS))}"
        )


def policy_of(method: str | Policy, **params: Any) -> Policy:
    """`method` as a Policy: a name is built with `params` (`make_policy`); a Policy object is taken as it is and
    refuses parameters beside it, which it would ignore (its own were set when it was made)."""
    if not isinstance(method, Policy):
        check_method_given("method", method)
        return make_policy(method, **params)
    if params:
        raise PolicyError(
            f"method is a '{method.name}' object, made with its parameters; {', '.join(sorted(params))} beside it "
            "would be ignored: give them to make_policy, or give the method by name"
        )
    return method
