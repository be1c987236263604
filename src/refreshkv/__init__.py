"""refreshkv: RefreshKV, Recycled Attention and KV-cache eviction baselines on Hugging Face transformers."""

from . import attention  # noqa: F401  (registers the "refreshkv" attention implementation)
from .cache import PolicyCache
from .generate import GenerationOutput, generate
from .model import load_model
from .policy import METHODS, Policy, PolicyError, make_policy

__all__ = ["GenerationOutput", "METHODS", "Policy", "PolicyCache", "PolicyError", "generate", "load_model", "make_policy"]
