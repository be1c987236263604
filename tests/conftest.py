import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import refreshkv  # noqa: F401  (registers the attention function)


def tiny_model(family: str = "llama", layers: int = 3, seed: int = 0, **overrides):
    """A randomly initialised model with GQA (4 query heads, 2 KV heads), small enough for unit tests."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        attn_implementation="refreshkv",
    )
    common.update(overrides)
    if family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif family == "mistral":
        model = MistralForCausalLM(MistralConfig(**{"sliding_window": None, **common}))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    # Random init gives near-uniform logits; sharpen them so greedy decoding is not decided by rounding.
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    return model.eval()


@pytest.fixture(scope="session")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="session")
def qwen2():
    return tiny_model("qwen2")


def random_prompt(length: int, seed: int = 1, batch: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (batch, length), generator=generator)
