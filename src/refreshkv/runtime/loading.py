"""Loading models fully offline: a named model (models.py; default `smollm2-135m`), any local Hugging Face
directory, or a GGUF file.

Parsing a GGUF takes 30-70 s, so the first load converts it once to safetensors + tokenizer files in the cache folder
(cache_folder.py), keyed by its content; later loads take about a second, and use the conversion only if its files are
the ones it recorded (conversion_record.py; otherwise it is converted again). Nothing here ever contacts a model hub.
Every failure to read a model (a name not known, a package missing or incomplete, weights that do not load, a cache that
cannot be written) is one `ModelError` line naming what was expected.

No code from a model folder ever runs: a folder whose config.json or tokenizer_config.json names its own classes
(`auto_map`, which transformers would offer to import from the folder's .py files) is refused in one line before
transformers reads it, and every transformers call passes `trust_remote_code=False`, so that it refuses anything
else that needs custom code instead of asking whether to run it.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import tempfile
import warnings
from pathlib import Path

import torch

from ..core.policy import shorten
from ..environment import refuse
from . import conversion_record
from .cache_folder import cache_dir, exclusive, file_hash
from .models import DEFAULT_MODEL, NAMED_MODELS, ModelError, NamedModel, looks_like_a_name, named_model

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3_text")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


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
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, trust_remote_code=False
        )
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, trust_remote_code=False)
    except Exception as error:  # a damaged file fails anywhere in the parser, e.g. reshaping a truncated tensor
        raise ModelError(
            f"cannot read {gguf} as a GGUF model ({_first_line(error)}); is it truncated or damaged?"
        ) from None
    _check_family(model.config)
    # save_pretrained refuses a model that still claims to be gguf-quantized; its weights are plain fp32 now.
    model.hf_quantizer = None  # type: ignore[assignment]  # from_pretrained sets it; PreTrainedModel does not declare it
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


def writable(folder: Path) -> None:
    """Create the cache folder (mode 0700), or refuse in one line before any long work."""
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        probe = folder / f".write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as error:
        raise ModelError(
            f"the model cache {folder} is not writable ({error.strerror or error}); "
            "set REFRESHKV_CACHE to a writable folder"
        ) from None


def private(folder: Path) -> None:
    """Refuse, in one line, a cache folder that another user may write (ssh's rule for its own files): whoever can
    write it could change a conversion and the record that vouches for it."""
    try:
        stat = folder.stat()
    except OSError:
        return  # none yet: `writable` makes it (mode 0700) or says why it cannot
    if stat.st_uid != os.geteuid() or stat.st_mode & 0o022:
        raise ModelError(
            f"the model cache {folder} may be written by another user (owner uid {stat.st_uid}, mode "
            f"{stat.st_mode & 0o777:o}); give a folder only you can write (chmod go-w), or set REFRESHKV_CACHE"
        )


def converted(stem: str, key: str, gguf_of) -> Path:
    """The conversion of a GGUF with content hash `key` (cache/<stem>-<key[:16]>), made once under a lock:
    concurrent first loads convert once, the others wait and then find it. `gguf_of(folder)` gives the GGUF, written
    into `folder` if it must be made, and whether to delete it afterwards. A conversion found in the cache is used
    only if its folder holds exactly what the conversion recorded (conversion_record.py); any other is converted
    again, said in one warning line."""
    target = cache_dir() / f"{stem}-{key[:16]}"
    private(cache_dir())
    if target.is_dir() and conversion_record.problem(target) is None:
        return target
    writable(target.parent)
    with exclusive(target):
        if target.exists():
            why = conversion_record.problem(target)
            if why is None:  # converted meanwhile by a load that held the lock first
                return target
            warnings.warn(
                f"refreshkv: the converted model in {target} is not used: {why}; converting the GGUF again",
                stacklevel=4,  # the caller of load_model
            )
            _discard(target)
        gguf, temporary = gguf_of(target.parent)
        try:
            _convert_gguf(gguf, target)
        finally:
            if temporary:
                gguf.unlink(missing_ok=True)
        conversion_record.record(target)
    return target


def _discard(folder: Path) -> None:
    """Remove a cached folder: renamed aside first, so that its name is free at once."""
    aside = folder.with_name(f".{folder.name}.discarded-{os.getpid()}")
    folder.rename(aside)
    shutil.rmtree(aside, ignore_errors=True)


def refuse_custom_code(model_dir: Path) -> None:
    """Refuse a model folder that asks to run its own code (`auto_map` in config.json or tokenizer_config.json)."""
    for name in ("config.json", "tokenizer_config.json"):
        try:
            data = json.loads((model_dir / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):  # missing or not JSON: transformers says what is wrong with it
            continue
        if isinstance(data, dict) and "auto_map" in data:
            classes = data["auto_map"] if isinstance(data["auto_map"], dict) else {}
            raise ModelError(
                f"model folder {model_dir} asks to run its own code ({name} has auto_map"
                f"{': ' + ', '.join(sorted(classes)) if classes else ''}); this package never runs code from a model "
                f"folder: give a model of a supported family ({', '.join(SUPPORTED_FAMILIES)}) without custom code"
            )


def named_model_dir(model: NamedModel) -> Path:
    model.check_installed()
    return converted(Path(model.gguf_name).stem, model.content_key(), model.write_gguf)


def resolve_model_dir(path: str | os.PathLike | None = None) -> Path:
    """A local directory with config + weights for `path`: a named model (None = the default), a model folder, or a
    .gguf file (converted on first use)."""
    if path is None or named_model(str(path)):
        return named_model_dir(NAMED_MODELS[DEFAULT_MODEL if path is None else str(path)])
    p = Path(path).expanduser()
    if not p.exists():
        if looks_like_a_name(str(path)):
            raise ModelError(
                f"unknown model '{path}'; give a named model ({', '.join(NAMED_MODELS)}), a local model "
                "directory or a .gguf file"
            )
        raise ModelError(
            f"model path '{path}' does not exist; give a named model ({', '.join(NAMED_MODELS)}), a "
            "local model directory or a .gguf file"
        )
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelError(f"model directory '{path}' has no config.json; give a Hugging Face model directory")
        refuse_custom_code(p)
        return p
    if p.suffix != ".gguf":
        raise ModelError(f"model path '{path}' is neither a directory nor a .gguf file")
    return converted(p.stem, file_hash(p), lambda folder: (p, False))


def load_model(path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """Load (model, tokenizer) offline: `path` a named model (`smollm2-135m`, the default when None;
    `gemma3-270m`), a local model folder or a .gguf file. The model uses this library's attention function.
    Arguments of the wrong type or value are refused in one `ModelError` line before anything is read."""
    check_load_arguments(path, dtype, device)
    _offline()
    try:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    except (ImportError, RuntimeError) as error:  # vLLM's torchvision beside this torch: one line
        refuse(error)
        raise

    from ..engine.attention import ATTENTION_NAME

    model_dir = resolve_model_dir(path)
    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as error:
        raise _unloadable(model_dir, error) from None
    _check_family(config)
    try:
        with warnings.catch_warnings():  # torch.load's unpickler warns about the file before refusing it
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_pretrained(
                model_dir,
                dtype=dtype,
                attn_implementation=ATTENTION_NAME,
                local_files_only=True,
                trust_remote_code=False,
            ).to(device)  # type: ignore[arg-type]  # `to` wears functools.wraps, which mypy reads as unbound
    except pickle.UnpicklingError:  # torch's own text goes on to suggest weights_only=False: not to be followed
        reason = "torch.load(weights_only=True) refused it (a pickle that is not plain tensors, or not a checkpoint)"
        raise _unloadable(model_dir, RuntimeError(reason), weights=True) from None
    except Exception as error:  # the weights' readers (safetensors, torch.load's unpickler) fail in many ways
        raise _unloadable(model_dir, error, weights=True) from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as error:
        raise _unloadable(model_dir, error) from None
    model.eval()
    check_attention(model)
    return model, tokenizer


def check_load_arguments(path: object, dtype: object, device: object) -> None:
    """`path` None, a string or an os.PathLike; `dtype` a floating torch dtype (or its name, which transformers
    takes too); `device` one torch knows and this machine has."""
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise ModelError(
            f"path must be a named model ({', '.join(NAMED_MODELS)}), a model folder or a .gguf file, as a string or "
            f"os.PathLike (None: {DEFAULT_MODEL}), got {type(path).__name__} {shorten(path)}"
        )
    named = getattr(torch, dtype, None) if isinstance(dtype, str) and dtype.isidentifier() else dtype
    if not isinstance(named, torch.dtype) or not named.is_floating_point:  # transformers also takes the name
        raise ModelError(
            "dtype must be a floating torch dtype or its name, e.g. torch.float32 or 'bfloat16', got "
            f"{type(dtype).__name__} {shorten(dtype)}"
        )
    try:
        kind = torch.device(device).type  # type: ignore[call-overload]  # any value: refused below if no device
    except (RuntimeError, TypeError, ValueError):
        raise ModelError(
            f"device must be a torch device such as 'cpu' or 'cuda' (a string or torch.device), got "
            f"{type(device).__name__} {shorten(device)}"
        ) from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ModelError(f"device {str(device)!r} was asked for but no CUDA GPU is available here; give device='cpu'")


def check_attention(model) -> None:
    """Refuse, before any work, a model whose attention the methods cannot run exactly: a layer that bypasses the
    registered attention function (a custom attention module) or whose sliding window differs from its config.
    One 2-token forward through a `full` cache finds both."""
    from ..core.policy import PolicyError, make_policy
    from ..engine.cache import PolicyCache
    from ..engine.cache_argument import with_cache
    from ..engine.handoff import check_handoff_taken

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


def _unloadable(model_dir: Path, error: BaseException, weights: bool = False) -> ModelError:
    """One line for a model folder transformers cannot load (no weights, invalid config, weights that do not read:
    safetensors, or a .bin that torch.load refuses), naming the files and what would load."""
    if weights:
        files = sorted(p.name for p in model_dir.iterdir() if p.suffix in WEIGHT_SUFFIXES) or ["no weight file"]
        what = f"the weights in {model_dir} ({', '.join(files)})"
    else:
        what = f"the model in {model_dir}"
    if model_dir.parent == cache_dir():
        hint = f"; it is a cached conversion: delete {model_dir} to convert the GGUF again"
    elif weights:
        hint = "; expected safetensors files, or a PyTorch .bin that torch.load(weights_only=True) accepts"
    else:
        hint = "; give a Hugging Face model directory with config.json, weights and tokenizer files"
    return ModelError(f"cannot load {what}: {_first_line(error)[:200]}{hint}")
