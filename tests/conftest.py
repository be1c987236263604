import atexit
import functools
import os
import shutil
import tempfile

# One CPU thread for the tests and the commands they start, unless OMP_NUM_THREADS says otherwise: the models here
# are tiny or small, and a second thread mostly waits for the first at every operator. On a busy machine each such
# wait can last a scheduler slice (tens of ms), which made the suite 2-10x slower; the tests that are about threads
# (test_native_selection.py, test_quantized_store.py) set their counts themselves.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

# family: (model class, config class, what the family needs besides the common sizes)
FAMILIES = {
    "llama": (LlamaForCausalLM, LlamaConfig, {}),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, {}),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config, {"head_dim": 16}),
    "mistral": (MistralForCausalLM, MistralConfig, {"sliding_window": None}),
    "phi3": (Phi3ForCausalLM, Phi3Config, {"pad_token_id": 0}),
    # soft-capped attention logits (a cap small enough to matter), alternating sliding-window and global layers
    "gemma2": (Gemma2ForCausalLM, Gemma2Config, {"head_dim": 16, "sliding_window": 16, "attn_logit_softcapping": 5.0}),
    # 6 layers: Gemma 3's pattern of 5 sliding-window layers and 1 global layer
    "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig, {"head_dim": 16, "sliding_window": 16, "num_hidden_layers": 6}),
}

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # in case torch had started its threads before

import refreshkv  # noqa: E402, F401  (registers the attention function)


@functools.cache
def tiny_tokenizer_folder() -> str:
    """A saved 128-token tokenizer for the tiny models (what `pooling="span"` reads beside a model): token i is
    '▁w<i>' (starts a word) for even i and 'w<i>' (continues one) for odd i; token 0 is the special `<unk>`."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{(f"▁w{i}" if i % 2 == 0 else f"w{i}"): i for i in range(1, 128)}}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")))
    tokenizer.unk_token = "<unk>"
    folder = tempfile.mkdtemp(prefix="refreshkv-tiny-tokenizer-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)  # one per test process, not left behind
    tokenizer.save_pretrained(folder)
    return folder


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
    model_class, config_class, needs = FAMILIES[family]
    model = model_class(config_class(**{**common, **needs, **overrides}))
    model.config._name_or_path = tiny_tokenizer_folder()  # as a saved model's folder holds its tokenizer
    # Random init gives near-uniform logits; sharpen them so greedy decoding is not decided by rounding.
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
        if getattr(model.config, "attn_logit_softcapping", None):  # soft-capping acts on large logits only
            for name, weight in model.named_parameters():
                if name.endswith(("q_proj.weight", "k_proj.weight")):
                    weight.mul_(8)
    return model.eval()


@pytest.fixture
def one_thread():
    """Tiny models decode fastest on one thread: a second one only waits for it (seconds on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def forward_shapes(model) -> list[tuple[int, ...]]:
    """A list that records the shape of the token ids of every forward pass of `model` from now on."""
    shapes = []

    def record(_, args, kwargs):
        shapes.append(tuple((args[0] if args else kwargs["input_ids"]).shape))

    model.register_forward_pre_hook(record, with_kwargs=True)
    return shapes


@pytest.fixture(scope="session")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="session")
def qwen2():
    return tiny_model("qwen2")


def random_prompt(length: int, seed: int = 1, batch: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (batch, length), generator=generator)
