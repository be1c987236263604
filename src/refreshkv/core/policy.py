"""The protocol every KV method implements, its parameters, and the registry by name.

A method is a dataclass of its parameters (validated in `__post_init__`) with two hooks called by the attention
function for each layer: `prefill` (the prompt; must return the attention output and set up the layer's state) and
`decode` (one new token). State lives on the `PolicyLayer` the hook receives (`layer.state`), so one policy object
serves all layers of a cache.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from .cache import PolicyLayer

DEFAULT_BUDGET_RATIO = 1 / 8  # the seeds' setting: K = L / 8


class PolicyError(ValueError):
    """Invalid method name or parameter; the message is one line naming the allowed values."""


@dataclasses.dataclass
class Policy:
    name: ClassVar[str]
    summary: ClassVar[str]

    def prefill(self, layer: PolicyLayer, query, key, value, mask, scaling: float) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, layer: PolicyLayer, query, key, value, scaling: float) -> torch.Tensor:
        raise NotImplementedError

    @classmethod
    def parameters(cls) -> dict[str, object]:
        """Parameter names and defaults, for `refreshkv methods` and validation."""
        return {f.name: f.default for f in dataclasses.fields(cls)}


@dataclasses.dataclass
class BudgetPolicy(Policy):
    """A method that keeps (or attends to) K tokens: `budget` tokens, or `budget_ratio` of the prompt length.

    With both unset the ratio is 1/8, the seeds' setting. For a batch the ratio applies to the longest prompt.
    """

    budget: int | None = None
    budget_ratio: float | None = None

    def __post_init__(self):
        if self.budget is not None and self.budget_ratio is not None:
            raise PolicyError("give either budget or budget_ratio, not both")
        if self.budget is not None and (not isinstance(self.budget, int) or self.budget <= 0):
            raise PolicyError(f"budget must be a positive integer number of tokens, got {self.budget!r}")
        if self.budget_ratio is not None and not (0 < self.budget_ratio <= 1):
            raise PolicyError(f"budget_ratio must be in (0, 1], got {self.budget_ratio!r}")

    def budget_for(self, prompt_length: int) -> int:
        if self.budget is not None:
            return self.budget
        ratio = DEFAULT_BUDGET_RATIO if self.budget_ratio is None else self.budget_ratio
        return max(1, math.ceil(ratio * prompt_length))


def check_positive(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PolicyError(f"{name} must be an integer >= 1, got {value!r}")


def check_kernel(value) -> None:
    if not isinstance(value, int) or value < 1 or value % 2 == 0:
        raise PolicyError(f"kernel must be an odd integer >= 1, got {value!r}")


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise PolicyError(f"unknown {name} '{value}'; choose from: {', '.join(choices)}")


METHODS: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    METHODS[cls.name] = cls
    return cls


def make_policy(name: str, **params) -> Policy:
    """Build a method by name; parameters set to None are left at their defaults."""
    if name not in METHODS:
        raise PolicyError(f"unknown method '{name}'; choose from: {', '.join(sorted(METHODS))}")
    cls = METHODS[name]
    allowed = cls.parameters()
    given = {k: v for k, v in params.items() if v is not None}
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        names = ", ".join(allowed) or "none"
        raise PolicyError(f"method '{name}' has no parameter {', '.join(unknown)}; its parameters: {names}")
    return cls(**given)
