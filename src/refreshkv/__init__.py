"""refreshkv: RefreshKV, Recycled Attention and KV-cache eviction baselines on Hugging Face transformers."""

from .environment import SharedEnvironmentError, refuse

try:
    from .core.policy import METHODS, Policy, PolicyError, make_policy
    from .engine import attention  # noqa: F401  (registers the "refreshkv" attention implementation)
    from .engine.cache import PolicyCache
    from .engine.cache_argument import with_cache
    from .methods import load_methods
    from .runtime.generate import GenerationOutput, generate, generate_many
    from .runtime.generation_settings import GenerationSettings
    from .runtime.loading import load_model
    from .runtime.packed_linear import pack_linear_weights
    from .runtime.weight_layout import fastest_layout
except (ImportError, RuntimeError) as error:  # vLLM's torchvision beside this torch: one line (environment.py)
    refuse(error)
    raise

load_methods()

__all__ = [
    "GenerationOutput",
    "GenerationSettings",
    "METHODS",
    "Policy",
    "PolicyCache",
    "PolicyError",
    "SharedEnvironmentError",
    "fastest_layout",
    "generate",
    "generate_many",
    "load_model",
    "make_policy",
    "pack_linear_weights",
    "with_cache",
]
